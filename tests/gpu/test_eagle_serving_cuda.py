"""An EAGLE head's serving form on a GPU (fused RMSNorm, RoPE + KV write in one kernel, the
one-row GEMVs) against its training form, each through its own Triton attention backend and
KV pool: a prompt's rows, then one row (a chain step at batch 1). CUDA only; the CPU suite
ignores this folder."""
from __future__ import annotations

import pytest
import torch

from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.attention.registry import create_attention_backend
from specserve.kv.pool import KVPool
from specserve.model.rope import RotaryEmbedding
from specserve.speculative.heads.eagle_config import EagleHeadConfig
from specserve.speculative.heads.eagle_head import EagleHead
from specserve.speculative.heads.eagle_serving import ServingEagleHead

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 300, 256, 4, 2, 64


def cuda_head(dtype: torch.dtype) -> EagleHead:
    config = EagleHeadConfig(hidden_size=HIDDEN, intermediate_size=512, num_heads=HEADS, num_kv_heads=KV_HEADS,
                             head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                             max_position_embeddings=128, vocab_size=VOCAB, draft_vocab_size=200,
                             target_hidden_size=HIDDEN, aux_layers=(0, 1, 2))
    torch.manual_seed(0)
    head = EagleHead(config, 128)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    head.set_draft_vocab(torch.arange(200))
    head.share_embedding(torch.randn(VOCAB, HIDDEN))
    head = head.to("cuda", dtype).eval().requires_grad_(False)
    # fp32 tables, as load_eagle_head makes them (Module.to(dtype) cast the head's to `dtype`)
    head.rope = RotaryEmbedding(HEAD_DIM, 128, 10000.0, None).to("cuda")
    return head


def extend_batch(pool: KVPool, tokens: torch.Tensor, start: int) -> ForwardBatch:
    """Request row 0's tokens at positions start.. (slot = position + 1), after `start` cached ones."""
    n = tokens.numel()
    positions = torch.arange(start, start + n, device="cuda")
    pool.write_positions(0, start, (positions + 1).to(torch.int32))
    return ForwardBatch(mode=ForwardMode.EXTEND, input_ids=tokens, positions=positions, out_slots=positions + 1,
                        req_rows=torch.tensor([0], device="cuda"), prefix_lens=torch.tensor([start], device="cuda"),
                        extend_lens=torch.tensor([n], device="cuda"), prefix_lens_host=[start], extend_lens_host=[n],
                        kv_pool=pool, logits_indices=torch.arange(n, device="cuda"))


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_serving_form_equals_the_training_form_on_cuda(dtype, tolerance):
    head = cuda_head(dtype)
    pools = [KVPool(1, KV_HEADS, HEAD_DIM, 64, 2, 64, dtype, torch.device("cuda")) for _ in range(2)]
    backends = [create_attention_backend("triton", HEADS, KV_HEADS, HEAD_DIM) for _ in range(2)]
    states = torch.randn(9, head.config.feature_size, device="cuda", dtype=dtype)
    tokens = torch.randint(0, VOCAB, (9,), device="cuda")
    with torch.inference_mode():
        training, serving = head, ServingEagleHead(head)
        for start, stop in ((0, 8), (8, 9)):     # a prompt's rows, then one row: the GEMV path
            features = head.project(states[start:stop])
            batches = [extend_batch(pool, tokens[start:stop], start) for pool in pools]
            for backend, batch in zip(backends, batches):
                backend.plan(batch)
            attend = lambda q, k, v: backends[0].forward(q, k, v, 0, batches[0])  # noqa: E731
            expected = training.step(tokens[start:stop], features, batches[0].positions, attend)
            got = serving.step(batches[1], backends[1], features)
            torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(serving.logits(got), training.logits(expected), rtol=tolerance,
                                       atol=tolerance * 10)
        # both forms wrote the same keys and values for every row
        torch.testing.assert_close(pools[1].k_buffers[0][1:10], pools[0].k_buffers[0][1:10], rtol=tolerance,
                                   atol=tolerance)
