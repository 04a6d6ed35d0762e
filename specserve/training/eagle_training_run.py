"""Training an EAGLE head end to end, the work behind `python -m specserve.train_eagle`
(train_eagle.py reads the flags; this module loads torch, the target and the trainers):
the data (the target's answers, generated through our Engine, and the chats' fixed text),
the head trained until its plan or --time-budget ends, saved, and scored on held-out
answers before and after."""
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
from specserve.speculative.heads.eagle_checkpoint import save_head
from specserve.speculative.heads.eagle_head import EagleHead
from specserve.speculative.heads.fp8_rows import FP8
from specserve.training.draft_vocab import most_frequent_tokens
from specserve.training.eagle_batches import BatchBuilder, plan_batches
from specserve.training.eagle_data import (Conversation, generate_conversations, load_conversations,
                                               save_conversations)
from specserve.training.eagle_engine import generating_engine
from specserve.training.eagle_eval import accept_length
from specserve.training.eagle_prep import PreparedText, TextPreparation, TextSettings
from specserve.training.eagle_trainer import EagleTrainer, TrainSettings, build_head, kept_head, target_lm_head
from specserve.training.eagle_ttt import ConversationBatch
from specserve.training.state_store import DEVICE_SHARE, HOST_SHARE
from specserve.training.target_features import TargetFeatureExtractor

DATA_FILE = "conversations.json"
# what a run keeps back from --time-budget for the end: the last held-out score (timed at
# the first), saving the head, and this much slack
END_SLACK_SECONDS = 5.0
# what --answers-only keeps back from --time-budget: the answers in flight at the deadline finish
# (up to --max-new-tokens decode steps) and are saved
ANSWERS_SLACK_SECONDS = 30.0
# fewer optimizer steps than this leave a head close to its random start: its accept length says
# little (a 240 s CPU run trained 1 step and scored 1.000)
MIN_TRAIN_STEPS = 20
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
STATE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float8": FP8}   # --state-dtype


def train_head(args: argparse.Namespace, started: float, device_defaults: dict[str, dict]) -> None:
    """The whole run for parsed flags; `device_defaults` ("cuda" / "cpu" -> values) fill the
    sizes left unset, by the device the run resolves to."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    batch_tokens_set = args.batch_tokens is not None
    for name, value in device_defaults["cuda" if device.type == "cuda" else "cpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.reuse_answers and not os.path.isfile(os.path.join(args.output_dir, DATA_FILE)):
        raise SystemExit(f"train_eagle: --reuse-answers: no answers saved in {args.output_dir} ({DATA_FILE}); "
                         "make them with --answers-only first")
    target, generated, held_out, reply_text = _prepare_data(args, device, dtype, started)
    if args.answers_only:
        print(f"answers saved: {len(generated)} training answers ({sum(c.answer_len for c in generated)} answer "
              f"tokens) and {len(held_out)} held out, in {os.path.join(args.output_dir, DATA_FILE)} "
              f"(at {time.perf_counter() - started:.0f} s); --reuse-answers trains on them", flush=True)
        return
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
    reading = (args.resume or args.reuse_answers) and os.path.isfile(os.path.join(args.output_dir, DATA_FILE))
    with TextPreparation(_text_settings(args, need_prompts=not reading), background=device.type == "cuda") as text:
        with generating_engine(args, device, dtype) as engine:
            print(f"engine ready in {time.perf_counter() - run_started:.0f} s", flush=True)
            prompts = text.prompts()
            print(prompts.summary() + _waited(text), flush=True)
            generated, held_out = _conversations(args, engine, prompts, run_started)
            target = engine.core.runner.model
        del engine
        if args.answers_only:   # no training: the fixed text is not waited for
            return target, generated, held_out, []
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
    lengths = [len(c.tokens) for c in train_data + held_out]
    if args.init_from:
        head = kept_head(target, args.init_from)
    else:
        draft_vocab = most_frequent_tokens((c.answer_tokens() for c in train_data), target.config.vocab_size,
                                           min(args.draft_vocab_size, target.config.vocab_size))
        head = build_head(target, args.algorithm, draft_vocab, max_positions=max(lengths) + args.ttt_steps + 1,
                          intermediate_size=args.intermediate_size)
    extractor = TargetFeatureExtractor(target, head.config.aux_layers, max(settings.batch_tokens, max(lengths)),
                                       max_sequences=max(1, settings.batch_tokens // min(lengths)),
                                       max_sequence_len=max(lengths))
    eval_steps = args.eval_draft_steps or args.ttt_steps
    score = _held_out_scorer(extractor, head, held_out, settings, eval_steps)
    scoring_started = time.perf_counter()
    before = score(head)
    score_seconds = time.perf_counter() - scoring_started
    if args.time_budget:
        _seconds_left(args, started, score_seconds)   # spent already: stop before making the store
    settings = _settings(args, device, args.max_train_seconds)
    builder = BatchBuilder(extractor, target_lm_head(target)[head.draft_vocab()], bool(head.config.aux_layers))
    trainer = EagleTrainer(head, builder, train_data, settings, args.output_dir,
                           evaluate=score if args.eval_every else None)
    _report_state_store(trainer, "room")
    train_seconds = args.max_train_seconds
    if args.time_budget:
        # what is left now: the states are kept as the batches first train, inside training's seconds
        train_seconds = _seconds_left(args, started, score_seconds)
        trainer.settings = dataclasses.replace(trainer.settings, max_seconds=train_seconds)
    if args.resume and trainer.resume():
        if train_seconds is not None:
            # this run's seconds come on top of those trained before (a later call of one GPU lease)
            trainer.settings = dataclasses.replace(trainer.settings, max_seconds=trainer.elapsed + train_seconds)
    else:
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
    _report_state_store(trainer, "kept")
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


def _report_state_store(trainer: EagleTrainer, when: str) -> None:
    """when "room": what the store can keep (before training); "kept": what it keeps and how
    many batches the target computed."""
    store, total = trainer.store, sum(len(c.tokens) for c in trainer.conversations)
    if store is None:
        print("target states: computed for each batch (not one batch's fit on the device)", flush=True)
        return
    dtype = "float8 e4m3" if store.dtype == FP8 else str(store.dtype).removeprefix("torch.")
    host = trainer.host_store
    if when == "room":
        beside = "" if host is None else f", {host.capacity} more in host memory ({host.nbytes / 2 ** 30:.2f} GiB)"
        print(f"target states: room for {min(store.capacity, total)} of {total} tokens as {dtype} "
              f"({store.nbytes / 2 ** 30:.2f} GiB on {store.device.type}){beside}, kept as the batches are first "
              f"computed", flush=True)
        return
    beside = "" if host is None else f", and {host.used} more in host memory ({host.nbytes / 2 ** 30:.2f} GiB)"
    print(f"target states: {store.used} of {total} tokens kept as {dtype} ({store.nbytes / 2 ** 30:.2f} GiB on "
          f"{store.device.type}){beside}; {trainer.target_forwards} batches' states computed by the target in this "
          f"run, the others' read back", flush=True)


def _report_step_split(trainer: EagleTrainer, device: torch.device) -> None:
    """Where the training steps' time went: the host, or waiting for the device."""
    steps = max(trainer.timed_steps, 1)
    memory = ""
    if device.type == "cuda":
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        memory = f"; allocator retries: {retries}, peak {torch.cuda.max_memory_allocated(device) / 2 ** 30:.1f} GiB"
    # launches block once the device's queue is full: a short wait does not prove the step host-bound
    print(f"per training step: {1e3 * trainer.host_seconds / steps:.0f} ms building and launching (a launch "
          f"waits while the device's queue is full: not host work alone), "
          f"{1e3 * trainer.wait_seconds / steps:.0f} ms waiting for the device{memory}", flush=True)


