"""Which requests a probe of the adaptive policy proposes for, where it samples part of the
batch (more requests than PROBE_REQUESTS): a model drafter's proposals (an EAGLE head's, a
draft model's) first feed every row a request's draft cache lacks, so the probe takes the
requests with the fewest of them; an n-gram drafter's cost alike, and its probes rotate
through the batch."""
from __future__ import annotations

import torch

from specserve.speculative.adaptive.probes import PROBE_REQUESTS
from tests.fused_fixtures import fused_args
from tests.spec_fixtures import make_tiny_directory, plain_greedy_outputs, tiny_engine
from tests.standalone_fixtures import make_noisy_draft, standalone_args
from tests.test_eagle_adaptive import scripted
from tests.test_eagle_drafter import VOCAB, target  # noqa: F401
from tests.test_eagle_drafter_tree import random_head  # noqa: F401

BATCH = PROBE_REQUESTS + 6
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def varied_prompts(count: int) -> list[list[int]]:
    """Prompts of 4 to 28 tokens, not in length order."""
    generator = torch.Generator().manual_seed(3)
    lengths = [4 + (7 * i) % 25 for i in range(count)]
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


class ProbeSpy:
    """Per probe of a full batch: the batch and the requests it proposed for; `missing`: the
    rows each request's head cache lacked just before (a model drafter's)."""

    def __init__(self, core, missing=None):
        self.probes: list[tuple[list[str], list[str], dict[str, int]]] = []
        probe, propose = core.planner.probe, core.drafter.propose
        batch: list = []

        def spied_probe(reqs):
            batch[:] = reqs
            return probe(reqs)

        def spied_propose(reqs, max_nodes):
            if len(batch) == BATCH:
                lacking = {r.rid: missing(r) for r in batch} if missing is not None else {}
                self.probes.append(([r.rid for r in batch], [r.rid for r in reqs], lacking))
            return propose(reqs, max_nodes)
        core.planner.probe, core.drafter.propose = spied_probe, spied_propose


def assert_probes_take_the_least_to_catch_up(path, engine_args: dict, prompts_fed: bool = False) -> None:
    """Plain decoding throughout, a probe every 10th plain step: each probe of the full batch
    proposed for the PROBE_REQUESTS requests whose draft cache lacked the fewest rows.
    prompts_fed: the drafter reads a prompt's rows in its prefill's step (an EAGLE head)."""
    prompts = varied_prompts(BATCH)
    with tiny_engine(path, max_running_requests=BATCH, **engine_args) as engine:
        core = engine.core
        scripted(engine, overlap=True, script=[False])
        spy = ProbeSpy(core, lambda req: (core.drafter.kv.missing_rows(req), len(req.output_ids)))
        outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outputs] == plain_greedy_outputs(path, prompts, GREEDY)
    assert len(spy.probes) >= 2
    for batch, sample, lacking in spy.probes:
        assert len(sample) == PROBE_REQUESTS
        left_out = [lacking[rid] for rid in batch if rid not in sample]
        assert max(lacking[rid] for rid in sample) <= min(left_out)
    first_batch, first_sample, first_lacking = spy.probes[0]
    if prompts_fed:
        # the first probe found every prompt's rows fed: each lacked the rows of its decoded tokens only
        assert all(missing == decoded for missing, decoded in first_lacking.values()), first_lacking
    else:
        # the first probe found no cache fed: the shortest prompts had the least to catch up
        by_length = sorted(range(BATCH), key=lambda i: len(prompts[i]))
        assert set(first_sample) == {first_batch[i] for i in by_length[:PROBE_REQUESTS]}   # the batch in arrival order
    # ... and the next probes took those again: fed at the first, they lacked only what followed
    assert all(set(sample) == set(first_sample) for _, sample, _ in spy.probes[1:])


def test_an_eagle_probe_of_part_of_the_batch_takes_the_requests_with_least_to_catch_up(target, random_head):  # noqa: F811
    path, _, _, _ = target
    _, head_path, _, _ = random_head
    assert_probes_take_the_least_to_catch_up(path, fused_args("EAGLE3", head_path, adaptive=True,
                                                              speculative_num_steps=3), prompts_fed=True)


def test_a_draft_models_probe_takes_the_requests_with_least_to_catch_up(tmp_path):
    target_path, draft_path = tmp_path / "target", tmp_path / "draft"
    make_tiny_directory(target_path, "llama", seed=1)
    make_noisy_draft(target_path, draft_path, sigma=0.02)
    assert_probes_take_the_least_to_catch_up(target_path, standalone_args(draft_path, 3, adaptive=True))


def test_ngram_probes_rotate_through_the_batch(tmp_path):
    make_tiny_directory(tmp_path, "qwen2", seed=1)
    prompts = varied_prompts(BATCH)
    with tiny_engine(tmp_path, max_running_requests=BATCH, speculative_algorithm="NGRAM") as engine:
        core = engine.core
        scripted(engine, overlap=True, script=[False])
        spy = ProbeSpy(core)
        engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert len(spy.probes) >= 2
    first, second = spy.probes[0][1], spy.probes[1][1]
    batch = spy.probes[0][0]
    assert first == batch[:PROBE_REQUESTS]                                # a window from the start ...
    assert second == (batch * 2)[PROBE_REQUESTS:2 * PROBE_REQUESTS]       # ... then the next one


SAMPLED = {"temperature": 0.9, "max_new_tokens": 24, "ignore_eos": True}   # unseeded: drafts sampled from q


def draft_temperatures(core) -> list[tuple[bool, list[float]]]:
    """Per chain the head drafts: whether a probe asked for it, and its rows' temperatures."""
    calls, probing = [], []
    runner, probe = core.drafter.runner, core.planner.probe
    draft = runner.draft

    def spied_probe(reqs):
        probing.append(True)
        try:
            return probe(reqs)
        finally:
            probing.pop()

    def spied_draft(rows, features, sample):
        calls.append((bool(probing), [row.temperature for row in rows]))
        return draft(rows, features, sample)
    core.planner.probe, runner.draft = spied_probe, spied_draft
    return calls


def test_an_eagle_probe_drafts_the_heads_argmax_for_sampled_requests(target, random_head):  # noqa: F811
    """A probe's chains are walked by exact matches against plain sampling, which would count a
    sampled node sum(p q) where rejection accepts sum(min(p, q)): a probe drafts argmax chains
    (EagleDrafter.propose_probe), and drafting steps still sample theirs."""
    path, _, _, _ = target
    _, head_path, _, _ = random_head
    prompts = varied_prompts(4)
    for drafting in (False, True):
        with tiny_engine(path, max_running_requests=4, **fused_args("EAGLE3", head_path, adaptive=True,
                                                                    speculative_num_steps=3)) as engine:
            scripted(engine, overlap=True, script=[drafting])
            calls = draft_temperatures(engine.core)
            engine.generate(input_ids=prompts, sampling_params=SAMPLED)
        probes = [temperatures for probe, temperatures in calls if probe]
        steps = [temperatures for probe, temperatures in calls if not probe]
        if drafting:
            assert steps and all(t == SAMPLED["temperature"] for temps in steps for t in temps), steps
        else:
            assert probes and all(t == 0.0 for temps in probes for t in temps), probes
