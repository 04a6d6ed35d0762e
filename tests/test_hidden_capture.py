"""The target's hidden states captured by our decoder (HiddenCapture) equal transformers'
output_hidden_states on SmolLM2 in fp32; capturing leaves the logits unchanged."""
from __future__ import annotations

import pytest
import torch

from specserve.model.hidden_capture import HiddenCapture, eagle3_layers
from specserve.training.target_features import TargetFeatureExtractor
from tests.model_fixtures import RunnerDriver

ATOL, RTOL = 2e-3, 1e-5  # fp32, 30 layers; a few residual-stream lanes are in the thousands


@pytest.fixture(scope="module")
def smollm2_model(smollm2_checkpoint):
    driver = RunnerDriver(smollm2_checkpoint.config, smollm2_checkpoint.state_dict)
    yield driver.runner.model
    del driver


def reference_states(hf_model, tokens: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens]), output_hidden_states=True).hidden_states


def test_eagle3_layers_follow_sglang():
    assert eagle3_layers(30) == (1, 14, 26)
    assert eagle3_layers(28) == (1, 13, 24)


def test_captured_states_equal_transformers(smollm2_model, smollm2_hf, smollm2_checkpoint):
    tokenizer = smollm2_checkpoint.tokenizer
    sequences = [tokenizer("The quick brown fox jumps over the lazy dog.").input_ids,
                 tokenizer("Speculative decoding drafts tokens cheaply").input_ids]
    layers = eagle3_layers(smollm2_checkpoint.config.num_layers)
    extractor = TargetFeatureExtractor(smollm2_model, layers, max_tokens=64, max_sequences=4)
    states = extractor(sequences)
    start = 0
    for tokens in sequences:
        expected = reference_states(smollm2_hf, tokens)
        rows = slice(start, start + len(tokens))
        # hidden_states[i + 1] is the output of layer i; the last entry is after the final norm
        want = torch.cat([expected[layer + 1][0] for layer in layers], dim=-1)
        torch.testing.assert_close(states.layers[rows], want, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(states.final[rows], expected[-1][0], atol=ATOL, rtol=RTOL)
        start += len(tokens)


def test_capture_rows_and_logits_unchanged(smollm2_model, smollm2_checkpoint):
    tokens = smollm2_checkpoint.tokenizer("One two three four five six").input_ids
    extractor = TargetFeatureExtractor(smollm2_model, (0, 5), max_tokens=32, max_sequences=1)
    everything = extractor([tokens])
    rows = torch.tensor([0, len(tokens) - 1])
    chosen = extractor([tokens], rows=rows)
    torch.testing.assert_close(chosen.layers, everything.layers[rows], atol=0, rtol=0)
    torch.testing.assert_close(chosen.final, everything.final[rows], atol=0, rtol=0)

    plain = extractor._extend_batch([tokens], HiddenCapture(layers=(3,)))
    plain.hidden_capture = None
    extractor.backend.plan(plain)
    with torch.no_grad():
        logits_plain = smollm2_model(plain, extractor.backend)
        captured = extractor._extend_batch([tokens], HiddenCapture(layers=(3,), final=True))
        extractor.backend.plan(captured)
        logits_captured = smollm2_model(captured, extractor.backend)
    torch.testing.assert_close(logits_captured, logits_plain, atol=0, rtol=0)


def test_bad_capture_layer_is_refused(smollm2_model):
    extractor = TargetFeatureExtractor(smollm2_model, (30,), max_tokens=8, max_sequences=1)
    with pytest.raises(ValueError, match="HiddenCapture.layers"):
        extractor([[1, 2, 3]])
