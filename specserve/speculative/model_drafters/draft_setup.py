"""What a model drafter needs from the engine builder, in the order the builder can give it.

A draft model or an EAGLE head loads before the target's runner: its weights count against
the memory budget the target's KV cache is sized from, its own KV cache's cost per token
joins the target's (both caches hold as many tokens), and an EAGLE head names the target
hidden states every forward must keep (the runner's CUDA graphs are captured with them).
The drafter itself is made once the target's runner exists (its pool, its embedding).

With tensor parallelism (tp_size > 1) the drafter runs once, on rank 0, with whole weights:
the draft model or head is loaded unsharded; an EAGLE head reads rank 0's captured target
states, which are whole (the residual stream is all-reduced); a head that borrows the
target's embedding or lm_head gets whole copies gathered from the ranks' vocabulary shards
(model/parallel/vocab_weights.py says why not the vocabulary-parallel path). The workers never
see the drafter: they verify the same trees through rank 0's broadcast steps.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from specserve.args import FUSED_CHAIN_ALGORITHMS, ServerArgs
from specserve.errors import ArgumentError
from specserve.model.config import ModelConfig
from specserve.model.hidden_capture import HiddenCapture
from specserve.model.loader import resolve_model_path
from specserve.model.parallel.vocab_weights import EMBEDDING, LM_HEAD, VocabularyCopies
from specserve.runner.ranks.step_broadcast import sharded_model
from specserve.speculative.drafter import Drafter
from specserve.speculative.heads.token_map import read_token_map

if TYPE_CHECKING:
    from specserve.runner.model_runner import ModelRunner

logger = logging.getLogger("specserve")

# EAGLE-2's trees through the fused step (SPECSERVE_FUSED_TREES=0: EagleDrafter's unfused trees, for an A/B)
FUSED_TREES = os.environ.get("SPECSERVE_FUSED_TREES", "1") == "1"


@dataclass
class DraftSetup:
    kv_bytes_per_token: int                          # the drafter's own KV cache, per token
    hidden_capture: HiddenCapture | None             # target states the drafter reads (EAGLE)
    make_drafter: Callable[["ModelRunner"], Drafter]

    @property
    def reads_target_states(self) -> bool:
        """An EAGLE head needs the target's state of every token it has no row for: a prefix
        served from the prefix cache has none, so the cache keeps the head's rows too
        (speculative/model_drafters/head_prefix_cache.py; plain steps keep their states: engine/overlap.py)."""
        return self.hidden_capture is not None


def check_draft_path(args: ServerArgs) -> None:
    """A draft model's path resolves (STANDALONE), an EAGLE head's (or MTP layer's) directory
    has its config, a token map file reads."""
    path = args.speculative_draft_model_path
    if args.speculative == "STANDALONE":
        resolve_model_path(path)
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise ArgumentError(f"speculative_draft_model_path={path!r}: an EAGLE head (or MTP layer) directory needs "
                            "config.json and safetensors weights (the layout SGLang and SpecForge use)")
    if args.speculative_token_map is not None:
        read_token_map(args.speculative_token_map)   # the file's form; its ids meet the vocabulary at load


def prepare_draft(args: ServerArgs, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                  context_length: int) -> DraftSetup:
    if args.speculative == "STANDALONE":
        from specserve.speculative.model_drafters import draft_runner
        from specserve.speculative.model_drafters.standalone import StandaloneDrafter
        model = draft_runner.load_draft_model(args, target, device, dtype, context_length)
        return DraftSetup(draft_runner.kv_bytes_per_token(model, dtype), None,
                          lambda runner: StandaloneDrafter(draft_runner.DraftModelRunner(args, model, runner.pool)))
    if fuses_chain(args):
        return prepare_fused_chain(args, target, device, dtype, context_length)
    from specserve.speculative.model_drafters import eagle_runner
    from specserve.speculative.model_drafters.eagle import EagleDrafter
    head = eagle_runner.load_eagle_head(args, target, device, dtype, context_length)
    copies = whole_vocabulary_copies(args, target, head, device, dtype)

    def make_drafter(runner: "ModelRunner") -> Drafter:
        lend_vocabulary(head, runner, copies)
        drafter = EagleDrafter(eagle_runner.EagleHeadRunner(args, head, runner.model, runner.pool))
        return with_ngram(args, drafter, runner.device.type == "cuda") if args.speculative_hybrid_ngram else drafter

    return DraftSetup(eagle_runner.kv_bytes_per_token(head, dtype), eagle_runner.target_capture(head), make_drafter)


def fuses_chain(args: ServerArgs) -> bool:
    """Whether the drafter verifies and drafts in one fused step (fused_drafter.py): NAIVE_EAGLE
    and MTP always, EAGLE / EAGLE3 with a chain (top-k 1), with or without the n-gram trie
    beside them (speculative/hybrid/fused_hybrid.py), and with EAGLE-2's trees (top-k > 1)
    without it (the hybrid's steps beside the trie's drafts take the head's pending chains) and
    of at least K + 1 nodes (the head is fed the accepted path, up to the tree's K + 1 levels,
    from the tree's nodes)."""
    if args.speculative in FUSED_CHAIN_ALGORITHMS:
        return True
    if args.speculative not in ("EAGLE", "EAGLE3"):
        return False
    if (args.speculative_eagle_topk or 1) == 1:
        return True
    return (FUSED_TREES and not args.speculative_hybrid_ngram
            and args.speculative_verify_size >= args.speculative_steps + 1)


def with_ngram(args: ServerArgs, head: Drafter, on_gpu: bool) -> Drafter:
    """--speculative-hybrid-ngram: the head's drafter and an n-gram trie, each request's step
    drafted by either (speculative/hybrid/); a fused chain's head steps stay fused; the trie
    forecasts as NGRAM's does on this device (--speculative-ngram-forecast)."""
    from specserve.speculative.hybrid.drafter import HybridDrafter
    from specserve.speculative.hybrid.fused_hybrid import FusedHybridDrafter
    from specserve.speculative.model_drafters.fused_drafter import FusedChainDrafter
    from specserve.speculative.ngram.drafter import NgramDrafter
    kind = FusedHybridDrafter if isinstance(head, FusedChainDrafter) else HybridDrafter
    return kind(NgramDrafter.from_args(args, on_gpu), head, args.speculative_verify_size)


def prepare_fused_chain(args: ServerArgs, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                        context_length: int) -> DraftSetup:
    """An EAGLE head of either kind (EAGLE, EAGLE3, NAIVE_EAGLE) or an MTP layer (MTP): the head
    drafts a chain of K tokens per step (K = 1 for NAIVE_EAGLE and MTP), verified and drafted
    again in one fused step (fused_drafter.py)."""
    from specserve.speculative.heads.mtp_checkpoint import load_mtp_head
    from specserve.speculative.model_drafters import eagle_runner
    from specserve.speculative.model_drafters.fused_chain import FusedChainRunner
    from specserve.speculative.model_drafters.fused_drafter import FusedChainDrafter
    if args.speculative == "MTP":
        head = load_mtp_head(args.speculative_draft_model_path, target, device, dtype,
                             eagle_runner.head_context(context_length, args))
    else:
        head = eagle_runner.load_eagle_head(args, target, device, dtype, context_length)
    copies = whole_vocabulary_copies(args, target, head, device, dtype)

    def make_drafter(runner: "ModelRunner") -> Drafter:
        if args.speculative == "MTP":
            head.share_target(sharded_model(runner.model))   # its norm; shards of the rest are replaced next
        lend_vocabulary(head, runner, copies)
        head_runner = eagle_runner.EagleHeadRunner(args, head, runner.model, runner.pool)
        drafter = FusedChainDrafter(head_runner, FusedChainRunner(runner, head_runner))
        return with_ngram(args, drafter, runner.device.type == "cuda") if args.speculative_hybrid_ngram else drafter

    return DraftSetup(eagle_runner.kv_bytes_per_token(head, dtype), eagle_runner.target_capture(head), make_drafter)


def whole_vocabulary_copies(args: ServerArgs, target: ModelConfig, head, device: torch.device,
                            dtype: torch.dtype) -> VocabularyCopies | None:
    """With tp_size > 1, rank 0's whole copies of the target weights the head borrows,
    allocated now (before the target's KV cache is sized from what memory is left) and
    filled by lend_vocabulary; None when nothing is borrowed or nothing is split."""
    parts = list(dict.fromkeys(borrowed_parts(head, target.tie_word_embeddings).values()))
    if args.tp_size == 1 or not parts:
        return None
    return VocabularyCopies(target, parts, args.tp_size, device, dtype)


def lend_vocabulary(head, runner: "ModelRunner", copies: VocabularyCopies | None) -> None:
    """Gathers the copies from the ranks and hands them to the head, in place of the
    target's own weights (which EagleHeadRunner or share_target lend without tensor
    parallelism, and which are vocabulary shards with it)."""
    if copies is None:
        return
    copies.gather(runner.tp, sharded_model(runner.model))
    for role, part in borrowed_parts(head, runner.config.tie_word_embeddings).items():
        if role == "embedding":
            head.share_embedding(copies[part])
        else:
            head.borrowed.lm_head = copies[part]


def borrowed_parts(head, tie_word_embeddings: bool) -> dict[str, str]:
    """What the head borrows from the target ("embedding", "lm_head") -> the target's
    vocabulary-parallel weight that holds it (vocab_weights.EMBEDDING or LM_HEAD)."""
    from specserve.speculative.heads.mtp_head import MtpHead
    if not isinstance(head, MtpHead):   # an EAGLE head: its own lm_head, perhaps the target's embedding
        return {"embedding": EMBEDDING} if head.embed_tokens is None else {}
    borrowed = {} if head.own_embedding else {"embedding": EMBEDDING}
    if head.lm_head is None:
        borrowed["lm_head"] = EMBEDDING if tie_word_embeddings else LM_HEAD
    return borrowed
