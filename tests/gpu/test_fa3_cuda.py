"""sgl_kernel's FA3 through the fa3 backend on a GPU: against torch_native at bf16 for steps of
one and several prompts over shuffled slots (a 7B shape's heads, chunks deep into a prompt),
and an engine that serves with it (--attention-backend fa3) gives the Triton engine's greedy
outputs, chunked prompts included, with every KV slot back. Needs the optional sglang-kernel
package (scripts/gpu_run.sh installs it where its wheel was staged into /root/models)."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.attention import fa3_backend
from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.attention.fa3_backend import FA3Backend
from specserve.attention.torch_native import TorchNativeBackend
from specserve.kv.pool import KVPool
from tests.spec_fixtures import make_tiny_directory, tiny_engine, wait_until_all_kv_is_free
from tests.test_fa3_backend import paged_kernel

pytest.importorskip("sgl_kernel.flash_attn", reason="FA3 is the optional sglang-kernel package's (specserve[fa3])")
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def test_the_kernel_loads():
    kernel, why = fa3_backend.load_kernel(torch.bfloat16)
    assert kernel is not None, why


def step(heads, prefix_lens, extend_lens, seed=0):
    num_heads, kv_heads, head_dim = heads
    gen = torch.Generator("cuda").manual_seed(seed)
    total = sum(prefix_lens) + sum(extend_lens)
    pool = KVPool(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, size=total + 64, max_requests=8,
                  max_context=max(p + e for p, e in zip(prefix_lens, extend_lens)), dtype=torch.bfloat16,
                  device=torch.device("cuda"))
    pool.k_buffers[0].normal_(generator=gen)
    pool.v_buffers[0].normal_(generator=gen)
    slots = torch.randperm(total, generator=gen, device="cuda") + 1
    rows, start = [pool.alloc_row() for _ in prefix_lens], 0
    for row, prefix in zip(rows, prefix_lens):
        pool.write_positions(row, 0, slots[start:start + prefix].to(torch.int32))
        start += prefix
    tokens = sum(extend_lens)
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.zeros(tokens, dtype=torch.long, device="cuda"),
        positions=torch.zeros(tokens, dtype=torch.long, device="cuda"), out_slots=slots[start:],
        req_rows=torch.tensor(rows, device="cuda"), prefix_lens=torch.tensor(prefix_lens, device="cuda"),
        extend_lens=torch.tensor(extend_lens, device="cuda"), prefix_lens_host=list(prefix_lens),
        extend_lens_host=list(extend_lens), kv_pool=pool, logits_indices=torch.arange(tokens, device="cuda"))
    q, k, v = (torch.randn((tokens, h, head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
               for h in (num_heads, kv_heads, kv_heads))
    return batch, q, k, v


@pytest.mark.parametrize("heads,prefix_lens,extend_lens", [
    ((28, 4, 128), [0], [2048]),
    ((28, 4, 128), [6144], [2048]),
    ((28, 4, 128), [0, 300, 1000, 57], [700, 1, 129, 2000]),
    ((12, 2, 64), [500, 0], [33, 64]),
])
def test_prompts_match_torch_native(heads, prefix_lens, extend_lens):
    batch, q, k, v = step(heads, prefix_lens, extend_lens)
    reference = TorchNativeBackend(*heads)
    reference.plan(batch)
    want = reference.forward(q, k, v, 0, batch).float()
    backend = FA3Backend(*heads)
    backend.plan(batch)
    got = backend.forward(q, None, None, 0, batch).float()   # K/V are in the pool now
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    slow = FA3Backend(*heads, kernel=paged_kernel)   # the CPU suite's stand-in agrees with the real kernel
    slow.plan(batch)
    torch.testing.assert_close(slow.forward(q.float(), None, None, 0, batch).float(), got, atol=2e-2, rtol=2e-2)


def test_an_engine_on_fa3_serves_the_triton_engines_outputs(tmp_path):
    make_tiny_directory(tmp_path, "qwen2", seed=3)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.choice([1, 9, 70, 300]))] for _ in range(10)]
    common = dict(device="cuda", dtype="bfloat16", max_total_tokens=20000, chunked_prefill_size=64,
                  prefill_cuda_graph_max_tokens=0)   # every prompt step eager: graphed ones stay on triton
    outputs = {}
    for backend in ("triton", "fa3"):
        with tiny_engine(tmp_path, attention_backend=backend, **common) as engine:
            assert (engine.core.runner.attn_backend.name == "triton (fa3 for prompts)") == (backend == "fa3")
            outputs[backend] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
            wait_until_all_kv_is_free(engine)
    same = sum(a == b for a, b in zip(outputs["fa3"], outputs["triton"]))
    assert same >= 9, outputs   # bf16: two kernels may round one near-tie differently
