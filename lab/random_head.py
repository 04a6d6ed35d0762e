"""An EAGLE-3 head with random weights, shaped for one of random_model.py's target shapes and
saved in the checkpoint layout the engine loads (eagle_checkpoint.py), so a benchmark can
run the fused EAGLE-3 step without a trained head.

It is sized as SpecForge's heads (and our trainer's) are: one decoder layer shaped like a
target layer, fc over the three target layers eagle3_layers picks, and a draft vocabulary
of `draft_vocab_size` target ids mapped by d2t. What a step costs depends on these shapes,
not on the weights; random weights make drafts the target (almost) never accepts.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from specserve.bench.random_model import SHAPES
from specserve.model.config import ModelConfig
from specserve.speculative.heads.eagle_checkpoint import save_head
from specserve.speculative.heads.eagle_config import DEFAULT_DRAFT_VOCAB_SIZE, EagleHeadConfig
from specserve.speculative.heads.eagle_head import EagleHead


def write_random_eagle3_head(directory: str, shape: str, draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
                             dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    """Writes config.json and model.safetensors (N(0, 0.02) weights, unit norms, a random
    draft vocabulary) into `directory`; returns it."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: expected one of {sorted(SHAPES)}")
    target = ModelConfig.from_hf(SimpleNamespace(**SHAPES[shape]))
    if not 0 < draft_vocab_size <= target.vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {target.vocab_size}] for {shape}, got {draft_vocab_size}")
    config = EagleHeadConfig.for_target(target, "EAGLE3", draft_vocab_size)
    head = EagleHead(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if "norm" in name:
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        vocabulary = torch.randperm(target.vocab_size, generator=generator)[:draft_vocab_size]
        head.set_draft_vocab(vocabulary.sort().values)
    save_head(head, directory, dtype)
    return directory
