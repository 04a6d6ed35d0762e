"""bench.model_drafters' modes: `held`, the adaptive EAGLE engine made to decode plainly while
its head is still fed the target's features, decodes as plain does and never proposes."""
from __future__ import annotations

from specserve.bench.model_drafters import set_mode
from tests.fused_fixtures import fused_args
from tests.spec_fixtures import plain_greedy_outputs, tiny_engine
from tests.test_eagle_drafter import target  # noqa: F401
from tests.test_eagle_drafter_tree import random_head  # noqa: F401
from tests.test_probe_sample import GREEDY, varied_prompts


def test_held_mode_feeds_the_head_and_never_proposes(target, random_head):  # noqa: F811
    path, _, _, _ = target
    _, head_path, _, _ = random_head
    prompts = varied_prompts(6)
    with tiny_engine(path, max_running_requests=6, **fused_args("EAGLE3", head_path, adaptive=True,
                                                                  speculative_num_steps=3)) as engine:
        drafter = engine.core.drafter
        calls = {"propose": 0, "observe_hidden": 0}
        for name in calls:
            def counted(*args, _name=name, _original=getattr(drafter, name), **kwargs):
                calls[_name] += 1
                return _original(*args, **kwargs)
            setattr(drafter, name, counted)
        set_mode(engine, drafter, "held")
        outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert calls["propose"] == 0 and calls["observe_hidden"] >= GREEDY["max_new_tokens"]   # a call a step
        set_mode(engine, drafter, "adaptive")   # the same engine drafts or probes again
        engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert calls["propose"] > 0
    assert [o["output_ids"] for o in outputs] == plain_greedy_outputs(path, prompts, GREEDY)
