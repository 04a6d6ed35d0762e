"""What one optimizer step of the EAGLE head trainer costs, on synthetic conversations:
`python -m lab.eagle_train_step --shape qwen2.5-coder-1.5b --device cuda` (random
weights with the 1.5B's shapes: no checkpoint, no data generation) or
`python -m lab.eagle_train_step --device cpu` (SmolLM2-135M).

The conversations have prompt and answer lengths drawn uniformly from the given ranges
(the defaults are near what ShareGPT first turns and the 1.5B's 384-token answers give);
token values do not change what a step costs. It prints one JSON line: the trainer's set-up
time (whatever it does before the first step: computing the target's states), the median
and mean time of the steps after the first (and their process CPU time, steadier than the
wall time on a shared CPU), padded tokens per second, and the losses; --profile prints
torch.profiler's table of two more steps. It uses only the trainer's public surface, so a
copy of it runs against an older tree too (PYTHONPATH=that tree).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specserve.training.eagle_batches import BatchBuilder
from specserve.training.eagle_data import Conversation
from specserve.training.eagle_trainer import EagleTrainer, TrainSettings, build_head, target_lm_head
from specserve.training.target_features import TargetFeatureExtractor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="the target (default SmolLM2-135M); or --shape")
    p.add_argument("--shape", default=None, help="random weights of a real model's shapes (bench/random_model.py)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--algorithm", default="EAGLE3", choices=("EAGLE3", "EAGLE"))
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 350), metavar=("MIN", "MAX"))
    p.add_argument("--answer-len", type=int, nargs=2, default=(40, 384), metavar=("MIN", "MAX"))
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps (after one untimed)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--states", default="auto", choices=("auto", "per-batch"),
                   help="per-batch: compute the target's states in every step (as a run whose data does not "
                        "fit the device does), not once before training")
    p.add_argument("--profile", action="store_true")
    return p.parse_args(argv)


def load_target(ns: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    from specserve.model.loader import default_model_path, load_checkpoint
    from specserve.runner.model_runner import build_model
    path = ns.model_path
    if ns.shape is not None:
        from specserve.bench.random_model import write_random_model
        path = write_random_model(f"/tmp/random-{ns.shape}", ns.shape, device=str(device))
    checkpoint = load_checkpoint(path or default_model_path(), dtype=dtype)
    context = ns.prompt_len[1] + ns.answer_len[1] + ns.ttt_steps + 8
    return build_model(checkpoint.config, checkpoint.state_dict, device, dtype, context)


def synthetic_conversations(ns: argparse.Namespace, vocab_size: int) -> list[Conversation]:
    generator = torch.Generator().manual_seed(0)
    draw = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=generator))  # noqa: E731
    conversations = []
    for _ in range(ns.conversations):
        prompt_len, answer_len = draw(*ns.prompt_len), draw(*ns.answer_len)
        tokens = torch.randint(0, vocab_size, (prompt_len + answer_len,), generator=generator).tolist()
        conversations.append(Conversation(tokens, prompt_len))
    return conversations


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    device = torch.device(ns.device)
    on_gpu = device.type == "cuda"
    target = load_target(ns, device, torch.bfloat16 if on_gpu else torch.float32)
    conversations = synthetic_conversations(ns, target.config.vocab_size)
    lengths = [len(c.tokens) for c in conversations]
    draft_vocab = torch.arange(min(ns.draft_vocab_size, target.config.vocab_size))
    torch.manual_seed(0)   # the head's initial weights
    head = build_head(target, ns.algorithm, draft_vocab, max_positions=max(lengths) + ns.ttt_steps + 1)
    extractor = TargetFeatureExtractor(target, head.config.aux_layers, max(ns.batch_tokens, max(lengths)),
                                       max_sequences=max(1, ns.batch_tokens // min(lengths)),
                                       max_sequence_len=max(lengths))
    builder = BatchBuilder(extractor, target_lm_head(target)[head.draft_vocab()], bool(head.config.aux_layers))
    settings = TrainSettings(ttt_steps=ns.ttt_steps, epochs=100, batch_tokens=ns.batch_tokens, lr=5e-4,
                             autocast_dtype=torch.bfloat16 if on_gpu else None)
    started, started_cpu = time.perf_counter(), time.process_time()
    trainer = EagleTrainer(head, builder, conversations, settings)
    if ns.states == "auto" and hasattr(trainer.store, "fill"):   # a store that keeps batches as they first train
        trainer.store.fill(extractor, [c.tokens for c in conversations], trainer.plan)   # as many as fit, up front
    setup_s, setup_cpu_s = time.perf_counter() - started, time.process_time() - started_cpu
    if ns.states == "per-batch":
        trainer.store = None
    extract_rate = extractor_rate(extractor, conversations, trainer.plan[:8])
    stamps: list[tuple[float, float]] = []
    run_steps(trainer, 1 + ns.steps, stamps)
    times = [b[0] - a[0] for a, b in zip(stamps[1:], stamps[2:])]          # the first step untimed
    cpu_times = [b[1] - a[1] for a, b in zip(stamps[1:], stamps[2:])]
    padded = sum(len(g) * max(lengths[i] for i in g) for g in trainer.plan[1:1 + ns.steps]) / ns.steps
    print(json.dumps({"device": str(device), "target": ns.shape or ns.model_path or "smollm2-135m",
                      "batch_tokens": ns.batch_tokens, "ttt_steps": ns.ttt_steps, "setup_s": round(setup_s, 3),
                      "setup_process_cpu_s": round(setup_cpu_s, 3), "tokens": sum(lengths), "states": ns.states,
                      "extractor_tokens_per_s": round(extract_rate),
                      "step_s_median": round(statistics.median(times), 4), "step_s_mean": round(statistics.mean(times), 4),
                      "step_process_cpu_s_median": round(statistics.median(cpu_times), 4),
                      "padded_tokens_per_s": round(padded / statistics.mean(times)), "losses": [round(x, 5) for x in trainer.history]}))
    if ns.profile:
        profile(trainer)


def extractor_rate(extractor: TargetFeatureExtractor, conversations: list[Conversation],
                   groups: list[list[int]]) -> float:
    """Tokens per second of the target's forward over the batches `groups` (after one untimed pass)."""
    synchronize = torch.cuda.synchronize if extractor.device.type == "cuda" else (lambda: None)
    for timed in (False, True):
        synchronize()
        started = time.perf_counter()
        for group in groups:
            extractor([conversations[i].tokens for i in group])
        synchronize()
    return sum(len(conversations[i].tokens) for g in groups for i in g) / (time.perf_counter() - started)


def run_steps(trainer: EagleTrainer, count: int, stamps: list[tuple[float, float]]) -> None:
    """Trains `count` more steps; stamps gets (wall, process CPU) times before the first and after each
    (the process CPU time is steadier where other work shares the cores)."""
    stop_at = trainer.step + count
    trainer.plan = trainer.plan[:stop_at]
    stamp = lambda *_: stamps.append((time.perf_counter(), time.process_time()))  # noqa: E731
    stamp()
    trainer.train(stamp)


def profile(trainer: EagleTrainer) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    trainer.plan = trainer.plan + trainer.plan[:2]
    with torch_profile(activities=activities) as prof:
        trainer.train()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=30))


if __name__ == "__main__":
    main()
