"""Prefill CUDA graphs on a GPU: greedy output equals the eager prefill's for whole prompts,
chunked prompts (later chunks over a cached prefix), and a prompt mix whose steps hold
more requests than a graph (those run eagerly); every KV slot
comes back, and the graphs were replayed."""
from __future__ import annotations

import random

import pytest

from tests.spec_fixtures import make_tiny_directory, tiny_engine, wait_until_all_kv_is_free

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-cuda-prefill-graph")
    make_tiny_directory(path, "qwen2", seed=5)
    return path


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.choice([1, 7, 40, 150, 400]))] for _ in range(count)]


@pytest.mark.parametrize("chunked_prefill_size,count", [(2048, 6), (64, 6), (2048, 80)])
def test_graphed_prefill_equals_eager_prefill(model_dir, chunked_prefill_size, count):
    batch = prompts(count, seed=count + chunked_prefill_size)
    common = dict(device="cuda", max_total_tokens=60000, chunked_prefill_size=chunked_prefill_size)
    with tiny_engine(model_dir, prefill_cuda_graph_max_tokens=0, **common) as eager:
        assert eager.core.runner.prefill_graphs is None
        expected = [o["output_ids"] for o in eager.generate(input_ids=batch, sampling_params=GREEDY)]
    with tiny_engine(model_dir, **common) as engine:   # graphs up to the chunk size
        graphs = engine.core.runner.prefill_graphs
        replays = {"n": 0}
        original = graphs.run

        def counted(*args, **kwargs):
            replays["n"] += 1
            return original(*args, **kwargs)
        graphs.run = counted
        outputs = [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=GREEDY)]
        assert outputs == expected
        assert replays["n"] > 0
        wait_until_all_kv_is_free(engine)


def test_graphed_prefill_hands_an_eagle_drafter_the_eager_states(tmp_path):
    """An EAGLE-3 drafter's prefill steps replay the graphs too: the hidden states the
    drafter is handed (every prompt token's, in order) equal the eager prefill's (fp32)."""
    import torch

    from tests.test_eagle_drafter import write_random_eagle3_head
    target_path, head_path = write_random_eagle3_head(tmp_path)
    batch = [p[:300] for p in prompts(12, seed=3) if len(p) > 1]
    handed: dict[str, dict[tuple[int, ...], list[torch.Tensor]]] = {}
    for kind, extra in (("eager", {"prefill_cuda_graph_max_tokens": 0}), ("graphs", {})):
        with tiny_engine(target_path, device="cuda", max_total_tokens=60000, speculative_algorithm="EAGLE3",
                         speculative_draft_model_path=head_path, **extra) as engine:
            graphs = engine.core.runner.prefill_graphs
            assert (graphs is not None) == (kind == "graphs")
            drafter, kept = engine.core.drafter, handed.setdefault(kind, {})
            observe = drafter.observe_hidden

            def spy(reqs, starts, states, rows, **kwargs):
                for req, start, part in zip(reqs, starts, rows):
                    if start < len(req.prompt_ids):   # a prefill's rows (a plain step's come after the prompt)
                        kept.setdefault(tuple(req.prompt_ids), []).append(states[part[0]:part[-1] + 1].float().cpu())
                return observe(reqs, starts, states, rows, **kwargs)
            drafter.observe_hidden = spy
            engine.generate(input_ids=batch, sampling_params=GREEDY)
            wait_until_all_kv_is_free(engine)
    assert handed["eager"].keys() == handed["graphs"].keys() == {tuple(p) for p in batch}
    for prompt, eager in handed["eager"].items():
        torch.testing.assert_close(torch.cat(handed["graphs"][prompt]), torch.cat(eager), rtol=1e-4, atol=1e-4)
