"""CPU fp32 matmul dispatch (specserve/model/cpu_linear.py): every path (1 row, oneDNN-packed
rows, many rows) equals F.linear up to float rounding, the tied embedding keeps working, and a
tiny model's logits are those of the unprepared model through prefill, decode and draft trees."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.cpu_linear import CpuLinear
from tests.model_fixtures import RunnerDriver, tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("max_packed_rows", [32, None])
@pytest.mark.parametrize("rows", [0, 1, 2, 8, 64])
def test_cpu_linear_equals_f_linear(rows, bias, max_packed_rows):
    torch.manual_seed(rows)
    for linear in (nn.Linear(64, 96, bias=bias), nn.Linear(96, 64, bias=bias)):
        x = torch.randn(rows, linear.in_features)
        expected = F.linear(x, linear.weight, linear.bias)
        for weight in (linear.weight, linear.weight.t().contiguous().t()):   # row- and column-major
            with torch.inference_mode():
                got = CpuLinear(weight, linear.bias, max_packed_rows)(x)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def prepared_driver(arch: str):
    hf = tiny_hf_model(arch)
    driver = RunnerDriver.from_hf(hf)
    model = driver.runner.model
    assert isinstance(model.lm_head, CpuLinear)
    assert all(isinstance(m, CpuLinear) for layer in model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    return hf, driver


def test_tied_lm_head_and_embedding():
    hf, driver = prepared_driver("qwen2")          # tied embeddings
    model, embedding = driver.runner.model, hf.model.embed_tokens.weight.detach()
    assert model.embed_tokens.weight is model.lm_head.weight   # one shared, column-major copy
    assert model.lm_head.weight.t().is_contiguous()
    assert model.layers[0].mlp.down_proj.weight.is_contiguous()   # fewer outputs than inputs: row-major
    ids = torch.tensor([0, 5, 96, 5])
    with torch.inference_mode():
        assert torch.equal(model.embed_tokens(ids), embedding[ids])
        for rows in (1, 2, 8, 64):
            x = torch.randn(rows, embedding.shape[1])
            torch.testing.assert_close(model.lm_head(x), x @ embedding.t(), atol=1e-5, rtol=0)


def run_steps(driver, tokens: list[int]) -> list[torch.Tensor]:
    """Prefill chunks of 40 (over the packed limit) and 3 rows, decodes, and 8- and 2-node trees."""
    out = [driver.prefill(tokens[:40]), driver.prefill(tokens[40:43])]
    out += [driver.decode(t) for t in tokens[43:46]]
    out.append(driver.verify_tree(tokens[46:54], [-1, 0, 1, 2, 0, 4, 1, 6], commit_path=[0, 1, 2, 3]))
    out.append(driver.verify_tree(tokens[54:56], [-1, 0], commit_path=[0, 1]))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # untied; tied with a qkv bias
def test_logits_unchanged_end_to_end(arch, monkeypatch):
    hf, prepared = prepared_driver(arch)
    monkeypatch.setattr("specserve.runner.model_runner.use_cpu_linears", lambda model: None)
    plain = RunnerDriver.from_hf(hf)
    assert isinstance(plain.runner.model.layers[0].mlp.down_proj, nn.Linear)
    tokens = torch.randint(0, hf.config.vocab_size, (56,), generator=torch.Generator().manual_seed(2)).tolist()
    for got, expected in zip(run_steps(prepared, tokens), run_steps(plain, tokens), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
