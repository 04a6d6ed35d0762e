"""Tensor parallelism on the CPU (gloo, 2 ranks, tiny random models): the sharded forward gives
tp=1's logits in every mode, the engine's greedy output equals tp=1's with and without NGRAM,
heads that do not split are refused before any process starts, and a rank that dies fails
the engine's requests within seconds. Every worker process is reaped (checked at the end)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
import transformers

from model_fixtures import TINY, RunnerDriver
from spec_fixtures import make_tiny_directory, ngram_args, save_bpe_tokenizer, tiny_engine
from lab.check_identity import compare
from specserve.errors import ArgumentError, EngineFatalError
from specserve.model.config import ModelConfig
from specserve.model.loader import load_checkpoint
from specserve.model.parallel.sharding import ModelShard
from specserve.runner.model_runner import ModelRunner
from specserve.runner.ranks.launcher import start_tensor_parallel

GREEDY = {"temperature": 0, "max_new_tokens": 40}
PROMPTS = [[5, 9, 13, 40, 2, 77], [7, 7, 8, 100, 3, 200, 7, 7, 8], [30, 31, 32, 33, 30, 31, 32]]


def tp_children() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("specserve-tp-rank")]


@pytest.fixture(scope="module", autouse=True)
def no_worker_outlives_the_tests():
    yield
    leaked = tp_children()
    for process in leaked:
        process.kill()
        process.join(5)
    assert not leaked, f"tensor-parallel workers left running: {leaked}"


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory):
    """Qwen2 (qkv bias), 4 heads and 2 KV heads (one each at tp=2), an odd vocabulary (a padded
    row in the second lm_head shard)."""
    path = tmp_path_factory.mktemp("tp-qwen2")
    make_tiny_directory(path, "qwen2", vocab_size=255)
    return str(path)


@pytest.fixture(scope="module")
def plain_outputs(qwen2_path):
    with tiny_engine(qwen2_path) as engine:
        return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


# ---- the split ----
def test_kv_heads_are_replicated_to_the_ranks_whose_queries_read_them():
    config = ModelConfig.from_hf(transformers.LlamaConfig(**{**TINY, "num_attention_heads": 8,
                                                            "num_key_value_heads": 2}))
    shards = [ModelShard.for_rank(config, rank, 4) for rank in range(4)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in shards] == [(2, 1, 0), (2, 1, 0), (2, 1, 1),
                                                                                (2, 1, 1)]
    group = config.num_heads // config.num_kv_heads   # query heads per KV head
    for s in shards:
        assert {(s.rank * s.num_heads + h) // group for h in range(s.num_heads)} == {s.kv_head_start}
    assert [s.vocab_start for s in shards] == [0, 25, 50, 75] and shards[-1].vocab_per_rank == 25  # 97 -> 100


def test_heads_that_do_not_split_are_refused_before_any_process_starts(qwen2_path):
    with pytest.raises(ArgumentError, match=r"tp_size=3 must divide the model's 4 attention heads"):
        tiny_engine(qwen2_path, tp_size=3)
    config = ModelConfig.from_hf(transformers.LlamaConfig(**{**TINY, "hidden_size": 96, "num_attention_heads": 6,
                                                            "num_key_value_heads": 3}))
    with pytest.raises(ArgumentError, match=r"tp_size=2 and the model's 3 KV heads"):
        ModelShard.for_rank(config, 0, 2)
    assert not tp_children()


def test_identity_report_names_each_divergence():
    report = compare([[1, 2, 3], [4, 5, 6, 7]], [[1, 2, 3], [4, 9, 6]])
    assert report["requests_identical"] == 0.5 and report["tokens_before_divergence"] == 4 / 7
    assert report["divergences"] == [{"request": 1, "first_difference": 1, "lengths": [4, 3]}]
    assert compare([[1, 2]], [[1, 2, 3]])["divergences"][0]["first_difference"] == 2


# ---- the forward ----
def test_sharded_forward_gives_tp1_logits_in_every_mode(tmp_path):
    """Llama with tied embeddings, llama3 rope and one KV head (replicated on both ranks)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 1}, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.5)
    model.save_pretrained(tmp_path)
    save_bpe_tokenizer(str(tmp_path))
    whole = RunnerDriver.from_hf(model)
    args = whole.runner.args.replace(tp_size=2)
    group = start_tensor_parallel(args, str(tmp_path), torch.device("cpu"), torch.float32, 256)
    try:
        shard = load_checkpoint(str(tmp_path), torch.float32, tp_rank=0, tp_size=2)
        sharded = RunnerDriver.from_hf(model)   # then pointed at rank 0's runner of the group
        sharded.runner = ModelRunner(args, shard.config, shard.state_dict, torch.device("cpu"), torch.float32, 256,
                                     tp=group)
        sharded.req.row = sharded.runner.pool.alloc_row()
        assert sharded.runner.pool.k_buffers[0].shape[1] == 1 and sharded.runner.model.model.shard.vocab_per_rank == 49
        for driver_step in (lambda d: d.prefill([3, 14, 15, 92, 65, 35]), lambda d: d.decode(8),
                            lambda d: d.verify_tree([9, 7, 9, 3, 2], [-1, 0, 0, 1, 3], commit_path=[0, 1, 3]),
                            lambda d: d.decode(4)):
            expected, got = driver_step(whole), driver_step(sharded)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    finally:
        group.shutdown()
    assert not tp_children()


# ---- the engine ----
def test_greedy_output_equals_tp1_without_speculation(qwen2_path, plain_outputs):
    with tiny_engine(qwen2_path, tp_size=2) as engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == plain_outputs
        workers = [handle.process for handle in engine.core.runner.tp.workers.handles]
    assert all(not process.is_alive() and process.exitcode == 0 for process in workers)   # stopped, not killed


def test_greedy_output_equals_tp1_with_ngram(qwen2_path, plain_outputs):
    with tiny_engine(qwen2_path, tp_size=2, **ngram_args(6)) as engine:
        first = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        # the same prompts again: the trie holds the outputs now, so whole drafts are verified and accepted
        again = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again] == plain_outputs
    accepted = [length for o in again for length in o["meta_info"]["spec_accept_histogram"] if length > 1]
    assert accepted, "no verify step accepted a draft token: the trees were not exercised"


def test_a_killed_worker_fails_the_engine_within_seconds(qwen2_path):
    engine = tiny_engine(qwen2_path, tp_size=2)
    try:
        worker = engine.core.runner.tp.workers.handles[0].process
        stream = engine.generate(input_ids=PROMPTS[0], stream=True, sampling_params={
            "temperature": 0, "max_new_tokens": 100_000, "ignore_eos": True})
        next(stream)
        os.kill(worker.pid, signal.SIGKILL)
        errors: list[BaseException] = []

        def drain() -> None:
            try:
                for _ in stream:
                    pass
            except Exception as error:   # the request's failure, raised to its caller
                errors.append(error)

        consumer, start = threading.Thread(target=drain, daemon=True), time.monotonic()
        consumer.start()
        consumer.join(timeout=15)
        assert not consumer.is_alive(), "the request hung after its tensor-parallel worker died"
        assert time.monotonic() - start < 10
        assert errors and f"tensor-parallel rank 1 (pid {worker.pid}) was killed by SIGKILL" in str(errors[0])
        with pytest.raises(EngineFatalError, match="the engine stopped: tensor-parallel rank 1"):   # and later ones at once
            engine.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 3})
    finally:
        engine.shutdown()
    assert not tp_children()
