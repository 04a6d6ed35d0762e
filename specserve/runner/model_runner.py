"""ModelRunner: owns the model, the KV pool and the attention backend, and turns a
scheduled step (prompt chunks, or one draft tree per request) into a forward pass."""
from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from specserve.args import ServerArgs
from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.attention.registry import create_target_backend
from specserve.kv.pool import KVPool
from specserve.model.config import ModelConfig
from specserve.model.cpu_linear import use_cpu_linears
from specserve.model.hidden_capture import HiddenCapture
from specserve.model.layers import RotaryEmbedding
from specserve.model.llama import DecoderLM
from specserve.model.parallel.parallel_state import TensorParallelGroup
from specserve.request.req import Req
from specserve.runner.cpu_kv_budget import available_memory_bytes, cpu_default_kv_tokens
from specserve.runner.ranks.step_broadcast import BroadcastingModel
from specserve.runner.forecast_step import select_on_device
from specserve.runner.stream_events import record
from specserve.runner.tree_step import TreeStepInputs, TreeStepOutputs, forward_tree, pad_node_slots, set_roots
from specserve.verify.tree import TreeProposal

logger = logging.getLogger(__name__)
DEFAULT_MEM_FRACTION = 0.85   # of the device's memory, for weights and the KV pool (--mem-fraction-static)
# Activations, logits and CUDA graphs' pools live in the memory the fraction leaves out, as in
# SGLang (the same --mem-fraction-static gives the same KV capacity); where that is less than
# this, the difference comes out of the pool.
ACTIVATION_HEADROOM = 2 * 1024 ** 3

DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPE_NAMES[name]


# --chunked-prefill-size's default: 8192 on a GPU of 60 GiB or more, as SGLang sets it on an
# H100 or H200 (a 32k-token prompt of a Qwen2.5-7B shape: 1494 ms against 1719 in chunks of 2048,
# H200, docs/bench/h200_2026-12-05); 2048 elsewhere
LARGE_GPU_CHUNK, LARGE_GPU_BYTES, DEFAULT_CHUNK = 8192, 60 * 2 ** 30, 2048


def prefill_chunk_size(requested: int | None, device: torch.device, context_length: int) -> int:
    """Prompt tokens one prefill step carries at most: --chunked-prefill-size resolved (-1: no chunks)."""
    if requested == -1:
        return context_length
    if requested is not None:
        return requested
    large = device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES
    return LARGE_GPU_CHUNK if large else DEFAULT_CHUNK


