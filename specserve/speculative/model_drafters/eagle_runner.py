"""EagleHeadRunner: an EAGLE head (eagle_head.py) serving drafts, with its own one-layer KV
pool and attention backend, and its chain (draft_chain.py): the rows of the target's newly
committed states fed in one forward, then K - 1 draft steps, without a host sync in
between; one CUDA graph replay per batch bucket on a GPU (chain_graphs.py). Rows a chain
does not feed (a prompt's) go through an eager catch-up first.

Rows follow the training-time test (eagle_ttt.py): row r of a request's draft cache holds
the K/V of step 0 at r, which reads the token at position r + 1 and the target's state at
position r and sits at RoPE position r. After a verify step the rows up to R - 1 (R = the
request's tokens - 1, the root being the last token) are fed; the output of row R - 1
gives the first draft. Draft step j (j >= 1) reads draft j and step j - 1's output, sits at
row and RoPE position R - 1 + j and sees rows 0 .. R - 1 and its own chain's earlier steps.
"""
from __future__ import annotations

import logging
import time

import torch

from specserve.args import ServerArgs
from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.errors import ArgumentError
from specserve.kv.pool import KVPool, host_to_device_async
from specserve.model.config import ModelConfig
from specserve.model.hidden_capture import HiddenCapture
from specserve.model.rope import RotaryEmbedding
from specserve.runner.cuda_graph import batch_size_buckets
from specserve.speculative.heads.eagle_checkpoint import load_head
from specserve.speculative.heads.eagle_head import EagleHead
from specserve.speculative.heads.eagle_serving import ServingEagleHead
from specserve.speculative.heads.mtp_head import MtpChainModel, MtpHead
from specserve.speculative.heads.token_map import apply_token_map
from specserve.speculative.model_drafters.catch_up_batch import catch_up_batch
from specserve.speculative.model_drafters.chain_graphs import ChainGraphs
from specserve.speculative.model_drafters.draft_chain import ChainInputs, ChainRow, run_chain
from specserve.speculative.model_drafters.draft_runner import chain_context, drafter_backend
from specserve.speculative.model_drafters.draft_tree import run_tree

logger = logging.getLogger("specserve")


def load_eagle_head(args: ServerArgs, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                    context_length: int) -> EagleHead:
    """The head in `args.speculative_draft_model_path` (SGLang / SpecForge layout), checked
    against the target and the algorithm; it borrows the target's embedding later
    (EagleHeadRunner) unless its checkpoint has one."""
    start = time.perf_counter()
    path = args.speculative_draft_model_path
    head = load_head(path, target.num_layers, device, dtype)
    config, field = head.config, "speculative_draft_model_path"
    if config.vocab_size != target.vocab_size or config.target_hidden_size != target.hidden_size:
        raise ArgumentError(f"{field}: the EAGLE head is for a target of vocabulary {config.vocab_size} and "
                            f"hidden size {config.target_hidden_size}; this target has {target.vocab_size} and "
                            f"{target.hidden_size}")
    if config.algorithm != args.speculative and args.speculative != "NAIVE_EAGLE":   # it takes either kind
        raise ArgumentError(f"{field}: an {config.algorithm} head (it reads "
                            f"{'three target layers' if config.aux_layers else 'the final state'}), "
                            f"but speculative_algorithm is {args.speculative}")
    if args.speculative_token_map:   # FR-Spec: before the checks that read the draft vocabulary's size
        apply_token_map(head, args.speculative_token_map)
        config = head.config
    if (args.speculative_eagle_topk or 1) > config.draft_vocab_size:
        raise ArgumentError(f"speculative_eagle_topk={args.speculative_eagle_topk} exceeds the head's draft "
                            f"vocabulary of {config.draft_vocab_size} tokens")
    if max(config.aux_layers, default=0) >= target.num_layers:
        raise ArgumentError(f"{field}: the head reads target layers {list(config.aux_layers)}, "
                            f"the target has {target.num_layers}")
    head.rope = RotaryEmbedding(config.head_dim, head_context(context_length, args), config.rope_theta,
                                config.rope_scaling).to(device)
    logger.info("loaded %s head %s (draft vocabulary %d) in %.1f s", config.algorithm, path,
                config.draft_vocab_size, time.perf_counter() - start)
    return head.eval().requires_grad_(False)


