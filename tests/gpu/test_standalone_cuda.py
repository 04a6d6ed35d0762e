"""STANDALONE on a GPU (fp32): the draft chain replayed from its CUDA graphs drafts what the
eager chain drafts, greedy output equals plain decoding through the graphs and through the
eager path (batches larger than the graphs), sampled drafts (with q) run through their own
graphs, and every target and draft KV slot comes back."""
from __future__ import annotations

import pytest
import torch

from tests.spec_fixtures import make_tiny_directory, tiny_engine, wait_until_all_kv_is_free
from tests.standalone_fixtures import make_noisy_draft, standalone_args, wait_until_draft_kv_is_free
from tests.test_step_kv_writes import PROMPTS

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-cuda-standalone")
    make_tiny_directory(path, "llama", seed=3)
    return path


@pytest.fixture(scope="module")
def noisy_draft(target_dir, tmp_path_factory):
    return make_noisy_draft(target_dir, tmp_path_factory.mktemp("tiny-cuda-standalone-draft"), sigma=0.02)


@pytest.fixture(scope="module")
def expected(target_dir) -> list[list[int]]:
    with tiny_engine(target_dir, device="cuda", disable_cuda_graph=True, max_total_tokens=4096) as plain:
        return [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.mark.parametrize("graph_max_bs", [8, 2])     # 2: the batches of 5 run eagerly
@pytest.mark.parametrize("num_steps", [1, 4])
def test_greedy_standalone_equals_plain_on_cuda(target_dir, noisy_draft, expected, graph_max_bs, num_steps):
    with tiny_engine(target_dir, device="cuda", cuda_graph_max_bs=graph_max_bs, max_total_tokens=4096,
                     **standalone_args(noisy_draft, num_steps)) as engine:
        assert engine.core.drafter.runner.graphs is not None
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == expected
        lengths = {n for o in outputs for n in o["meta_info"]["spec_accept_histogram"]}
        assert 1 in lengths and num_steps + 1 in lengths
        wait_until_draft_kv_is_free(engine)
        wait_until_all_kv_is_free(engine)


def test_the_target_as_its_own_draft_accepts_every_draft_on_cuda(target_dir, expected):
    with tiny_engine(target_dir, device="cuda", max_total_tokens=4096, **standalone_args(target_dir, 3)) as engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == expected
        assert all(o["meta_info"]["spec_accept_histogram"] == {4: 9, 3: 1} for o in outputs)
        wait_until_draft_kv_is_free(engine)


@pytest.mark.parametrize("sample", [False, True])
def test_graph_chain_drafts_what_the_eager_chain_drafts(target_dir, noisy_draft, sample):
    """The same chain inputs through a graph replay and through run_chain eagerly."""
    from specserve.speculative.model_drafters.draft_chain import ChainRow
    with tiny_engine(target_dir, device="cuda", max_total_tokens=4096, **standalone_args(noisy_draft, 4)) as engine:
        engine.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY)   # the draft caches fill and go
        drafter = engine.core.drafter
        runner, pool = drafter.runner, drafter.runner.pool
        # three requests' draft caches written by hand: one catch-up of their prompts
        slots = pool.slots.alloc(sum(len(p) for p in PROMPTS[:3]) + 3 * 4)
        rows, starts, offset = [], [], 0
        for row, prompt in enumerate(PROMPTS[:3]):
            pool.write_positions(row, 0, torch.tensor(slots[offset:offset + len(prompt) + 4], device="cuda"))
            rows.append(ChainRow(tokens=prompt[-2:], slots=slots[offset + len(prompt) - 2:offset + len(prompt) + 3],
                                 req_row=row, prefix_len=len(prompt) - 2, seed=row, temperature=0.9 if sample else 0.0))
            starts.append(offset)
            offset += len(prompt) + 4
        runner.catch_up([0, 1, 2], [0, 0, 0], [p[:-2] for p in PROMPTS[:3]],
                        [s for start, p in zip(starts, PROMPTS[:3]) for s in slots[start:start + len(p) - 2]])
        graph_drafts, graph_probs = runner.chain(rows, sample)
        graph_drafts, graph_probs = graph_drafts.clone(), graph_probs.clone() if sample else None
        graphs, runner.graphs = runner.graphs, None
        eager_drafts, eager_probs = runner.chain(rows, sample)
        runner.graphs = graphs
        assert torch.equal(graph_drafts, eager_drafts)
        if sample:
            torch.testing.assert_close(graph_probs, eager_probs, atol=1e-5, rtol=1e-4)
            assert torch.allclose(graph_probs[:, :4].sum(-1), torch.ones(3, 4, device="cuda"))
            assert not graph_probs[:, 4].any()
        pool.slots.free(slots)


def test_sampled_drafts_run_and_free_everything_on_cuda(target_dir, noisy_draft):
    with tiny_engine(target_dir, device="cuda", max_total_tokens=4096, **standalone_args(noisy_draft, 4)) as engine:
        params = [{"temperature": 1.0, "max_new_tokens": 30, "ignore_eos": True},
                  {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 30, "ignore_eos": True, "seed": 4},
                  GREEDY]
        outputs = engine.generate(input_ids=PROMPTS[:3], sampling_params=params)
        assert [len(o["output_ids"]) for o in outputs] == [30, 30, 40]
        wait_until_draft_kv_is_free(engine)
        wait_until_all_kv_is_free(engine)
