"""KV capacity: the tokens that fit are logged and reported (max_total_num_tokens, SGLang's
name), the loaded weights' state dict is let go before the pool is sized from the memory
left, and many long requests that overflow the pool are preempted and queued, not failed."""
from __future__ import annotations

import logging
import random
import time

import pytest
import torch

from specserve.args import ServerArgs
from specserve.bench.random_model import SHAPES, write_model_config
from specserve.runner.model_runner import ModelRunner
from tests.spec_fixtures import tiny_engine
from tests.test_kv_accounting import run_in_thread

TINY_QWEN = dict(SHAPES["qwen2.5-7b"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=4096, max_position_embeddings=1024,
                 tie_word_embeddings=False)
POOL_TOKENS = 256
PROMPT_TOKENS, OUTPUT_TOKENS, NUM_REQUESTS = 24, 40, 16    # 16 x 64 tokens: 4x the pool
GREEDY = {"temperature": 0, "max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_config(str(tmp_path_factory.mktemp("tiny-qwen")), TINY_QWEN)


def test_long_prompts_in_chunks_that_overflow_the_pool_all_finish(model_dir):
    """8 prompts of 150-240 tokens prefilled in chunks of 32 tokens beside each other, in a
    pool that holds one or two of them (at scale: 64 requests of 32k tokens): prompts partway
    through their prefills never fill the pool together, the ones that run out of room are
    preempted, and every answer is its answer alone."""
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 4000) for _ in range(rng.randrange(150, 240))] for _ in range(8)]
    params = {**GREEDY, "max_new_tokens": 12}
    with tiny_engine(model_dir, load_format="dummy", max_total_tokens=POOL_TOKENS, chunked_prefill_size=32) as engine:
        alone = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
        together = run_in_thread(lambda: engine.generate(input_ids=prompts, sampling_params=params))()
        assert [o["output_ids"] for o in together] == alone
        assert_every_slot_and_row_free(engine)


def test_requests_that_overflow_the_pool_are_preempted_and_all_finish(model_dir, caplog):
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 4000) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_REQUESTS)]
    assert NUM_REQUESTS * (PROMPT_TOKENS + OUTPUT_TOKENS) == 4 * POOL_TOKENS
    with caplog.at_level(logging.INFO, logger="specserve"), \
            tiny_engine(model_dir, load_format="dummy", max_total_tokens=POOL_TOKENS, log_level="info") as engine:
        info = engine.get_server_info()
        assert info["max_total_num_tokens"] == engine.core.runner.pool.size == POOL_TOKENS
        assert f"KV cache: {POOL_TOKENS} tokens (max_total_num_tokens" in caplog.text
        alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
        together = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert sum(o["meta_info"]["preemptions"] for o in together) > 0   # the pool overflowed
        assert [o["output_ids"] for o in together] == alone
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in together)
        assert_every_slot_and_row_free(engine)


def assert_every_slot_and_row_free(engine, timeout: float = 30.0) -> None:
    pool, scheduler = engine.core.runner.pool, engine.core.scheduler
    deadline = time.monotonic() + timeout
    while engine.core.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.core.has_work() and not engine.core.requests
    scheduler.check_kv()                         # each slot free, cached or held once
    assert scheduler.available_slots() == pool.size
    assert pool.free_rows() == pool.max_requests


def test_the_loaded_weights_are_let_go_before_the_pool_is_sized(monkeypatch, model_dir):
    """On a GPU the pool takes the memory left after the weights: a state dict still alive
    there would be a second copy of the weights counted against it."""
    from specserve.model.loader import load_checkpoint
    from specserve.bench.random_model import write_random_model
    path = write_random_model(model_dir + "-weights", TINY_QWEN, dtype=torch.float32, device="cpu")
    checkpoint = load_checkpoint(path, torch.float32)
    tensors_alive_when_sized = []
    sized = ModelRunner._kv_tokens_here

    def record(runner, num_kv_heads):
        tensors_alive_when_sized.append(len(checkpoint.state_dict))
        return sized(runner, num_kv_heads)

    monkeypatch.setattr(ModelRunner, "_kv_tokens_here", record)
    args = ServerArgs(max_total_tokens=64, max_running_requests=2)
    runner = ModelRunner(args, checkpoint.config, checkpoint.state_dict, torch.device("cpu"), torch.float32, 128)
    assert tensors_alive_when_sized == [0] and runner.pool.size == 64
    assert runner.model.lm_head.weight.abs().sum() > 0   # the weights went into the model first
