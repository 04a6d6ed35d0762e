"""Greedy generation equals transformers' `generate`, and is batch invariant: alone, in a
batch of mixed lengths, under chunked prefill and under preemption (fp32, CPU)."""
from __future__ import annotations

import pytest
import torch

from specserve.bench.prompts import SAMPLE_PROMPTS

PROMPTS = SAMPLE_PROMPTS
GREEDY = {"temperature": 0, "max_new_tokens": 64}


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=list(eos_ids), pad_token_id=eos_ids[0])[0, len(prompt_ids):].tolist()
    for i, token in enumerate(out):
        if token in eos_ids:
            return out[:i + 1]
    return out


@pytest.fixture(scope="module")
def prompt_ids(smollm2_engine):
    return [smollm2_engine.tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def solo_outputs(smollm2_engine, prompt_ids):
    return [smollm2_engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] for ids in prompt_ids]


def test_greedy_equals_transformers_generate(smollm2_engine, smollm2_hf, prompt_ids, solo_outputs):
    eos = smollm2_engine.core.runner.config.eos_token_ids
    for ids, ours in list(zip(prompt_ids, solo_outputs))[:5]:
        assert ours == hf_greedy(smollm2_hf, ids, 64, eos)


def test_batch_of_mixed_lengths_equals_solo(smollm2_engine, prompt_ids, solo_outputs):
    outs = smollm2_engine.generate(input_ids=prompt_ids, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == solo_outputs


def test_chunked_prefill_and_preemption_keep_outputs(smollm2_path, prompt_ids, solo_outputs):
    from specserve.engine.engine import Engine
    # 5-token chunks split every prompt; 260 cache tokens cannot hold 8 requests of ~80 tokens
    with Engine(model_path=smollm2_path, dtype="float32", max_total_tokens=260, chunked_prefill_size=5,
                log_level="warning") as engine:
        outs = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == solo_outputs
        assert sum(o["meta_info"]["preemptions"] for o in outs) > 0
        assert engine.core.scheduler.available_slots() == engine.core.runner.pool.size
        engine.core.scheduler.check_kv()
