"""Where the host time of one EAGLE training step goes, measured on a CPU with a tiny
target and head (arithmetic negligible) and a realistic batch structure (many
conversations a batch, 100-2000 tokens each, some of them multi-turn fixed text):
`python -m lab.eagle_train_host` (`--help` for the sizes).

Per optimizer step it reports:
- the process CPU time of a step, and cProfile's split of it into Python code (self time of
  Python functions, which holds the ops written as operators, `a * b` or `x[rows]`, and so
  some arithmetic on a CPU) and torch's C functions (ops: on a GPU, their dispatch and launch);
- the host part of building a batch (from the stored states, with its draft targets), timed
  with the teacher cut to 4 draft tokens so that little device arithmetic is left in it;
- the ops a step issues, from a TorchDispatchMode below autograd (the forward, backward and
  optimizer as the dispatcher runs them, views left out): "device ops" read or write a
  tensor that lives on the training device on a GPU (the weights, the target's states and
  whatever the host sent there, followed op by op), each a kernel launch of ~5-10 us of
  host time there; "host ops" run on host tensors (index building);
- host syncs: device ops that make the host wait for a GPU (.item(), nonzero, boolean
  indexing, masked_select, unique, repeat_interleave without an output size), by call site,
  plus the step's one designed read of its loss (`tolist`, which no op shows).

The optimizer runs torch's foreach AdamW, as it does on a GPU (on a CPU torch would default
to a loop over parameters). clip_grad_norm_ still loops over parameters on a CPU (+2 ops a
parameter against a GPU's foreach). It prints one JSON line (--json) or a short table.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from specserve.training import eagle_batches, target_features
from specserve.training.eagle_batches import BatchBuilder
from specserve.training.eagle_data import Conversation
from specserve.training.eagle_trainer import EagleTrainer, TrainSettings, build_head, target_lm_head
from specserve.training.target_features import TargetFeatureExtractor

aten = torch.ops.aten
TINY_TARGET = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                   rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False)
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
           aten.is_nonzero.default, aten.equal.default, aten._unique2.default, aten.unique_consecutive.default,
           aten.repeat_interleave.Tensor}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=160)
    p.add_argument("--length", type=int, nargs=2, default=(100, 2000), metavar=("MIN", "MAX"))
    p.add_argument("--fixed-text-share", type=float, default=0.25, help="conversations with several replies")
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="measured optimizer steps (after one untimed)")
    p.add_argument("--no-autocast", action="store_true", help="fp32 (a GPU run trains under bf16 autocast)")
    p.add_argument("--build-only", action="store_true", help="only the batch building's times")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def synthetic_conversations(count: int, length: tuple[int, int], fixed_text_share: float, vocab_size: int,
                            seed: int = 0) -> list[Conversation]:
    """Random tokens; a share of them chats of several replies (fixed text), the rest one answer."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=generator))  # noqa: E731
    conversations = []
    for index in range(count):
        total = draw(*length)
        tokens = torch.randint(3, vocab_size, (total,), generator=generator).tolist()
        prompt_len = draw(total // 8, total // 2)
        if index < fixed_text_share * count:
            # replies and user turns alternate between the cuts, the first reply at prompt_len
            bounds = [prompt_len, *sorted({draw(prompt_len + 1, total - 1) for _ in range(6)}), total]
            spans = [[bounds[i], bounds[i + 1]] for i in range(0, len(bounds) - 1, 2) if bounds[i + 1] > bounds[i] + 1]
            conversations.append(Conversation(tokens, prompt_len, spans))
        else:
            conversations.append(Conversation(tokens, prompt_len))
    return conversations


def tiny_trainer(conversations: list[Conversation], batch_tokens: int, ttt_steps: int, epochs: int = 1,
                 autocast: bool = True, target_config: dict | None = None) -> EagleTrainer:
    """An EAGLE-3 trainer over a random tiny target (fp32, CPU), its head seeded, foreach AdamW."""
    from specserve.bench.random_model import write_random_model
    from specserve.model.loader import load_checkpoint
    from specserve.runner.model_runner import build_model
    config = target_config or TINY_TARGET
    directory = os.path.join(tempfile.gettempdir(), f"eagle-train-host-{config['hidden_size']}-{config['vocab_size']}")
    write_random_model(directory, config, dtype=torch.float32, device="cpu")
    device = torch.device("cpu")
    lengths = [len(c.tokens) for c in conversations]
    checkpoint = load_checkpoint(directory, dtype=torch.float32)
    target = build_model(checkpoint.config, checkpoint.state_dict, device, torch.float32, max(lengths) + 16)
    torch.manual_seed(0)
    head = build_head(target, "EAGLE3", torch.arange(config["vocab_size"] // 2), max(lengths) + ttt_steps + 1)
    extractor = TargetFeatureExtractor(target, head.config.aux_layers, max(batch_tokens, max(lengths)),
                                       max_sequences=max(1, batch_tokens // min(lengths)), max_sequence_len=max(lengths))
    builder = BatchBuilder(extractor, target_lm_head(target)[head.draft_vocab()], True)
    settings = TrainSettings(ttt_steps=ttt_steps, epochs=epochs, batch_tokens=batch_tokens, lr=1e-3,
                             autocast_dtype=torch.bfloat16 if autocast else None)
    trainer = EagleTrainer(head, builder, conversations, settings)
    for group in trainer.optimizer.param_groups:
        group["foreach"] = True     # what AdamW picks for parameters on a GPU
    return trainer


class OpCounter(TorchDispatchMode):
    """Counts the non-view ops dispatched, as device ops (a tensor in `device_tensors` among
    their inputs: their outputs join it) or host ops, and the syncing device ops by call site."""

    def __init__(self, device_tensors: WeakTensorKeyDictionary):
        super().__init__()
        self.device_tensors = device_tensors
        self.device_ops, self.host_ops = collections.Counter(), collections.Counter()
        self.syncs: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        on_device = any(x in self.device_tensors for x in inputs)
        if on_device:
            for x in tree_flatten(out)[0]:
                if isinstance(x, torch.Tensor):
                    self.device_tensors[x] = True
        if not func.is_view:
            (self.device_ops if on_device else self.host_ops)[func.__name__] += 1
            syncs = func in SYNCING or (func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)
                                        and any(i is not None and i.dtype == torch.bool for i in args[1]))
            if on_device and syncs and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
                self.syncs[f"{func.__name__} at {_call_site()}"] += 1
        return out


def _call_site() -> str:
    """The innermost specserve frame of the current Python stack."""
    for frame in reversed(traceback.extract_stack()):
        if "specserve" in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


def count_ops(trainer: EagleTrainer, steps: int) -> dict:
    """Ops and syncs per step over `steps` more steps (the target's states, the weights and what
    the batches send to the device count as device tensors)."""
    device_tensors = _device_tensors(trainer)
    counter = OpCounter(device_tensors)
    with counter, _sending_with(_tagging_copy(device_tensors)):
        _train_steps(trainer, steps)
    per_step = lambda counter: round(sum(counter.values()) / steps, 1)  # noqa: E731
    return {"device_ops_per_step": per_step(counter.device_ops), "host_ops_per_step": per_step(counter.host_ops),
            "syncs_per_step": per_step(counter.syncs) + 1,     # + the loss read at the end of the step
            "sync_sites": {site: n / steps for site, n in counter.syncs.most_common()},
            "top_device_ops": {name: n / steps for name, n in counter.device_ops.most_common(12)}}


def _device_tensors(trainer: EagleTrainer) -> WeakTensorKeyDictionary:
    """The tensors a GPU run keeps on the device: the head's, the target's, the stored states."""
    device_tensors = WeakTensorKeyDictionary()
    stored = [] if trainer.store is None else trainer.store.tensors()
    for tensor in [*trainer.head.parameters(), *trainer.head.buffers(), trainer.builder.draft_lm_head,
                   *trainer.builder.extractor.model.parameters(), *stored]:
        if tensor is not None:
            device_tensors[tensor] = True
    return device_tensors


def _tagging_copy(device_tensors: WeakTensorKeyDictionary) -> Callable[[torch.Tensor, torch.device], torch.Tensor]:
    """A host-to-device copy for a CPU: a tensor of its own (on a GPU it would be), tagged as on the device."""
    def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        sent = host.clone()
        device_tensors[sent] = True
        return sent
    return to_device


@contextlib.contextmanager
def _sending_with(to_device: Callable[[torch.Tensor, torch.device], torch.Tensor]):
    """Makes the batches' and the extractor's host-to-device copies go through `to_device`."""
    # (the name an older tree's eagle_batches gave its copy too: to measure it alike)
    patched = [(module, name) for module in (eagle_batches, target_features)
               for name in ("host_to_device_async", "_to_device") if hasattr(module, name)]
    originals = [getattr(module, name) for module, name in patched]
    for module, name in patched:
        setattr(module, name, to_device)
    try:
        yield
    finally:
        for (module, name), original in zip(patched, originals):
            setattr(module, name, original)


def time_batch_building(trainer: EagleTrainer, count: int) -> dict:
    """ms a batch of building the plan's first `count` batches (from the store) with their
    draft targets, the host's part: the teacher cut to 4 draft tokens, so that what is left of
    the device ops' arithmetic (the states' gather) is small beside it; and the host ops a batch."""
    full = trainer.builder
    builder = BatchBuilder(full.extractor, full.draft_lm_head[:4], full.uses_aux_layers)
    trainer.store.fill(full.extractor, [c.tokens for c in trainer.conversations], trainer.plan[:count])

    def build_all() -> float:
        started = time.perf_counter()
        for group in trainer.plan[:count]:
            batch = builder.from_store(trainer.store, group, [trainer.conversations[i] for i in group])
            batch.draft_targets(trainer.settings.ttt_steps)
        return time.perf_counter() - started
    build_all()     # warm-up
    total = min(build_all() for _ in range(5))     # wall times: the least disturbed of five
    counter = OpCounter(_device_tensors(trainer))
    with counter, _sending_with(_tagging_copy(counter.device_tensors)):
        build_all()
    return {"build_host_ms_per_batch": round(1e3 * total / count, 2),
            "build_host_ops_per_batch": round(sum(counter.host_ops.values()) / count, 1),
            "build_device_ops_per_batch": round(sum(counter.device_ops.values()) / count, 1)}


def profile_python(trainer: EagleTrainer, steps: int) -> dict:
    """cProfile over `steps` more steps: ms a step in Python code, in torch's C functions, in total;
    the cumulative ms a step of the trainer's phases."""
    profiler = cProfile.Profile()
    profiler.enable()
    _train_steps(trainer, steps)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    python = sum(tt for (file, _, _), (_, _, tt, _, _) in stats.items() if file != "~")
    builtins = sum(tt for (file, _, _), (_, _, tt, _, _) in stats.items() if file == "~")
    phases = collections.defaultdict(float)
    wanted = {"_build", "_plan", "unroll", "ttt_loss", "backward", "step", "clip_grad_norm_", "_train_batch"}
    for (file, _, name), (_, _, _, cumulative, _) in stats.items():
        if name in wanted and ("specserve" in file or "torch" in file):
            phases[name] = max(phases[name], cumulative)
    ms = lambda seconds: round(1e3 * seconds / steps, 2)  # noqa: E731
    return {"python_ms_per_step": ms(python), "builtin_ms_per_step": ms(builtins),
            "phase_ms_per_step": {name: ms(seconds) for name, seconds in sorted(phases.items())}}


def time_steps(trainer: EagleTrainer, steps: int) -> dict:
    started_wall, started_cpu = time.perf_counter(), time.process_time()
    _train_steps(trainer, steps)
    return {"step_ms_wall": round(1e3 * (time.perf_counter() - started_wall) / steps, 2),
            "step_ms_process_cpu": round(1e3 * (time.process_time() - started_cpu) / steps, 2)}


def _train_steps(trainer: EagleTrainer, count: int) -> None:
    """`count` more optimizer steps, over the plan again from its start when it runs out."""
    for _ in range(count):
        trainer._train_batch(trainer.plan[trainer.step % len(trainer.plan)])
        trainer.step += 1


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    torch.set_num_threads(1)     # host work is one thread's; keeps the numbers steady on a shared CPU
    conversations = synthetic_conversations(ns.conversations, tuple(ns.length), ns.fixed_text_share,
                                            TINY_TARGET["vocab_size"])
    trainer = tiny_trainer(conversations, ns.batch_tokens, ns.ttt_steps, epochs=4, autocast=not ns.no_autocast)
    plan = trainer.plan
    _train_steps(trainer, 1)     # warm-up
    result = {"batches": len(plan), "conversations_per_batch": round(len(conversations) / (len(plan) / 4), 1),
              "batch_tokens": ns.batch_tokens, "ttt_steps": ns.ttt_steps, "autocast": not ns.no_autocast,
              **time_batch_building(trainer, 8)}
    if not ns.build_only:
        result.update(**time_steps(trainer, ns.steps), **profile_python(trainer, ns.steps),
                      **count_ops(trainer, ns.steps))
    if ns.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key}: {json.dumps(value) if isinstance(value, dict) else value}")


if __name__ == "__main__":
    sys.exit(main())
