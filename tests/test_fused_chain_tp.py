"""The fused chain of K drafts (EAGLE3, --speculative-num-steps 3) with tensor parallelism on
the CPU (gloo, 2 ranks): rank 0 runs the fused steps (eagerly here: no graphs on a CPU), the
worker runs the broadcast target forwards, and greedy output equals tp=1 plain decoding with
every step fused (tests/test_tp_drafters.py compares the drafts with tp=1's)."""
from __future__ import annotations

from tests.fused_fixtures import FusedSpy, fused_args, save_random_eagle_head, wait_until_fused_state_is_free
from tests.spec_fixtures import tiny_engine
from tests.test_tensor_parallel import no_worker_outlives_the_tests  # noqa: F401  (autouse fixture)
from tests.test_tp_drafters import GREEDY, PROMPTS, plain_outputs, target  # noqa: F401  (fixtures)


def test_fused_chain_steps_run_with_two_ranks(target, plain_outputs, tmp_path):  # noqa: F811
    save_random_eagle_head(target, tmp_path / "head", "EAGLE3")
    args = fused_args("EAGLE3", tmp_path / "head", speculative_num_steps=3)
    with tiny_engine(target, tp_size=2, **args) as engine:
        assert engine.core.drafter.fused.nodes == 4
        spy = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        wait_until_fused_state_is_free(engine)
    assert [o["output_ids"] for o in outputs] == plain_outputs
    assert spy.fused > 0 and spy.engine == 0