def _conversations(args: argparse.Namespace, engine, text: PreparedText,
                   run_started: float) -> tuple[list[Conversation], list[Conversation]]:
    """(training, held-out) answers of the target: generated, or read back from --output-dir on
    --resume or --reuse-answers. With --time-budget, generation stops at --generation-share of
    the time left once it starts (H100, 1.5B: loading and tokenizing 9.5k prompts took 75 s,
    past a deadline counted from the start: the head trained on no generated answer); with
    --answers-only at the budget's end (ANSWERS_SLACK_SECONDS kept back), and answers saved
    already are kept and the prompts after them answered (the prompts come in the same order
    for the same data flags: turn_prompts)."""
    path = os.path.join(args.output_dir, DATA_FILE)
    saved = load_conversations(path) if os.path.isfile(path) else None
    if saved is not None and (args.resume or args.reuse_answers):
        return saved[args.held_out:], saved[:args.held_out]
    started = time.perf_counter()
    deadline = None
    if args.time_budget:
        left = args.time_budget - (started - run_started)
        deadline = started + (left - ANSWERS_SLACK_SECONDS if args.answers_only else args.generation_share * left)
    in_flight = engine.core.runner.max_running_requests
    held_out, done = [], []
    if args.answers_only and saved is not None:
        held_out, done = saved[:args.held_out], saved[args.held_out:]
        if len(held_out) != args.held_out:
            raise SystemExit(f"train_eagle: {path} holds {len(saved)} answers, fewer than --held-out "
                             f"{args.held_out}: give the --held-out it was made with")
        print(f"{len(done)} training answers saved already: answering the prompts after them", flush=True)
    prompts = text.prompts[len(done):]
    held_out_prompts = [] if held_out else text.held_out_prompts
    with _progress(len(prompts) + len(held_out_prompts), "generating answers") as bar:
        made_held_out = generate_conversations(engine, held_out_prompts, args.max_new_tokens, 0.0, bar.update,
                                               max_in_flight=in_flight)
        # the seeds follow each prompt's place in the whole list, as in one uninterrupted run
        more = generate_conversations(engine, prompts, args.max_new_tokens, args.temperature, bar.update,
                                      seed=args.seed + len(done), max_in_flight=in_flight, deadline=deadline)
    held_out = held_out or made_held_out
    answer_tokens = sum(c.answer_len for c in made_held_out + more)
    elapsed = time.perf_counter() - started
    print(f"generated {answer_tokens} answer tokens in {elapsed:.1f} s ({answer_tokens / elapsed:.0f} tok/s)")
    save_conversations(path, held_out + done + more)
    return done + more, held_out


def _settings(args: argparse.Namespace, device: torch.device, max_seconds: float | None) -> TrainSettings:
    on_gpu = device.type == "cuda"
    return TrainSettings(ttt_steps=args.ttt_steps, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                         max_seconds=max_seconds, checkpoint_every=args.checkpoint_every, seed=args.seed,
                         weight_decay=args.weight_decay, eval_every=args.eval_every,
                         autocast_dtype=torch.bfloat16 if on_gpu else None,
                         state_dtype=STATE_DTYPES[args.state_dtype],
                         state_memory_share=args.state_memory_share or DEVICE_SHARE,
                         host_state_share=HOST_SHARE if args.host_state_share is None else args.host_state_share)


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
