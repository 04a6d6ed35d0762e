"""--prefill-attention-backend: prompts and their chunks through one backend, decode and verify
steps through the other (attention/hybrid.py), with the logits and KV of either alone (Triton's
interpreter on the CPU for the Triton side)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

from collections import Counter

import pytest
import torch

from specserve.args import ServerArgs
from specserve.attention.hybrid import HybridBackend
from tests.model_fixtures import RunnerDriver, tiny_hf_model


def run(driver: RunnerDriver) -> list[torch.Tensor]:
    """A prompt, a second chunk over it, a decode step and a verify step."""
    return [driver.prefill([5, 17, 3, 9, 44, 2]), driver.prefill([8, 30, 4]), driver.decode(11),
            driver.verify_tree([12, 8, 30, 4], [-1, 0, 0, 1], [0, 1, 3])]


@pytest.mark.parametrize("prefill,decode", [("torch_native", "triton"), ("triton", "torch_native")])
def test_prompts_and_steps_each_take_their_backend(prefill, decode):
    hf = tiny_hf_model("qwen2")
    expected = run(RunnerDriver.from_hf(hf))
    driver = RunnerDriver.from_hf(hf, attention_backend=decode, prefill_attention_backend=prefill)
    backend = driver.runner.attn_backend
    assert isinstance(backend, HybridBackend)
    assert type(backend.prefill).__name__.lower().startswith(prefill.split("_")[0])
    calls = Counter()
    for name, part in (("prefill", backend.prefill), ("decode", backend.decode)):
        real = part.forward
        part.forward = lambda *args, name=name, real=real: calls.update([(name, args[4].mode.value)]) or real(*args)
    got = run(driver)
    layers = hf.config.num_hidden_layers
    assert calls == {("prefill", "extend"): 2 * layers, ("decode", "decode"): layers, ("decode", "verify"): layers}
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_one_backend_for_both_is_no_hybrid():
    driver = RunnerDriver.from_hf(tiny_hf_model("qwen2"), prefill_attention_backend="auto",
                                  decode_attention_backend="torch_native")
    assert not isinstance(driver.runner.attn_backend, HybridBackend)


def test_sglang_names_for_the_two_serve_as_auto():
    args = ServerArgs(prefill_attention_backend="fa3", decode_attention_backend="flashinfer")
    assert (args.prefill_attention_backend, args.decode_attention_backend) == ("auto", "auto")