def head_context(context_length: int, args: ServerArgs) -> int:
    """Rows (and RoPE positions) a head's cache spans: a fused step's reserved rows past the
    root's (reserved_head_rows, less the root's own)."""
    return chain_context(context_length, reserved_head_rows(args.speculative_steps, args.speculative_eagle_topk or 1) - 1)


def reserved_head_rows(num_steps: int, topk: int = 1) -> int:
    """Head slots a fused step writes per request: the K + 1 fed rows, then a chain's K - 1
    draft steps' rows past them (a draft step sits after the last accepted row, over a fed
    row that was not), or a tree's K - 1 steps of top-k beams (draft_tree.py: each beam's
    row is its own table row's)."""
    return num_steps + 1 + (num_steps - 1) * topk


def target_capture(head: EagleHead) -> HiddenCapture:
    """The target states the head reads: three layers (EAGLE-3) or the final-normed state."""
    return HiddenCapture(layers=head.config.aux_layers, final=not head.config.aux_layers)


def kv_bytes_per_token(head: EagleHead, dtype: torch.dtype) -> int:
    return KVPool.bytes_per_token(1, head.config.num_kv_heads, head.config.head_dim, dtype)


def head_pool_size(target_pool: KVPool, num_steps: int, topk: int) -> int:
    """The head's rows: one per token the target's cache holds, and each request's draft rows
    past its tokens (a fused step's, twice: the next one is launched before this one's are
    freed; a tree's steps' top-k rows). With the prefix cache, requests that share a cached
    prefix hold few tokens of their own, and a head pool only as large as the target's ran out
    first (its requests went without drafts while the target had room)."""
    draft_rows = 2 * reserved_head_rows(num_steps, topk)
    return target_pool.size + target_pool.max_requests * draft_rows


class HeadChainModel:
    """An EAGLE head as a ChainModel: its state is the head's output (the next step's feature)."""
    token_offset = 1

    def __init__(self, head: EagleHead, backend):
        self.head, self.backend = ServingEagleHead(head), backend
        self.draft_vocab = head.draft_vocab()          # (draft vocab,) target ids

    def forward(self, batch: ForwardBatch, features: torch.Tensor | None) -> torch.Tensor:
        state = self.head.step(batch, self.backend, features)
        # a decode step's logits rows are all its rows, in order: no gather kernel for them
        return state if batch.mode is ForwardMode.DECODE else state[batch.logits_indices]

    def draft_logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.head.logits(state)


