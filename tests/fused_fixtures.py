"""Helpers of the fused one-step chain's tests (NAIVE_EAGLE, MTP): engine arguments, a spy
that counts the steps the fused step served and those the engine verified itself, random
heads for a target, and the accounting of the head's cache and pending drafts."""
from __future__ import annotations

import time

import torch

from specserve.model.loader import load_checkpoint
from specserve.runner.model_runner import build_model
from specserve.speculative.heads.eagle_checkpoint import save_head
from specserve.speculative.heads.mtp_checkpoint import save_mtp_head
from specserve.speculative.heads.mtp_head import MtpHead, MtpHeadConfig
from specserve.training.eagle_trainer import build_head
from tests.spec_fixtures import wait_until_all_kv_is_free
from tests.standalone_fixtures import wait_until_draft_kv_is_free


def fused_args(algorithm: str, head_path, adaptive: bool = False, **extra) -> dict:
    """Every step drafts (what tests of the fused step need), or with the adaptive policy,
    the engine's default (tests/test_eagle_adaptive.py)."""
    return {"speculative_algorithm": algorithm, "speculative_draft_model_path": str(head_path),
            "speculative_disable_adaptive": not adaptive, **extra}


class FusedSpy:
    """Counts, per request, the drafter's verify steps: `fused` (verified and drafted in one
    fused step; `chained` of them launched before the step they follow was read), `engine`
    (verified by the engine: a batch the fused step does not serve), and the requests that
    needed a first draft (`first_drafts`)."""

    def __init__(self, drafter):
        self.fused = self.engine = self.first_drafts = self.chained = 0
        launch_fused, first_drafts = drafter.launch_fused, drafter._first_drafts

        def launch(reqs, *args):   # every fused step is launched here (verify_fused's and the engine's greedy path)
            launched = launch_fused(reqs, *args)
            if launched is None:
                self.engine += len(reqs)
            else:
                self.fused += len(reqs)
            return launched

        def first(reqs):
            self.first_drafts += len(reqs)
            return first_drafts(reqs)

        adopt_chained = drafter.adopt_chained

        def adopt(reqs, *args):   # a step launched before the one it follows was read, kept for these requests
            self.fused += len(reqs)
            self.chained += len(reqs)
            return adopt_chained(reqs, *args)

        drafter.launch_fused, drafter._first_drafts, drafter.adopt_chained = launch, first, adopt


def save_random_eagle_head(target_path, head_path, algorithm: str = "EAGLE3", seed: int = 0,
                           draft_vocab: torch.Tensor | None = None) -> None:
    """An untrained head for the target in `target_path` (over `draft_vocab`, default all of it)."""
    checkpoint = load_checkpoint(str(target_path), dtype=torch.float32)
    model = build_model(checkpoint.config, checkpoint.state_dict, torch.device("cpu"), torch.float32, 512)
    torch.manual_seed(seed)
    vocab = draft_vocab if draft_vocab is not None else torch.arange(checkpoint.config.vocab_size)
    save_head(build_head(model, algorithm, vocab, max_positions=512), str(head_path))


def save_random_mtp_head(target_path, head_path, seed: int = 0, std: float = 0.2, own_norm: bool = True,
                         own_lm_head: bool = False, own_embedding: bool = False) -> MtpHead:
    """An MTP layer of random weights shaped for the target in `target_path`, saved in the
    NextN layout; returns it."""
    config = load_checkpoint(str(target_path), dtype=torch.float32).config
    head = MtpHead(MtpHeadConfig.for_target(config), own_norm=own_norm, own_lm_head=own_lm_head,
                   own_embedding=own_embedding)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    save_mtp_head(head, str(head_path))
    return head


def wait_until_fused_state_is_free(engine) -> None:
    """Every target and head KV slot is back, and no request has a pending draft or target states."""
    wait_until_all_kv_is_free(engine)
    wait_until_draft_kv_is_free(engine)
    drafter = engine.core.drafter
    # the core thread frees a finished request's KV before its draft state (EngineCore._finish):
    # the KV can be back while the draft state's release is still to run
    deadline = time.monotonic() + 30.0
    while (drafter.pending or drafter.states._states) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not drafter.pending and not drafter.states._states and drafter.states.held_rows == 0
