"""The lean decode launch on a GPU (cuda_graph.launch_decode): plain greedy decoding on the
overlap schedule through graphs that hold the argmax and write each step's KV-table entry
equals eager decoding, while requests end at different steps (the batch shrinks, crosses
buckets, and steps launched ahead are dropped), batches larger than the graphs fall back to
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
