"""The fa3 backend's planning (page table, sequence lengths) against TorchNativeBackend, with a
reference of the kernel's contract in torch standing in for sgl_kernel's FA3 (which needs a
Hopper or Ampere GPU: tests/gpu/test_fa3_cuda.py runs the real one); and how the three
attention flags resolve fa3 where it runs and where it does not."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

import logging

import pytest
import torch

from specserve.attention import fa3_backend, registry
from specserve.attention.base import ForwardMode
from specserve.attention.fa3_backend import FA3Backend
from specserve.attention.hybrid import HybridBackend
from specserve.attention.torch_native import TorchNativeBackend
from specserve.attention.triton_backend import TritonBackend
from tests.test_triton_attention import attend, make_batch, make_pool, random_qkv

HEADS = [(2, 2, 64), (8, 2, 128)]


def paged_kernel(q, k_cache, v_cache, *, page_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale,
                 causal):
    """flash_attn_with_kvcache's contract for pages of one token: request b's queries are rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1], its keys the first cache_seqlens[b] slots of its page
    table row, causal aligned to the lower right."""
    assert k_cache.shape[1] == 1 and page_table.dtype == torch.int32 and causal
    assert q.is_contiguous() and max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(page_table.shape[0]):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        slots = page_table[b, :int(cache_seqlens[b])].long()
        keys, values = (cache[slots, 0].to(q.dtype).repeat_interleave(group, dim=1) for cache in (k_cache, v_cache))
        scores = torch.einsum("qhd,khd->hqk", q[rows], keys) * softmax_scale
        queries, key_count = scores.shape[1], scores.shape[2]
        hidden = torch.ones(queries, key_count, dtype=torch.bool, device=q.device).triu(key_count - queries + 1)
        out[rows] = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), values)
    return out


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("prefix_lens,extend_lens", [([0], [37]), ([45], [20]), ([0, 30, 7, 120], [9, 1, 25, 40])])
def test_prompts_attend_as_the_reference_backend(heads, prefix_lens, extend_lens):
    """One prompt, a chunk over a prefix, and a step of several prompts and chunks (one of a
    single token), shuffled slots: the page table must name every key in order."""
    pool = make_pool(heads[1], heads[2])
    batch = make_batch(pool, ForwardMode.EXTEND, prefix_lens, extend_lens)
    q, k, v = random_qkv(batch.num_tokens, *heads)
    want = attend(TorchNativeBackend(*heads), batch, q, k, v)
    strided_q = torch.cat([q, q], dim=-1)[..., :heads[2]]   # rows strided as a view of the qkv projection
    torch.testing.assert_close(attend(FA3Backend(*heads, kernel=paged_kernel), batch, strided_q, k, v), want,
                               atol=1e-4, rtol=1e-4)


def test_the_new_tokens_table_entries_are_not_written():
    """The page table is a copy: the forward leaves req_to_token as the scheduler wrote it."""
    pool = make_pool(2, 64)
    batch = make_batch(pool, ForwardMode.EXTEND, [10, 0], [6, 4])
    before = pool.req_to_token.clone()
    FA3Backend(2, 2, 64, kernel=paged_kernel).plan(batch)
    assert torch.equal(pool.req_to_token, before)
    meta = batch.attn_metadata
    assert meta.cache_seqlens.tolist() == [16, 4] and meta.cu_seqlens_q.tolist() == [0, 6, 10]
    assert meta.page_table[0, 10:16].tolist() == batch.out_slots[:6].tolist()


def test_decode_and_verify_steps_are_refused():
    pool = make_pool(2, 64)
    batch = make_batch(pool, ForwardMode.DECODE, [5], [1])
    with pytest.raises(ValueError, match="decode step belongs to the decode backend"):
        FA3Backend(2, 2, 64, kernel=paged_kernel).plan(batch)


def test_fa3_takes_every_prompt_step_and_triton_the_rest(monkeypatch):
    monkeypatch.setattr(fa3_backend, "load_kernel", lambda dtype=torch.bfloat16: (paged_kernel, ""))
    heads = (8, 2, 64)
    backend = registry.create_target_backend("fa3", None, None, "cuda", *heads)
    assert isinstance(backend, HybridBackend) and not backend.lone_prompts
    assert isinstance(backend.prefill, FA3Backend) and isinstance(backend.decode, TritonBackend)
    assert backend.name == "triton (fa3 for prompts)"
    # --decode-attention-backend fa3 (an SGLang command line) is served by triton: FA3 here takes no trees
    assert isinstance(registry.create_target_backend("triton", None, "fa3", "cuda", *heads), TritonBackend)
    prefill_only = registry.create_target_backend("auto", "fa3", None, "cuda", *heads)
    assert isinstance(prefill_only.prefill, FA3Backend) and isinstance(prefill_only.decode, TritonBackend)
    pool = make_pool(heads[1], heads[2])
    for mode, prefix_lens, extend_lens, part in ((ForwardMode.EXTEND, [37, 0], [45, 5], backend.prefill),
                                                (ForwardMode.DECODE, [37, 20], [1, 1], backend.decode)):
        batch = make_batch(pool, mode, prefix_lens=prefix_lens, extend_lens=extend_lens)
        q, k, v = random_qkv(batch.num_tokens, *heads)
        want = attend(TorchNativeBackend(*heads), batch, q, k, v)
        torch.testing.assert_close(attend(backend, batch, q, k, v), want, atol=1e-4, rtol=1e-4)
        assert batch.planned_by is part


def test_auto_on_a_gpu_takes_fa3_for_prompts_where_it_loads(monkeypatch):
    """auto on a GPU with sgl_kernel's FA3 loading: every prompt step to FA3, the rest to
    triton; not for a float32 model, which FA3 does not take, and not with a backend named."""
    monkeypatch.setattr(fa3_backend, "load_kernel",
                        lambda dtype=torch.bfloat16: (paged_kernel, "") if dtype != torch.float32 else (None, "fp32"))
    heads = (8, 2, 64)
    backend = registry.create_target_backend("auto", None, None, "cuda", *heads)
    assert isinstance(backend.prefill, FA3Backend) and not backend.lone_prompts
    in_float32 = registry.create_target_backend("auto", None, None, "cuda", *heads, dtype=torch.float32)
    assert isinstance(in_float32.prefill, TorchNativeBackend) and in_float32.lone_prompts
    assert isinstance(registry.create_target_backend("triton", None, None, "cuda", *heads), TritonBackend)
    assert isinstance(registry.create_target_backend("auto", "torch_native", None, "cuda", *heads).prefill,
                      TorchNativeBackend)


def test_fa3_where_it_does_not_run_serves_as_auto(monkeypatch, caplog):
    monkeypatch.setattr(fa3_backend, "load_kernel", lambda dtype=torch.bfloat16: (None, "sgl_kernel's FA3 does not load"))
    with caplog.at_level(logging.WARNING):
        on_gpu = registry.create_target_backend("fa3", None, None, "cuda", 8, 2, 64)
        on_cpu = registry.create_target_backend("fa3", None, None, "cpu", 8, 2, 64)
    assert isinstance(on_gpu, HybridBackend) and on_gpu.lone_prompts   # auto's
    assert isinstance(on_cpu, TorchNativeBackend)
    assert "fa3 serves as auto: sgl_kernel's FA3 does not load" in caplog.text
    assert "FA3 needs a CUDA GPU" in caplog.text