class EagleHeadRunner:
    def __init__(self, args: ServerArgs, head: EagleHead, target_model, target_pool: KVPool):
        config = head.config
        if head.embed_tokens is None:
            head.share_embedding(target_model.embed_tokens.weight)
        self.head, self.config = head, config
        self.device, self.dtype = target_pool.device, target_pool.dtype
        self.num_steps = args.speculative_steps
        self.topk = args.speculative_eagle_topk or 1          # > 1: EAGLE-2's tree (draft_tree.py)
        self.tree_nodes = args.speculative_verify_size
        self.fed_rows = self.num_steps + 1     # a verify step commits up to K + 1 tokens: their rows are fed next
        self.draft_slots = (self.num_steps - 1) * self.topk
        self.vocab_size = config.vocab_size
        # table rows: topk per request (a tree's beams), and the target's scratch row's for padding requests
        self.padding_row = target_pool.max_requests
        self.pool = KVPool(1, config.num_kv_heads, config.head_dim, head_pool_size(target_pool, self.num_steps, self.topk),
                           (target_pool.max_requests + 1) * self.topk,
                           head_context(target_pool.max_context, args), self.dtype, self.device)
        self.backend = drafter_backend(args, self.device, config.num_heads, config.num_kv_heads, config.head_dim)
        self.chain_model = MtpChainModel(head, self.backend) if isinstance(head, MtpHead) \
            else HeadChainModel(head, self.backend)
        self.graphs = None
        if self.device.type == "cuda" and not args.disable_cuda_graph and self.backend.supports_cuda_graph:
            max_bs = batch_size_buckets(min(args.cuda_graph_max_bs or 64, target_pool.max_requests))[-1]
            self.backend.init_cuda_graph_state(max_bs * self.topk, self.fed_rows, self.pool)
            # the fed rows' target states, read by every graph (filled before a replay)
            self.graph_features = torch.zeros((max_bs * self.fed_rows, config.feature_size), dtype=self.dtype,
                                              device=self.device)
            probs_shape = (self.num_steps + 1, self.vocab_size) if self.topk == 1 else None   # trees: argmax only
            self.graphs = ChainGraphs(self._run_for_graph, max_bs, self.fed_rows, self.draft_slots, self.padding_row,
                                      self.device, probs_shape)

    @torch.inference_mode()
    def catch_up(self, rows: list[int], starts: list[int], tokens: list[list[int]], slots: list[int],
                 features: torch.Tensor) -> None:
        """Step 0 over rows a chain does not feed (a prompt's, before its last K + 1): one
        EXTEND forward (catch_up_batch.py: its inputs go without waiting; H200, random 1.5B,
        batch 1: a plain step that fed through a blocking copy took ~4 ms more than one that
        did not); features: the rows' target states, request after request."""
        batch = catch_up_batch([r * self.topk for r in rows], starts, tokens, slots, self.pool, self.device)
        self.backend.plan(batch)
        self.chain_model.forward(batch, self.head.project(features.to(self.dtype)))

    @torch.inference_mode()
    def draft(self, rows: list[ChainRow], features: torch.Tensor, sample: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queued without a host sync: a chain's drafts (bs, K) target ids and, for a sampling
        chain, q over the target vocabulary (bs, K + 1, V); or a tree's (bs, 2 * (nodes - 1))
        tokens and parents (draft_tree.run_tree). features: the fed rows' target states,
        request after request."""
        sample = sample and self.topk == 1
        n = self.fed_rows
        index = host_to_device_async(   # without waiting for a step in flight (a probe's chain)
            torch.tensor([i * n + j for i, row in enumerate(rows) for j in range(len(row.tokens))]), self.device)
        if self.graphs is not None and len(rows) <= self.graphs.max_bs:
            self.graph_features.index_copy_(0, index, features.to(self.dtype))
            return self.graphs.replay(rows, sample)
        bs = len(rows)
        padded = torch.zeros((bs * n, features.shape[-1]), dtype=self.dtype, device=self.device)
        padded.index_copy_(0, index, features.to(self.dtype))
        host = ChainInputs.allocate(bs, n, self.draft_slots, "cpu", pin=self.device.type == "cuda")
        host.fill(rows, self.padding_row)
        inputs = ChainInputs.view(host.packed.to(self.device, non_blocking=True), bs, n, self.draft_slots)
        probs = torch.zeros((bs, self.num_steps + 1, self.vocab_size), device=self.device) if sample else None
        return self._run(inputs, probs, self.head.project(padded), self.backend.plan, rows), probs

    def _run(self, inputs: ChainInputs, probs: torch.Tensor | None, features: torch.Tensor, plan,
             host_rows: list[ChainRow] | None) -> torch.Tensor:
        if self.topk == 1:
            return run_chain(self.chain_model, self.pool, inputs, plan, probs, features, host_rows)
        return run_tree(self.chain_model, self.pool, inputs, plan, self.topk, self.num_steps, self.tree_nodes,
                        features, host_rows)

    def _run_for_graph(self, inputs: ChainInputs, probs: torch.Tensor | None) -> torch.Tensor:
        features = self.head.project(self.graph_features[:inputs.batch_size * self.fed_rows])
        return self._run(inputs, probs, features, self.backend.plan_for_capture, None)
