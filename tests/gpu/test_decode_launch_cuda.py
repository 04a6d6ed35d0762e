"""The lean decode launch on a GPU (cuda_graph.launch_decode): plain greedy decoding (and seeded
sampling, sampled on the device) on the overlap schedule through graphs that hold the argmax and write each step's KV-table entry
equals eager decoding, while requests end at different steps (the batch shrinks, crosses
buckets; the step launched ahead leaves out a request its length ends and has the row of one
a stop token ended cut), batches larger than the graphs fall back to
the eager launch, and every KV slot comes back."""
from __future__ import annotations

import pytest

from tests.spec_fixtures import make_tiny_directory, tiny_engine, wait_until_all_kv_is_free
from tests.test_step_kv_writes import PROMPTS

LENGTHS = (40, 7, 23, 1, 31)   # requests end at different steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-cuda-decode-launch")
    make_tiny_directory(path, "llama", seed=4)
    return path


def params():
    return [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in LENGTHS]


@pytest.mark.parametrize("graph_max_bs", [8, 2])     # 2: batches of 3-5 launch eagerly
def test_graphed_plain_decoding_equals_eager_on_cuda(model_dir, graph_max_bs):
    with tiny_engine(model_dir, device="cuda", disable_cuda_graph=True, max_total_tokens=4096) as eager:
        expected = [o["output_ids"] for o in eager.generate(input_ids=PROMPTS, sampling_params=params())]
    with tiny_engine(model_dir, device="cuda", cuda_graph_max_bs=graph_max_bs, max_total_tokens=4096) as engine:
        graphs, launches = engine.core.runner.graphs, []
        launch = graphs.launch_decode
        graphs.launch_decode = lambda *args: launches.append(len(args[0])) or launch(*args)
        for _ in range(2):
            outputs = engine.generate(input_ids=PROMPTS, sampling_params=params())
            assert [o["output_ids"] for o in outputs] == expected
        one_by_one = [engine.generate(input_ids=p, sampling_params=q)["output_ids"] for p, q in zip(PROMPTS, params())]
        assert one_by_one == expected
        assert engine.core.overlap is not None and len(launches) > 40 and max(launches) <= graph_max_bs
        wait_until_all_kv_is_free(engine)


FILTERS = ({"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.1}, {}, {"top_p": 0.8, "min_p": 0.05})


def test_graphed_sampled_decoding_on_the_overlap_schedule_equals_eager_on_cuda(model_dir, monkeypatch):
    """Seeded sampling: each step's tokens sampled on the device from the graph's logits (the
    overlap schedule's sampled steps, engine/overlap.py), through the sampling graphs of each set
    of filters (sampling/plain_graphs.py), are the eager engine's sampler's, in a batch and alone."""
    sampled = [{"temperature": 0.8, "seed": 11 + i, "max_new_tokens": n, "ignore_eos": True, **filters}
               for i, (n, filters) in enumerate(zip(LENGTHS, FILTERS))]
    with tiny_engine(model_dir, device="cuda", disable_cuda_graph=True, max_total_tokens=4096) as eager:
        expected = [o["output_ids"] for o in eager.generate(input_ids=PROMPTS, sampling_params=sampled)]
        alone = [eager.generate(input_ids=p, sampling_params=q)["output_ids"] for p, q in zip(PROMPTS, sampled)]
    monkeypatch.setenv("SPECSERVE_SAMPLING_GRAPHS", "1")   # the default (engine/builder.py), whatever the environment says
    with tiny_engine(model_dir, device="cuda", cuda_graph_max_bs=8, max_total_tokens=4096) as engine:
        graphs, launches = engine.core.runner.graphs, []
        # the warm-up captured every bucket's graph for each set of filters: serving captures none
        captured = set(engine.core.sampler.plain_graphs.graphs)
        assert len(captured) == 4 * len(graphs.decode_logits())
        launch = graphs.launch_decode
        graphs.launch_decode = lambda *args: launches.append(len(args[0])) or launch(*args)
        for _ in range(2):   # the second pass replays the graphs the first captured
            assert [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=sampled)] == expected
        assert [engine.generate(input_ids=p, sampling_params=q)["output_ids"]
                for p, q in zip(PROMPTS, sampled)] == alone
        assert len(launches) > 30
        assert set(engine.core.sampler.plain_graphs.graphs) == captured
        wait_until_all_kv_is_free(engine)


def test_a_graphed_step_ahead_of_a_prefill_is_kept_on_cuda(model_dir):
    """Requests that arrive while another decodes on the overlap schedule: the step launched
    ahead is read after their prefill (OverlapSchedule.keep_through), its argmax through the
    bucket's pinned buffer it was copied to, while no other decode step of the bucket ran."""
    long = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    short = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with tiny_engine(model_dir, device="cuda", disable_cuda_graph=True, max_total_tokens=4096) as eager:
        expected_long = eager.generate(input_ids=PROMPTS[0], sampling_params=long)["output_ids"]
        expected_short = [eager.generate(input_ids=p, sampling_params=short)["output_ids"] for p in PROMPTS[1:4]]
    with tiny_engine(model_dir, device="cuda", cuda_graph_max_bs=8, max_total_tokens=4096) as engine:
        schedule, kept = engine.core.overlap, []
        keep_through = schedule.keep_through
        schedule.keep_through = lambda batch: kept.append(keep_through(batch)) or kept[-1]
        chunks = iter(engine.generate(input_ids=PROMPTS[0], sampling_params=long, stream=True))
        streamed = []
        while len(streamed) < 6:
            streamed += next(chunks)["output_ids"]
        got = [engine.generate(input_ids=p, sampling_params=short)["output_ids"] for p in PROMPTS[1:4]]
        for chunk in chunks:
            streamed += chunk["output_ids"]
        assert streamed == expected_long and got == expected_short
        assert sum(step is not None for step in kept) >= 2
        wait_until_all_kv_is_free(engine)


def test_a_stop_token_end_cuts_its_row_from_the_graphed_step_ahead(model_dir):
    """A request a stop token ends (seen only once its step is read) has a row in the step
    launched ahead; that row is cut and the others' tokens, gathered on the device as the next
    roots, go on: the same outputs as eager decoding, every step after the first read ahead."""
    long = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    with tiny_engine(model_dir, device="cuda", disable_cuda_graph=True, max_total_tokens=4096) as eager:
        free_run = eager.generate(input_ids=PROMPTS[1], sampling_params=long)["output_ids"]
        stop = next(t for i, t in enumerate(free_run) if i >= 3 and t not in free_run[:i])   # ends it there
        stopped = dict(long, ignore_eos=False, stop_token_ids=[stop])
        batch = [long, stopped, dict(long, max_new_tokens=12), long]
        expected = [o["output_ids"] for o in eager.generate(input_ids=PROMPTS[:4], sampling_params=batch)]
    assert len(expected[1]) < 30
    with tiny_engine(model_dir, device="cuda", cuda_graph_max_bs=8, max_total_tokens=4096) as engine:
        schedule, reads = engine.core.overlap, []
        current_step = schedule.current_step

        def counting_current_step(reqs, last_tokens):
            ahead = schedule.ahead
            step = current_step(reqs, last_tokens)
            reads.append(step is ahead)
            return step
        schedule.current_step = counting_current_step
        got = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS[:4], sampling_params=batch)]
        assert got == expected
        assert len(reads) == 29 and sum(reads) == 28, reads
        wait_until_all_kv_is_free(engine)
