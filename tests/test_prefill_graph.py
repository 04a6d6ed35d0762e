"""What a prefill CUDA graph computes, checked on the CPU (Triton's interpreter): the ragged
block table, the padded attention batch, and the padded forward's logits and KV writes
against the eager prefill. The graph capture itself needs a GPU (tests/gpu)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from specserve.args import ArgumentError, ServerArgs  # noqa: E402
from specserve.attention.base import ForwardBatch, ForwardMode  # noqa: E402
from specserve.attention.kernels.extend import CONFIG, ragged_block_table, ragged_blocks_bound  # noqa: E402
from specserve.attention.torch_native import TorchNativeBackend  # noqa: E402
from specserve.attention.triton_backend import TritonBackend  # noqa: E402
from specserve.kv.pool import PADDING_SLOT  # noqa: E402
from specserve.model.config import ModelConfig  # noqa: E402
from specserve.runner.model_runner import ModelRunner  # noqa: E402
from specserve.runner.prefill_graph import PrefillInputs, forward_prefill, token_buckets  # noqa: E402
from tests.model_fixtures import tiny_hf_model  # noqa: E402
from tests.test_triton_attention import DEVICE, make_batch, make_pool, random_qkv, small_splits  # noqa: E402


def test_block_table_gives_each_request_its_blocks_once():
    group, lens = 3, [0, 40, 5, 0, 22]   # empty requests (padding) in between
    qo_indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    bound = ragged_blocks_bound(sum(lens), len(lens), group)
    reqs, rows = ragged_block_table(qo_indptr, group, bound)
    needed = [-(-n * group // CONFIG["BLOCK_M"]) for n in lens]
    pairs = list(zip(reqs.tolist(), rows.tolist()))
    real = pairs[:sum(needed)]
    assert real == [(b, r) for b, count in enumerate(needed) for r in range(count)]
    for b, r in pairs[sum(needed):]:   # the rest start past their request's rows: they read nothing
        assert r * CONFIG["BLOCK_M"] >= lens[b] * group
    assert bound >= sum(needed)


def padded_extend_batch(real: ForwardBatch, extra_tokens: int, extra_reqs: int) -> ForwardBatch:
    """`real` as a prefill graph sees it: padding tokens after its tokens, empty requests after its requests."""
    long = dict(dtype=torch.long, device=DEVICE)
    num_tokens, bs = real.num_tokens + extra_tokens, real.batch_size + extra_reqs
    pad = lambda t, n, value: torch.cat([t, torch.full((n,), value, **long)])
    return ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.zeros(num_tokens, **long), positions=torch.zeros(num_tokens, **long),
        out_slots=pad(real.out_slots, extra_tokens, PADDING_SLOT), req_rows=pad(real.req_rows, extra_reqs, 0),
        prefix_lens=pad(real.prefix_lens, extra_reqs, 0), extend_lens=pad(real.extend_lens, extra_reqs, 0),
        prefix_lens_host=[0] * bs, extend_lens_host=[0] * bs, kv_pool=real.kv_pool,
        logits_indices=torch.zeros(bs, **long))


@pytest.mark.parametrize("target_programs", [1, 64])   # one split; several splits and their merge
def test_ragged_extend_attention_with_padding_matches_reference(target_programs):
    heads = num_heads, num_kv_heads, head_dim = (6, 2, 64)
    pool = make_pool(num_kv_heads, head_dim)
    real = make_batch(pool, ForwardMode.EXTEND, prefix_lens=[37, 0, 130], extend_lens=[16, 70, 5])
    q, k, v = random_qkv(real.num_tokens, num_heads, num_kv_heads, head_dim)
    reference = TorchNativeBackend(*heads)
    reference.plan(real)
    expected = reference.forward(q, k, v, 0, real)

    padded = padded_extend_batch(real, extra_tokens=9, extra_reqs=2)
    backend = small_splits(TritonBackend(*heads), target_programs)
    backend.plan_ragged_extend(padded)
    assert (padded.attn_metadata.partial_out is None) == (target_programs == 1)
    pad_q = torch.cat([q, torch.randn(9, num_heads, head_dim, device=DEVICE)])
    pad_kv = [torch.cat([t, torch.zeros(9, num_kv_heads, head_dim, device=DEVICE)]) for t in (k, v)]
    got = backend.forward(pad_q, *pad_kv, 0, padded)
    torch.testing.assert_close(got[:real.num_tokens], expected, atol=1e-4, rtol=1e-4)


def test_padded_prefill_forward_matches_the_eager_prefill():
    """Two requests (one a later chunk over a cached prefix, one a whole prompt), padded to
    a 32-token, 4-request graph batch: same logits for the sampled request, same KV."""
    hf = tiny_hf_model("qwen2", seed=4)
    config = ModelConfig.from_hf(hf.config)
    args = ServerArgs(max_total_tokens=256, attention_backend="triton", max_running_requests=4, disable_cuda_graph=True)
    runners = [ModelRunner(args, config, hf.state_dict(), DEVICE, torch.float32, 128) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (12, 9)]
    prefix = 5   # the first request's first 5 tokens are already cached
    outputs = []
    for runner, padded in zip(runners, (False, True)):
        reqs = [SimpleNamespace(all_ids=p, kv_len=0, row=runner.pool.alloc_row()) for p in prompts]
        first = runner.pool.slots.alloc(prefix)
        runner.extend(reqs[:1], [prefix], first, [False])
        runner.pool.write_positions(reqs[0].row, 0, torch.tensor(first, dtype=torch.int32, device=DEVICE))
        reqs[0].kv_len = prefix
        lens = [len(prompts[0]) - prefix, len(prompts[1])]
        slots = runner.pool.slots.alloc(sum(lens))
        if not padded:
            logits = runner.extend(reqs, lens, slots, [False, True])[:, 0]
        else:
            host, inputs = PrefillInputs.allocate(32, 4, "cpu"), PrefillInputs.allocate(32, 4, DEVICE)
            host.fill(prompts[0][prefix:] + prompts[1], list(range(prefix, 12)) + list(range(9)), slots,
                      [r.row for r in reqs], [prefix, 0], lens, [sum(lens) - 1], runner.pool.scratch_row)
            inputs.packed.copy_(host.packed)
            logits = forward_prefill(runner.model, runner.attn_backend, runner.pool, inputs)[:1]
        outputs.append((logits, runner.pool.k_buffers[1][slots], runner.pool.v_buffers[1][slots]))
    for eager, graphed in zip(*outputs):
        torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)


def test_token_buckets_end_at_the_largest_step():
    assert token_buckets(2048) == [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert token_buckets(300) == [16, 32, 64, 128, 192, 256, 300]


def test_negative_prefill_graph_size_is_refused():
    with pytest.raises(ArgumentError, match="prefill_cuda_graph_max_tokens"):
        ServerArgs(prefill_cuda_graph_max_tokens=-1)
