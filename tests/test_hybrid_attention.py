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
from specserve.attention.base import ForwardMode
from specserve.attention.hybrid import HybridBackend
from specserve.attention.registry import create_target_backend
from specserve.attention.torch_native import TorchNativeBackend
from tests.model_fixtures import RunnerDriver, tiny_hf_model
from tests.test_triton_attention import attend, make_batch, make_pool, random_qkv


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
    args = ServerArgs(prefill_attention_backend="fa4", decode_attention_backend="flashinfer")
    assert (args.prefill_attention_backend, args.decode_attention_backend) == ("auto", "auto")


def test_auto_on_a_gpu_sends_a_prompt_alone_to_torch_flash_attention():
    """auto on a GPU: a step of one prompt or chunk through torch_native (flash attention), a step
    of several prompts and every decode and verify step through Triton; anywhere else, or with a
    backend named, no such split."""
    backend = create_target_backend("auto", None, None, "cuda", 8, 2, 64)
    assert isinstance(backend, HybridBackend) and backend.lone_prompts
    assert backend.name == "triton (torch_native for a prompt alone in its step)"
    heads = (8, 2, 64)
    pool = make_pool(heads[1], heads[2])
    steps = ((ForwardMode.EXTEND, [37], [45], backend.prefill), (ForwardMode.EXTEND, [37, 0], [45, 5], backend.decode),
             (ForwardMode.DECODE, [37, 20], [1, 1], backend.decode))
    for mode, prefix_lens, extend_lens, expected in steps:
        batch = make_batch(pool, mode, prefix_lens=prefix_lens, extend_lens=extend_lens)
        q, k, v = random_qkv(batch.num_tokens, *heads)
        want = attend(TorchNativeBackend(*heads), batch, q, k, v)
        torch.testing.assert_close(attend(backend, batch, q, k, v), want, atol=1e-4, rtol=1e-4)
        assert batch.planned_by is expected
    assert not isinstance(create_target_backend("auto", None, None, "cpu", *heads), HybridBackend)
    assert not isinstance(create_target_backend("triton", None, None, "cuda", *heads), HybridBackend)
    named = create_target_backend("auto", "triton", "torch_native", "cuda", *heads)
    assert not named.lone_prompts and named.name == "torch_native (triton for prompts)"
