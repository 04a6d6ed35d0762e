"""Builds an EngineCore from ServerArgs: resolves the model, device and dtype, loads weights."""
from __future__ import annotations

import logging

from specserve.args import ServerArgs
from specserve.engine.core import EngineCore
from specserve.engine.scheduler import Scheduler
from specserve.model.loader import default_model_path, load_checkpoint
from specserve.runner.model_runner import ModelRunner, resolve_device, resolve_dtype
from specserve.sampling.sampler import Sampler
from specserve.speculative.adaptive import AdaptiveDraftLength, tiers_for
from specserve.speculative.drafter import create_drafter

logger = logging.getLogger("specserve")


def build_core(args: ServerArgs):
    """Returns (core, tokenizer, model_path)."""
    model_path = args.model_path
    if model_path is None:
        model_path = default_model_path()
        print(f"specserve: no --model-path given, using the default model SmolLM2-135M-Instruct ({model_path})", flush=True)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    checkpoint = load_checkpoint(model_path, dtype=dtype, device=device)
    config = checkpoint.config
    context_length = args.context_length or config.max_position_embeddings
    logger.info("loaded %s (%s) on %s in %s", model_path, config.architecture, device, dtype)
    runner = ModelRunner(args, config, checkpoint.state_dict, device, dtype, context_length)
    del checkpoint.state_dict
    scheduler = Scheduler(runner.pool, runner.max_running_requests,
                          args.chunked_prefill_size if args.chunked_prefill_size > 0 else context_length)
    drafter = create_drafter(args)
    adaptive = None
    if drafter is not None and args.speculative_adaptive:
        graph_sizes = runner.graphs.sizes if runner.graphs is not None else None
        adaptive = AdaptiveDraftLength(tiers_for(args.speculative_num_draft_tokens, graph_sizes))
    core = EngineCore(runner, scheduler, Sampler(config.vocab_size, device), drafter,
                      args.speculative_num_draft_tokens, args.log_interval_s, adaptive,
                      overlap=runner.graphs is not None and not args.disable_overlap_schedule)
    return core, checkpoint.tokenizer, model_path
