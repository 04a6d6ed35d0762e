"""DraftModelRunner: a draft model (STANDALONE) with its own KV pool and attention backend,
and its two forwards: the catch-up of tokens it has not seen (eager EXTEND) and the draft
chain (draft_chain.py), replayed from one CUDA graph per batch bucket on a GPU.

The draft pool has as many token slots as the target's (the builder sizes the target's
cache for both: `kv_bytes_per_token` joins the target's per-token cost) and the same
req_to_token rows; it is a few positions wider, because a chain drafts past the last
position the target may reach (drafts there are cut, never verified).
"""
from __future__ import annotations

import logging
import time

import torch

from specserve.args import ServerArgs
from specserve.attention.registry import backend_name, create_attention_backend
from specserve.errors import ArgumentError
from specserve.kv.pool import KVPool
from specserve.model.config import ModelConfig
from specserve.model.llama import DecoderLM
from specserve.model.loader import load_checkpoint, resolve_model_path
from specserve.runner.cuda_graph import batch_size_buckets
from specserve.runner.model_runner import build_model
from specserve.speculative.model_drafters.catch_up_batch import catch_up_batch
from specserve.speculative.model_drafters.chain_graphs import ChainGraphs
from specserve.speculative.model_drafters.draft_chain import ChainInputs, ChainRow, DecoderChainModel, run_chain

logger = logging.getLogger("specserve")
FED_ROWS = 2   # a chain feeds the last two tokens (see draft_chain.py)


def load_draft_model(args: ServerArgs, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                     context_length: int) -> DecoderLM:
    """The draft model of `args.speculative_draft_model_path`, loaded like the target (HF
    directory or GGUF), with room for positions a chain drafts past the context."""
    path = resolve_model_path(args.speculative_draft_model_path)
    start = time.perf_counter()
    checkpoint = load_checkpoint(path, dtype=dtype, device=device)
    config = checkpoint.config
    if config.vocab_size != target.vocab_size:
        raise ArgumentError(f"speculative_draft_model_path: the draft model's vocabulary has {config.vocab_size} "
                            f"tokens, the target's {target.vocab_size}; a draft model must share the target's tokenizer")
    model = build_model(config, checkpoint.state_dict, device, dtype, chain_context(context_length, args.speculative_steps))
    del checkpoint
    if device.type == "cuda":
        torch.cuda.empty_cache()   # the loaded copy's blocks: the target's KV budget reads free memory next
    logger.info("loaded draft model %s (%d layers, %.0fM parameters) in %.1f s", path, config.num_layers,
                sum(p.numel() for p in model.parameters()) / 1e6, time.perf_counter() - start)
    return model


def chain_context(context_length: int, num_steps: int) -> int:
    """Positions a draft cache spans: a chain rooted at the last position drafts num_steps past it."""
    return context_length + num_steps + 1


def drafter_backend(args: ServerArgs, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int):
    """The attention backend the target uses (--attention-backend), for a drafter's own layers."""
    return create_attention_backend(backend_name(args.attention_backend, device.type), num_heads, num_kv_heads,
                                    head_dim)


def kv_bytes_per_token(model: DecoderLM, dtype: torch.dtype) -> int:
    config = model.config
    return KVPool.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, dtype)


class DraftModelRunner:
    def __init__(self, args: ServerArgs, model: DecoderLM, target_pool: KVPool):
        config = model.config
        self.model, self.config = model, config
        self.device, self.dtype = target_pool.device, target_pool.dtype
        self.num_steps = args.speculative_steps
        self.vocab_size = config.vocab_size
        self.pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, target_pool.size,
                           target_pool.max_requests, chain_context(target_pool.max_context, self.num_steps),
                           self.dtype, self.device)
        self.backend = drafter_backend(args, self.device, config.num_heads, config.num_kv_heads, config.head_dim)
        self.chain_model = DecoderChainModel(model, self.backend)
        self.graphs = None
        if self.device.type == "cuda" and not args.disable_cuda_graph and self.backend.supports_cuda_graph:
            max_bs = min(args.cuda_graph_max_bs or 64, target_pool.max_requests)
            self.backend.init_cuda_graph_state(batch_size_buckets(max_bs)[-1], FED_ROWS, self.pool)
            self.graphs = ChainGraphs(self._run_for_graph, max_bs, FED_ROWS, self.num_steps - 1,
                                      self.pool.scratch_row, self.device, (self.num_steps + 1, self.vocab_size))

    @torch.inference_mode()
    def catch_up(self, rows: list[int], starts: list[int], tokens: list[list[int]], slots: list[int]) -> None:
        """Feeds each request's tokens[i] at positions starts[i].. (their slots, request after
        request, in `slots`; table entries already written): one EXTEND forward."""
        batch = catch_up_batch(rows, starts, tokens, slots, self.pool, self.device)
        self.backend.plan(batch)
        self.model(batch, self.backend)

    @torch.inference_mode()
    def chain(self, rows: list[ChainRow], sample: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts (bs, K) int64 on the device and, for a sampling chain, q (bs, K+1, V): see
        draft_chain.py. Queued without a host sync."""
        if self.graphs is not None and len(rows) <= self.graphs.max_bs:
            return self.graphs.replay(rows, sample)
        bs = len(rows)
        host = ChainInputs.allocate(bs, FED_ROWS, self.num_steps - 1, "cpu", pin=self.device.type == "cuda")
        host.fill(rows, self.pool.scratch_row)
        inputs = ChainInputs.view(host.packed.to(self.device, non_blocking=True), bs, FED_ROWS, self.num_steps - 1)
        probs = torch.zeros((bs, self.num_steps + 1, self.vocab_size), device=self.device) if sample else None
        drafts = run_chain(self.chain_model, self.pool, inputs, self.backend.plan, probs, host_rows=rows)
        return drafts, probs

    def _run_for_graph(self, inputs: ChainInputs, probs: torch.Tensor | None) -> torch.Tensor:
        return run_chain(self.chain_model, self.pool, inputs, self.backend.plan_for_capture, probs)