class ModelRunner:
    def __init__(self, args: ServerArgs, config: ModelConfig, state_dict: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, context_length: int, draft_kv_bytes_per_token: int = 0,
                 hidden_capture: HiddenCapture | None = None, tp: TensorParallelGroup | None = None):
        """state_dict: the weights (Hugging Face names), emptied once they are in the model.
        draft_kv_bytes_per_token: a draft model's KV cost per token; its cache holds as many
        tokens as the target's, from the same memory budget. hidden_capture: the hidden states
        every forward also keeps (an EAGLE drafter reads them), a template. tp: the
        tensor-parallel group whose rank this runner is (state_dict: the rank's shard); every
        rank builds the same runner, rank 0's model also sends each forward's inputs."""
        self.args, self.config, self.device, self.dtype = args, config, device, dtype
        self.hidden_capture = hidden_capture
        self.draft_kv_bytes_per_token = draft_kv_bytes_per_token
        self.context_length = context_length
        self.chunk_size = prefill_chunk_size(args.chunked_prefill_size, device, context_length)
        self.tp = tp
        self.model = build_model(config, state_dict, device, dtype, context_length, tp)
        release_weights(state_dict, device)   # before the KV pool is sized from the memory left
        shard = self.model.shard   # this rank's heads (all of them without tensor parallelism)
        self.max_running_requests = args.max_running_requests or (256 if device.type == "cuda" else 64)
        self.pool = KVPool(config.num_layers, shard.num_kv_heads, config.head_dim, self._kv_tokens(shard.num_kv_heads),
                           self.max_running_requests + 1, context_length, dtype, device)
        self.attn_backend = create_target_backend(args.attention_backend, args.prefill_attention_backend,
                                                  args.decode_attention_backend, device.type, shard.num_heads,
                                                  shard.num_kv_heads, config.head_dim, dtype)
        logger.info("KV cache: %d tokens (max_total_num_tokens; %.2f GiB, %s), attention backend %s",
                    self.pool.size, self._kv_bytes() / 1024 ** 3, self._kv_sized_by(), self.attn_backend.name)
        self.graphs = self._capture_graphs()
        self.prefill_graphs = self._capture_prefill_graphs()
        if tp is not None and tp.is_driver:
            self.model = BroadcastingModel(self.model, tp)

    def _capture_graphs(self):
        args = self.args
        if self.device.type != "cuda" or args.disable_cuda_graph or not self.attn_backend.supports_cuda_graph:
            return None
        from specserve.runner.cuda_graph import CudaGraphRunner
        max_bs = min(args.cuda_graph_max_bs or 64, self.max_running_requests)
        n = args.speculative_verify_size if args.speculative else 1
        # verify graphs are ragged: a step replays the smallest level that holds its real nodes
        sizes = sorted({1, n} | {size for size in (2, 4, 8) if size < n})
        return CudaGraphRunner(self.model, self.attn_backend, self.pool, max_bs, sizes, self.hidden_capture, self.tp)

    def _capture_prefill_graphs(self):
        args = self.args
        max_tokens = min(args.prefill_cuda_graph_max_tokens, self.chunk_size)
        if self.graphs is None or self.tp is not None or max_tokens == 0 or not self.attn_backend.supports_prefill_graph:
            return None
        from specserve.runner.prefill_graph import MAX_REQUESTS, PrefillGraphRunner
        return PrefillGraphRunner(self.model, self.attn_backend, self.pool, max_tokens,
                                  min(MAX_REQUESTS, self.max_running_requests), self.hidden_capture)

    def _kv_bytes(self) -> int:
        """Device memory the KV pool holds (a draft model's cache, sized alike, apart)."""
        return self.pool.size * KVPool.bytes_per_token(self.config.num_layers, self.model.shard.num_kv_heads,
                                                       self.config.head_dim, self.dtype)

    def _kv_sized_by(self) -> str:
        if self.args.max_total_tokens is not None:
            return "max_total_tokens"
        if self.device.type != "cuda":
            return "the CPU default"
        return f"mem_fraction_static={self.args.mem_fraction_static or DEFAULT_MEM_FRACTION}"

    def _kv_tokens(self, num_kv_heads: int) -> int:
        """The KV pool's size: every tensor-parallel rank holds the same slots, so the ranks
        agree on the smallest size any of them has memory for."""
        tokens = self._kv_tokens_here(num_kv_heads)
        return tokens if self.tp is None else self.tp.min_over_ranks(tokens)

    def _kv_tokens_here(self, num_kv_heads: int) -> int:
        if self.args.max_total_tokens is not None:
            return self.args.max_total_tokens
        per_token = KVPool.bytes_per_token(self.config.num_layers, num_kv_heads, self.config.head_dim,
                                           self.dtype) + self.draft_kv_bytes_per_token
        if self.device.type != "cuda":
            return cpu_default_kv_tokens(self.context_length, per_token, available_memory_bytes())
        fraction = self.args.mem_fraction_static or DEFAULT_MEM_FRACTION
        free, total = torch.cuda.mem_get_info(self.device)
        # memory this process's allocator keeps cached (an engine closed before this one) is ours to reuse
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * fraction - torch.cuda.memory_allocated(self.device) - used_by_others
        budget -= max(0.0, ACTIVATION_HEADROOM - total * (1 - fraction))
        tokens = int(budget // per_token)
        if tokens < 1024:
            raise ValueError(f"mem_fraction_static={fraction} leaves room for only {tokens} KV tokens")
        return tokens

    # --- forwards ---
    @torch.inference_mode()
    def extend(self, reqs: list[Req], extend_lens: list[int], slots: list[int], samples: list[bool],
               capture: HiddenCapture | None = None) -> torch.Tensor:
        """Runs prompt chunks; returns (num_sampling_reqs, 1, vocab) logits of the chunks that end a prompt.
        capture: filled with the hidden states of every token of the chunks."""
        input_ids, positions = [], []
        for req, length in zip(reqs, extend_lens):
            input_ids.extend(req.all_ids[req.kv_len:req.kv_len + length])
            positions.extend(range(req.kv_len, req.kv_len + length))
        graphs = self.prefill_graphs
        if (graphs is not None and (capture is None or graphs.capture is not None)
                and graphs.can_run(len(input_ids), len(reqs))):
            return graphs.run(input_ids, positions, slots, [r.row for r in reqs], [r.kv_len for r in reqs],
                              extend_lens, samples, capture).unsqueeze(1)
        ends = torch.tensor(extend_lens).cumsum(0) - 1
        logits_rows = ends[torch.tensor(samples, dtype=torch.bool)]
        batch = self._forward_batch(ForwardMode.EXTEND, reqs, input_ids, positions, slots, extend_lens, logits_rows)
        batch.hidden_capture = capture
        return self.model(batch, self.attn_backend).unsqueeze(1)

    @torch.inference_mode()
    def run_trees(self, reqs: list[Req], proposal: TreeProposal, slots: list[int], kv_lens: list[int] | None = None,
                  roots: torch.Tensor | None = None) -> TreeStepOutputs:
        """Queues a decode (one node per request) or verify step over each request's draft
        tree, with no host sync: a graph replay when one fits, else the same computation
        eagerly. slots: the real nodes' KV slots, request after request. kv_lens: tokens in
        each request's cache (default: its kv_len; one more for a step launched ahead).
        roots: (bs,) root tokens on the device, replacing the proposal's (see replay).
        A replay returns cuda_graph.CutStepOutputs: the same fields, views made when read."""
        bs, n = proposal.tokens.shape
        kv_lens = kv_lens if kv_lens is not None else [r.kv_len for r in reqs]
        derive = None if roots is None else functools.partial(set_roots, roots)
        return self._tree_step(reqs, proposal, pad_node_slots(slots, proposal.num_nodes, n), kv_lens, derive)

    @torch.inference_mode()
    def run_forecast_trees(self, reqs: list[Req], kv_lens: list[int], node_slots: np.ndarray,
                           outcome: torch.Tensor, table: np.ndarray) -> TreeStepOutputs:
        """Queues verify step N + 1 of these requests (step N's, in its order) before N's
        outcome is read: its trees picked on the device from the forecast table by N's greedy
        outcome (on the device), runner/forecast_step.py. kv_lens: N's prefix lengths;
        node_slots (bs, n): KV slots for every node a picked tree may have. An eager step
        (the CPU, a batch past the graphs) reads the picked trees' sizes for its planning."""
        bs, n = node_slots.shape
        device_table, slots = self._send(table), self._send(node_slots)
        derive = lambda inputs: select_on_device(inputs, outcome, device_table, slots)
        every_node = TreeProposal(np.zeros((bs, n), dtype=np.int64), np.full((bs, n), -1, dtype=np.int64),
                                  np.full(bs, n, dtype=np.int64))   # the most a picked tree holds
        return self._tree_step(reqs, every_node, node_slots, kv_lens, derive, sizes_derived=True)

    def _tree_step(self, reqs: list[Req], proposal: TreeProposal, node_slots: np.ndarray, kv_lens: list[int],
                   derive: Callable[[TreeStepInputs], None] | None, sizes_derived: bool = False) -> TreeStepOutputs:
        """The step's inputs filled on the host from `proposal`, then rewritten on the device by
        `derive` (if any); sizes_derived: it changes the trees' node counts and the prefix
        lengths too (what eager planning then reads back: a host sync)."""
        bs, n = proposal.tokens.shape
        rows = [r.row for r in reqs]
        if self.graphs is not None and self.graphs.can_run(bs, n):
            return self.graphs.replay(proposal, node_slots, rows, kv_lens, derive, every_node=sizes_derived)
        host = TreeStepInputs.allocate(bs, n, "cpu", pin=self.device.type == "cuda")
        host.fill(proposal, node_slots, rows, kv_lens, self.pool.scratch_row)
        inputs = TreeStepInputs.view(host.packed.to(self.device, non_blocking=True), bs, n)
        if derive is not None:
            derive(inputs)
        if sizes_derived:
            kv_lens, num_nodes = inputs.prefix_lens.tolist(), inputs.num_nodes.tolist()
        else:
            num_nodes = proposal.num_nodes.tolist()
        return forward_tree(self.model, self.attn_backend, self.pool, inputs, self.attn_backend.plan, kv_lens,
                            capture=self.hidden_capture, token_budget=sum(num_nodes), num_nodes_host=num_nodes)

    def _send(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device, without waiting (through pinned memory on a GPU)."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def launch_greedy_decode(self, reqs: list[Req], kv_lens: list[int], slots: list[int],
                             roots: list[int] | torch.Tensor) -> tuple["InFlight", torch.Tensor | None, torch.Tensor]:
        """A plain greedy decode step, queued without waiting for it. roots (bs,): the last
        tokens, on the host, or on the device for a step launched before the previous one's
        tokens reached the host (its argmax). Its InFlight's device tensor is the argmax.
        Also returns the hidden states the runner keeps (bs, features), None without: a copy
        of the graph's output, which the step launched after this one overwrites; and the
        step's logits (bs, vocab), valid until the next decode step of this batch size runs
        (a grammar's mask picks its argmax from them, queued before that)."""
        on_device = isinstance(roots, torch.Tensor) and roots.device.type != "cpu"
        graphs = self.graphs
        if graphs is not None and graphs.can_launch_decode(len(reqs)):   # the lean launch (cuda_graph.py)
            argmax, host, done, hidden, logits = graphs.launch_decode([r.row for r in reqs], kv_lens, slots, roots)
            return InFlight(argmax, host, done), None if hidden is None else hidden.reshape(len(reqs), -1).clone(), logits
        proposal = TreeProposal.root_only([0] * len(reqs) if on_device else roots)
        step = self.run_trees(reqs, proposal, slots, kv_lens, roots if on_device else None)
        hidden = step.hidden.reshape(len(reqs), -1).clone() if step.hidden is not None else None
        return InFlight.launch(step.logits[:, 0].argmax(-1)), hidden, step.logits[:, 0]

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker processes (nothing to do without them)."""
        if self.tp is not None:
            self.tp.shutdown()

    def _forward_batch(self, mode, reqs, input_ids, positions, slots, extend_lens, logits_rows) -> ForwardBatch:
        device = self.device
        prefix_host = [r.kv_len for r in reqs]
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)
        batch = ForwardBatch(
            mode=mode, input_ids=as_long(input_ids), positions=as_long(positions), out_slots=as_long(slots),
            req_rows=as_long([r.row for r in reqs]), prefix_lens=as_long(prefix_host),
            extend_lens=as_long(extend_lens), prefix_lens_host=prefix_host, extend_lens_host=list(extend_lens),
            kv_pool=self.pool, logits_indices=logits_rows.to(device))
        self.attn_backend.plan(batch)
        return batch


@dataclass
class InFlight:
    """A device tensor and its host copy, queued without waiting."""
    device: torch.Tensor                # on the device at once (e.g. the next step's roots)
    host: torch.Tensor                  # pinned copy, valid once `done` has fired
    done: torch.cuda.Event | None       # None on a CPU, where the forward has already run

    @classmethod
    def launch(cls, tensor: torch.Tensor) -> "InFlight":
        if not tensor.is_cuda:
            return cls(tensor, tensor, None)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        done = record(torch.cuda.Event())
        return cls(tensor, host, done)

    def wait(self) -> torch.Tensor:
        """The host copy, once this step is done (not waiting for any step queued after it)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host


def release_weights(state_dict: Mapping[str, torch.Tensor], device: torch.device) -> None:
    """Empties a state dict whose tensors were copied into the model. The KV pool takes the
    device memory left after the weights; tensors the caller still references (the loaded
    checkpoint's dict) would be a second copy of the weights counted against it (a 7B model
    in bf16: 15 GB, some 265k KV tokens fewer). Random weights (a read-only mapping whose
    tensors are made when read) hold nothing."""
    if isinstance(state_dict, MutableMapping):
        state_dict.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()   # what the tensors held goes back to the device, not to this allocator's cache


def build_model(config: ModelConfig, state_dict, device, dtype, context_length: int,
                tp: TensorParallelGroup | None = None) -> DecoderLM:
    # build on the meta device: random initialisation of weights that are overwritten anyway is slow
    with torch.device("meta"):
        model = DecoderLM(config, max_positions=1, tp=tp)
    model = model.to_empty(device=device).to(dtype)
    model.rope = RotaryEmbedding(config.head_dim, context_length, config.rope_theta, config.rope_scaling).to(device)
    model.load_weights(state_dict)
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        use_cpu_linears(model)  # faster few-row matmuls (verify steps) for a second copy of the weights
    return model.eval().requires_grad_(False)
