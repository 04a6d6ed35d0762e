"""Helpers of the STANDALONE tests: draft models made from a target (a noisy copy drafts
well but not perfectly), STANDALONE engine arguments, and the draft pool's accounting."""
from __future__ import annotations

import os
import shutil
import time

import torch
import transformers

from tests.spec_fixtures import assert_draft_pool_is_free, cached_draft_rows


def make_noisy_draft(target_dir, path, sigma: float, seed: int = 5) -> str:
    """A copy of the target in `path` with N(0, sigma) added to every weight (and the
    target's tokenizer): its drafts agree with the target often, not always."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * sigma)
    model.save_pretrained(str(path))
    for name in os.listdir(target_dir):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(target_dir, name), path)
    return str(path)


def standalone_args(draft_dir, num_steps: int, adaptive: bool = False, **extra) -> dict:
    """STANDALONE with `num_steps` drafts per step; by default every step verifies them (the
    adaptive policy off), which is what tests of verification need."""
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft_dir),
            "speculative_num_steps": num_steps, "speculative_disable_adaptive": not adaptive, **extra}


def wait_until_draft_kv_is_free(engine, timeout: float = 30.0) -> None:
    """Every draft-pool slot is back in the free list (or, for an EAGLE head, one of the prefix
    cache's rows) exactly once and no request has draft state."""
    drafter = engine.core.drafter
    pool = drafter.runner.pool
    deadline = time.monotonic() + timeout
    while (engine.core.has_work() or pool.slots.available() + len(cached_draft_rows(engine)) != pool.size) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not drafter.kv.sequences, f"draft state of {sorted(drafter.kv.sequences)} left behind"
    assert_draft_pool_is_free(pool, cached_draft_rows(engine))
