"""Constrained greedy decoding on a GPU's overlap schedule (engine/overlap.py): a step is launched
on the previous step's unmasked argmax, and where a grammar forbids a request's token its
masked pick is read from the kept logits on a side stream (runner/side_stream.py) while the step
launched ahead runs on. A random model strays from its grammar at almost every token, so the
cut-and-relaunch path runs at nearly every step; the outputs equal the path that masks every
step's logits before its argmax (no overlap schedule), requests without a grammar beside them
are untouched, and every KV slot comes back."""
from __future__ import annotations

import json

import pytest

from tests.spec_fixtures import make_tiny_directory, tiny_engine, wait_until_all_kv_is_free
from tests.test_step_kv_writes import PROMPTS

GREEDY = {"temperature": 0}
PARAMS = [dict(GREEDY, max_new_tokens=40, regex=r"[a-e]{3,9}-[0-9]{2,4}-(ok|no)[f-k]{2,6}"),
          dict(GREEDY, max_new_tokens=30, ignore_eos=True),
          dict(GREEDY, max_new_tokens=40, ebnf='root ::= "<" ("ab" | "cd")+ ">" [0-9] [0-9] "!"'),
          dict(GREEDY, max_new_tokens=48, json_schema=json.dumps(
              {"type": "object", "properties": {"ok": {"type": "array", "items": {"type": "boolean"},
                                                       "minItems": 2, "maxItems": 4}},
               "required": ["ok"]})),
          dict(GREEDY, max_new_tokens=17, ignore_eos=True)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-cuda-grammar-overlap")
    make_tiny_directory(path, "llama", seed=5)
    return path


def test_constrained_steps_on_the_overlap_schedule_equal_masked_steps_on_cuda(model_dir):
    with tiny_engine(model_dir, device="cuda", disable_overlap_schedule=True, max_total_tokens=4096) as masked:
        expected = [o["output_ids"] for o in masked.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
    with tiny_engine(model_dir, device="cuda", cuda_graph_max_bs=8, max_total_tokens=4096) as engine:
        schedule = engine.core.overlap
        assert schedule is not None
        for _ in range(2):
            got = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
            assert [o["output_ids"] for o in got] == expected
        alone = engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS[0])   # every stray cuts the only row
        assert alone["output_ids"] == expected[0]
        assert schedule.relaunches >= 20
        wait_until_all_kv_is_free(engine)
