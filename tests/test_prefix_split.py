"""A prompt chunk's attention in two calls, the prefix unmasked and the chunk causal, merged by
their log-sum-exps (attention/prefix_split.py): the same attention as one masked call, on the
CPU with the math kernel that stands in for cuDNN's and flash attention's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.attention import prefix_split
from specserve.attention.base import ForwardMode
from specserve.attention.torch_native import TorchNativeBackend
from tests.test_triton_attention import attend, make_batch, make_pool, random_qkv


@pytest.mark.parametrize("prefix,chunk,heads,kv_heads", [(0, 7, 4, 2), (13, 7, 4, 2), (40, 1, 4, 4), (5, 9, 6, 2)])
def test_two_calls_merged_equal_one_masked_call(prefix, chunk, heads, kv_heads):
    gen = torch.Generator().manual_seed(prefix + chunk)
    q = torch.randn(1, heads, chunk, 16, generator=gen)
    k, v = (torch.randn(1, kv_heads, prefix + chunk, 16, generator=gen) for _ in range(2))
    mask = torch.ones(chunk, prefix + chunk, dtype=torch.bool).tril(prefix)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(prefix_split.attend_in_two(q, k, v, 0.25, "math"), want, atol=1e-5, rtol=1e-5)


def test_the_backend_attends_a_prompt_chunk_alone_in_two_when_asked(monkeypatch):
    heads = (8, 2, 64)
    pool = make_pool(heads[1], heads[2])
    batch = make_batch(pool, ForwardMode.EXTEND, prefix_lens=[37], extend_lens=[45])
    q, k, v = random_qkv(batch.num_tokens, *heads)
    want = attend(TorchNativeBackend(*heads), batch, q, k, v)
    calls = []
    monkeypatch.setattr(prefix_split, "KERNEL", "math")
    monkeypatch.setattr(prefix_split, "_attend", lambda *args, real=prefix_split._attend: calls.append(args[3])
                        or real(*args))
    torch.testing.assert_close(attend(TorchNativeBackend(*heads), batch, q, k, v), want, atol=1e-4, rtol=1e-4)
    assert calls == [True, False]   # the chunk causally, then its prefix
