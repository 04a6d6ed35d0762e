"""Our decoder's logits equal transformers' for every architecture (fp32, CPU), through
chunked prefill and decode steps; SmolLM2 from its GGUF too."""
from __future__ import annotations

import pytest
import torch

from tests.model_fixtures import ARCHITECTURES, RunnerDriver, tiny_hf_model

ATOL = 2e-4


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_prefill_chunks_and_decode_match_transformers(arch):
    hf = tiny_hf_model(arch)
    tokens = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = reference_logits(hf, tokens)
    driver = RunnerDriver.from_hf(hf)
    got = [driver.prefill(tokens[:7]), driver.prefill(tokens[7:12])]    # a chunk with a cached prefix
    torch.testing.assert_close(got[0], expected[6], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], expected[11], atol=ATOL, rtol=0)
    for position in range(12, 20):
        torch.testing.assert_close(driver.decode(tokens[position]), expected[position], atol=ATOL, rtol=0)


def test_smollm2_gguf_matches_transformers_gguf(smollm2_hf, smollm2_checkpoint):
    hf = smollm2_hf
    tokens = smollm2_checkpoint.tokenizer("The quick brown fox jumps over the lazy dog. Then").input_ids
    expected = reference_logits(hf, tokens)
    driver = RunnerDriver(smollm2_checkpoint.config, smollm2_checkpoint.state_dict)
    torch.testing.assert_close(driver.prefill(tokens[:-3]), expected[-4], atol=1e-3, rtol=0)
    for position in range(len(tokens) - 3, len(tokens)):
        torch.testing.assert_close(driver.decode(tokens[position]), expected[position], atol=1e-3, rtol=0)
