"""Builds an EngineCore from ServerArgs: checks what can fail cheaply, then loads weights.

Everything that can be checked in a second (the device, the model path, the n-gram trie's
compiler) is checked before the weights load, so a mistake is reported at once instead of
after tens of seconds; each slow stage logs a line with its time.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from specserve.args import ServerArgs
from specserve.engine import warmup
from specserve.engine.core import EngineCore
from specserve.engine.scheduler import Scheduler
from specserve.errors import DeviceError
from specserve.model.config import ModelConfig
from specserve.model.loader import (check_load_format, check_tokenizer_path, default_model_path, load_checkpoint,
                                    load_random_checkpoint, load_tokenizer, read_model_config, resolve_model_path)
from specserve.model.parallel.sharding import check_tensor_parallel
from specserve.runner.model_runner import ModelRunner, resolve_device, resolve_dtype
from specserve.sampling.sampler import Sampler
from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.speculative.drafter import Drafter
from specserve.speculative.hybrid.drafter import HybridDrafter
from specserve.speculative.model_drafters.draft_setup import check_draft_path, prepare_draft
from specserve.speculative.model_drafters.head_prefix_cache import cache_head_rows
from specserve.speculative.registry import create_drafter, needs_draft_model

logger = logging.getLogger("specserve")


@dataclass
class Preflight:
    """What the cheap checks resolved, for the expensive part to use."""
    model_path: str
    device: torch.device
    dtype: torch.dtype
    drafter: Drafter | None
    tp_config: ModelConfig | None   # with tp_size > 1: the model's config, checked to split tp_size ways


def preflight(args: ServerArgs) -> Preflight:
    """The checks that take a second: device, model path, drafter (e.g. the trie's C build)."""
    device = check_device(args.device)
    model_path = args.model_path
    if model_path is None:
        model_path = default_model_path()
        logger.info("no --model-path given: using the default model SmolLM2-135M-Instruct (%s)", model_path)
    else:
        model_path = resolve_model_path(model_path)
    check_load_format(args.load_format, model_path, args.model_path)
    if args.tokenizer_path is not None:
        check_tokenizer_path(args.tokenizer_path)
    tp_config = check_tensor_parallel_fits(args, model_path, device) if args.tp_size > 1 else None
    if needs_draft_model(args):
        check_draft_path(args)   # a wrong path fails before the target loads
        drafter = None           # made in build_core, once its model is loaded
    else:
        drafter = create_drafter(args, on_gpu=device.type == "cuda")
    return Preflight(model_path, device, resolve_dtype(args.dtype, device), drafter, tp_config)


def check_tensor_parallel_fits(args: ServerArgs, model_path: str, device: torch.device) -> ModelConfig:
    """Before any process starts: the heads split tp_size ways, and there are tp_size GPUs."""
    config = read_model_config(model_path)
    check_tensor_parallel(config, args.tp_size)
    first = device.index or 0
    if device.type == "cuda" and first + args.tp_size > torch.cuda.device_count():
        raise DeviceError(f"tp_size={args.tp_size} needs cuda:{first}..cuda:{first + args.tp_size - 1}, "
                          f"but {torch.cuda.device_count()} CUDA device(s) are visible")
    return config


def check_device(name: str) -> torch.device:
    """The device `name` asks for, or a DeviceError saying why it is not usable here."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU-only build (README, 'Set-up': make setup GPU=1)"
               if torch.version.cuda is None else "no NVIDIA GPU is visible to torch")
        raise DeviceError(f"device={name!r} but CUDA is not available: {why}")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise DeviceError(f"device={name!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return resolve_device(name)


def build_core(args: ServerArgs):
    """Returns (core, tokenizer, model_path)."""
    checked = preflight(args)
    warmup.prepare_kernel_cache(checked.device)  # Triton's cache persists across starts; before anything compiles
    tp = start_ranks(args, checked) if checked.tp_config is not None else None
    try:
        return _build_core(args, checked, tp)
    except BaseException:
        if tp is not None:
            tp.shutdown()
        raise


def start_ranks(args: ServerArgs, checked: Preflight):
    """Rank 0's tensor-parallel group; the worker ranks start loading their shards now."""
    from specserve.runner.ranks.launcher import start_tensor_parallel   # imported only for tp_size > 1
    context_length = args.context_length or checked.tp_config.max_position_embeddings
    logger.info("starting %d tensor-parallel ranks ...", args.tp_size)
    return start_tensor_parallel(args, checked.model_path, checked.device, checked.dtype, context_length)


def _build_core(args: ServerArgs, checked: Preflight, tp):
    model_path, device, dtype = checked.model_path, checked.device, checked.dtype
    start = time.perf_counter()
    logger.info("loading %s on %s in %s ...", model_path, device, str(dtype).removeprefix("torch."))
    if args.load_format == "dummy":
        checkpoint = load_random_checkpoint(model_path, dtype, device, seed=args.random_seed,
                                            tp_rank=0, tp_size=1 if tp is None else tp.size)
    elif tp is None:
        checkpoint = load_checkpoint(model_path, dtype=dtype, device=device)
    else:
        checkpoint = load_checkpoint(model_path, dtype=dtype, device=device, tp_rank=0, tp_size=tp.size)
    config = checkpoint.config
    tokenizer = checkpoint.tokenizer if args.tokenizer_path is None else load_tokenizer(args.tokenizer_path)
    context_length = args.context_length or config.max_position_embeddings
    logger.info("loaded %s (%d layers, %.0fM parameters) in %.1f s", config.architecture, config.num_layers,
                checkpoint.num_parameters() / 1e6, time.perf_counter() - start)
    draft = prepare_draft(args, config, device, dtype, context_length) if needs_draft_model(args) else None
    start = time.perf_counter()
    logger.info("preparing the runner (kernels, KV cache%s) ...",
                ", CUDA graphs" if device.type == "cuda" and not args.disable_cuda_graph else "")
    runner = ModelRunner(args, config, checkpoint.state_dict, device, dtype, context_length,
                         draft_kv_bytes_per_token=draft.kv_bytes_per_token if draft else 0,
                         hidden_capture=draft.hidden_capture if draft else None, tp=tp)
    del checkpoint.state_dict
    logger.info("runner ready in %.1f s", time.perf_counter() - start)
    scheduler = Scheduler(runner.pool, runner.max_running_requests, runner.chunk_size,
                          enable_mixed_chunk=args.enable_mixed_chunk,
                          prefix_cache=not args.disable_radix_cache, schedule_policy=args.schedule_policy)
    drafter = checked.drafter if draft is None else draft.make_drafter(runner)
    if drafter is not None:
        scheduler.decode_room = args.speculative_verify_size
    if draft is not None and not draft.reads_target_states:   # a draft model: its cache shares no prefix
        scheduler.draft_capacity = drafter.kv.pool.size
    if draft is not None and draft.reads_target_states:
        # a cached prefix has no target states: the tree keeps the head's rows beside the target's KV
        cache_head_rows(scheduler.kv, drafter.head if isinstance(drafter, HybridDrafter) else drafter)
    adaptive = None
    if drafter is not None and not args.speculative_disable_adaptive:
        graph_sizes = runner.graphs.sizes if runner.graphs is not None else None
        adaptive = AdaptiveDraftLength.for_drafter(drafter, args.speculative_verify_size, graph_sizes,
                                                   on_cpu=runner.device.type == "cpu")
    sampler = Sampler(config.vocab_size, device)
    # a plain step's sampling replayed from CUDA graphs (tests/gpu/test_decode_launch_cuda.py); SPECSERVE_SAMPLING_GRAPHS=0
    # samples eagerly instead, the way to tell whether a sampled run's difference comes from them
    if runner.graphs is not None and os.environ.get("SPECSERVE_SAMPLING_GRAPHS", "1") != "0":
        sampler.graph_plain_steps(runner.graphs.decode_logits())
    core = EngineCore(runner, scheduler, sampler, drafter,
                      args.speculative_verify_size, args.log_interval_s, adaptive,
                      overlap=runner.graphs is not None and not args.disable_overlap_schedule)
    warmup.warm_up(core, tokenizer, args)  # first-use compiles happen now, not in a request
    return core, tokenizer, model_path
