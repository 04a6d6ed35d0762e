"""The adaptive draft length with drafters that read the target's states (EAGLE / EAGLE3
trees, fused chains, NAIVE_EAGLE, MTP): plain steps keep the target's states and the head is
fed them (the next proposal's catch-up, or once HELD_STATES_BYTES are held), so that whenever
it drafts again it has read every committed token.

A scripted policy forces stretches of plain steps between drafting steps, on both plain
paths (the engine's own verify of root-only trees, and the overlap schedule's steps
launched ahead, forced on here as tests/test_overlap.py does); greedy output stays plain
decoding's, and every tree or chain the engine proposes, after any plain stretch, is the one
a reference computes from the head fed the whole context (a head that missed the plainly
decoded tokens drafts from another context: tests/test_eagle_drafter_tree.py's random head
makes that show). With the real policy (the default) and with --speculative-disable-adaptive
(every step drafts) output stays the same and every target and head slot comes back.
"""
from __future__ import annotations

import pytest
import torch

from specserve.engine.overlap import OverlapSchedule
from specserve.speculative.adaptive.listener import PolicyListener
from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.speculative.model_drafters import eagle
from tests.fused_fixtures import FusedSpy, fused_args, save_random_eagle_head, wait_until_fused_state_is_free
from tests.spec_fixtures import make_tiny_directory, plain_greedy_outputs, tiny_engine
from tests.test_eagle_drafter import eagle_args, head_dir, target, wait_until_head_kv_is_free  # noqa: F401
from tests.test_eagle_drafter_tree import random_head, reference_tree  # noqa: F401
from tests.test_mtp import DraftSpy, copy_head, reference_drafts, target_dir  # noqa: F401

# decode steps: True drafts, False decodes plainly; repeated. Stretches longer than a chain
# (K + 1 tokens).
SCRIPT = [False] * 3 + [True] * 2 + [False] * 7 + [True] + [False] + [True] * 3


class ScriptedPolicy(AdaptiveDraftLength):
    """The adaptive policy with its choices scripted: decode step i drafts iff
    script[i % len(script)], a drafting step verifies the whole proposal, every tenth plain
    step probes (its proposals are shadows only: the policy never switches on them)."""

    def __init__(self, tiers: list[int], script: list[bool]):
        super().__init__(tiers)
        self.script, self.step, self.plain_steps, self.drafting_steps = script, 0, 0, 0

    def should_draft(self, batch_size: int) -> bool:
        draft = self.script[self.step % len(self.script)]
        self.step += 1
        self.drafting_steps += draft
        self.plain_steps += not draft
        return draft

    def would_draft(self, batch_size: int) -> bool:
        return self.script[self.step % len(self.script)]

    def choose(self, rids: list[str], num_nodes: list[int], keys=None) -> int:
        return self.tiers[-1]

    def choose_nodes(self, rids: list[str], num_nodes: list[int], keys=None) -> list[int]:
        # the whole proposal: the real choice rates the steps' measured prices, which a busy CPU
        # moves (a drafting step of the script then verified roots alone)
        return list(num_nodes)

    def probe_due(self, batch_size: int, every_at_least: int = 1, every_at_most: int | None = None) -> bool:
        return self.plain_steps % 10 == 0

    def probe(self, *args, **kwargs) -> None:
        pass


def scripted(engine, overlap: bool, script: list[bool] = SCRIPT) -> ScriptedPolicy:
    """Replaces the engine's policy (on by default: checked) with a scripted one; `overlap`:
    plain greedy steps run one step ahead (forced on where it is off: CUDA-graph-only by
    default), else through the engine's verify of root-only trees."""
    core = engine.core
    assert core.adaptive is not None, "the adaptive policy is on by default"
    if not overlap:
        core.overlap = None
    elif core.overlap is None:
        core.overlap = OverlapSchedule(core.runner, core.scheduler, core.sampler)
    policy = core.adaptive = ScriptedPolicy(core.adaptive.tiers, script)
    return policy


class ProposalSpy:
    """Every full-size proposal (num_nodes == nodes), with the request's tokens then, and how
    many tokens the request committed since its previous proposal (more than a drafting step
    commits: a plain stretch came between)."""

    def __init__(self, drafter, nodes: int):
        self.proposals: list[tuple[list[int], list[int], list[int], int]] = []   # (context, tokens, parents, gap)
        self._last: dict[str, int] = {}
        propose = drafter.propose

        def spy(reqs, max_nodes):
            proposal, num_nodes = propose(reqs, max_nodes)
            for i, (req, count) in enumerate(zip(reqs, num_nodes)):
                gap = req.num_tokens - self._last.get(req.rid, req.num_tokens)
                self._last[req.rid] = req.num_tokens
                if count == nodes:
                    self.proposals.append((req.prompt_ids + req.output_ids, proposal.tokens[i, 1:].tolist(),
                                           proposal.parents[i, 1:].tolist(), gap))
            return proposal, num_nodes
        drafter.propose = spy

    def check(self, head, extractor, topk: int, steps: int, nodes: int, after_plain: int) -> None:
        """Each proposal is the reference's for its context; at least `after_plain` came
        after a plain stretch."""
        assert sum(gap > steps + 1 for *_, gap in self.proposals) >= after_plain
        with torch.no_grad():
            for context, tokens, parents, gap in self.proposals:
                features = extractor([context])
                states = features.layers if head.config.aux_layers else features.final
                expected = reference_tree(head, states[:-1], torch.tensor(context[1:]), topk, steps, nodes)
                assert (tokens, parents) == expected, f"context of {len(context)} tokens, {gap} since the last"


class StatesSpy:
    """The most target states held (all requests) after a step's observe (what waits for the
    head), but those of finished requests that wait to be released together (engine/parked.py),
    which are fed then."""

    def __init__(self, drafter, scheduler):
        self.most = 0
        observe_batch = drafter.observe_batch

        def spy(reqs, committed):
            observe_batch(reqs, committed)
            parked = sum(drafter.states.count(req.rid) for req in scheduler.parked.reqs)
            self.most = max(self.most, drafter.states.held_rows - parked)
        drafter.observe_batch = spy


@pytest.mark.parametrize("overlap", [False, True], ids=["verify", "overlap"])
@pytest.mark.parametrize("held_bytes", [eagle.HELD_STATES_BYTES, 1], ids=["held-default", "fed-every-step"])
def test_trees_after_plain_stretches_are_the_reference_trees(target, random_head, monkeypatch,  # noqa: F811
                                                             overlap, held_bytes):
    """EAGLE-2 trees (EagleDrafter) of a random head, batches of 4: plain stretches between
    drafting steps, the head fed at the next proposal (or, with a budget of one byte, at
    every plain step: each request then holds only its last fed state)."""
    monkeypatch.setattr(eagle, "HELD_STATES_BYTES", held_bytes)
    held = check_tree_stretches(target, random_head, overlap)
    assert held.most <= 4 if held_bytes == 1 else held.most > 4 * 4   # prompts wait unfed


def check_tree_stretches(target, random_head, overlap: bool, **engine_args) -> "StatesSpy":  # noqa: F811
    path, _, _, held_out = target
    algorithm, head_path, head, extractor = random_head
    topk, steps, nodes = 2, 3, 6
    with tiny_engine(path, **eagle_args(algorithm, head_path, speculative_num_steps=steps, speculative_eagle_topk=topk,
                                        speculative_num_draft_tokens=nodes, adaptive=True), **engine_args) as engine:
        policy = scripted(engine, overlap)
        spy, held = ProposalSpy(engine.core.drafter, nodes), StatesSpy(engine.core.drafter, engine.core.scheduler)
        outputs = engine.generate(input_ids=[c.tokens[:c.prompt_len] for c in held_out[:4]],
                                  sampling_params={"temperature": 0.0, "max_new_tokens": 32})
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out[:4]]
        wait_until_head_kv_is_free(engine)
    assert policy.plain_steps > 10 and policy.drafting_steps > 5
    spy.check(head, extractor, topk, steps, nodes, after_plain=4)
    return held


@pytest.mark.parametrize("overlap", [False, True], ids=["verify", "overlap"])
@pytest.mark.parametrize("algorithm,steps", [("EAGLE3", 3), ("NAIVE_EAGLE", 1)], ids=["K3", "naive"])
def test_fused_chains_after_plain_stretches_are_the_reference_chains(target, random_head, algorithm,  # noqa: F811
                                                                     steps, overlap):
    """Fused chains (FusedChainDrafter): after a plain stretch a request's first drafts come
    from EagleDrafter's catch-up and chain, then every drafting step is fused; its chains
    are the head's argmax chains over the whole context."""
    check_chain_stretches(target, random_head, algorithm, steps, overlap)


def check_chain_stretches(target, random_head, algorithm: str, steps: int, overlap: bool,  # noqa: F811
                          **engine_args) -> None:
    path, _, _, held_out = target
    _, head_path, head, extractor = random_head
    args = fused_args(algorithm, head_path, adaptive=True) if algorithm == "NAIVE_EAGLE" else \
        fused_args(algorithm, head_path, adaptive=True, speculative_num_steps=steps)
    with tiny_engine(path, **args, **engine_args) as engine:
        drafter = engine.core.drafter
        policy = scripted(engine, overlap)
        fused, spy = FusedSpy(drafter), ProposalSpy(drafter, steps + 1)
        outputs = engine.generate(input_ids=[c.tokens[:c.prompt_len] for c in held_out[:4]],
                                  sampling_params={"temperature": 0.0, "max_new_tokens": 32})
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out[:4]]
        wait_until_fused_state_is_free(engine)
    assert policy.plain_steps > 10 and policy.drafting_steps > 5
    assert fused.engine == 0 and fused.fused > 0          # plain steps never reach the fused step
    assert fused.first_drafts > len(outputs)              # drafting resumed after plain stretches
    spy.check(head, extractor, 1, steps, steps + 1, after_plain=4)


@pytest.mark.parametrize("overlap", [False, True], ids=["verify", "overlap"])
def test_mtp_drafts_after_plain_stretches_are_the_reference_layers_argmax(target_dir, copy_head,  # noqa: F811
                                                                          overlap):
    """MTP (the fused chain with an MTP layer; tests/test_mtp.py's reference): drafts are
    accepted and rejected, and plain stretches come between."""
    prompts = [[5, 6, 7, 8, 9] * 6 + [10, 11], [20, 21, 22, 23] * 5, list(range(30, 72)), [100, 101] * 9]
    greedy = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    expected = plain_greedy_outputs(target_dir, prompts, greedy)
    with tiny_engine(target_dir, **fused_args("MTP", copy_head, adaptive=True)) as engine:
        policy = scripted(engine, overlap)
        fused, drafts = FusedSpy(engine.core.drafter), DraftSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=prompts, sampling_params=greedy)
        assert [o["output_ids"] for o in outputs] == expected
        wait_until_fused_state_is_free(engine)
    assert policy.plain_steps > 10 and fused.engine == 0 and fused.first_drafts > len(prompts)
    references = {tuple(p): reference_drafts(target_dir, copy_head, p + e) for p, e in zip(prompts, expected)}
    wrong = [(length, draft) for prompt, length, draft in drafts.drafts if references[prompt][length - 2] != draft]
    assert len(drafts.drafts) > 20 and not wrong, f"{len(wrong)} of {len(drafts.drafts)} drafts differ"
    histogram = {n for o in outputs for n in o["meta_info"]["spec_accept_histogram"]}
    assert histogram == {1, 2}


@pytest.mark.parametrize("num_steps,topk", [(3, 1), (2, 2)], ids=["chain", "tree"])
def test_the_real_policy_and_always_drafting_keep_output_and_free_everything(tmp_path, num_steps, topk):
    """The default policy and --speculative-disable-adaptive, a random head over half the
    vocabulary (every draft rejected: the policy goes plain), batches, preemption (a small
    cache), an abort, and sampled requests."""
    target_path, head_path = tmp_path / "target", tmp_path / "head"
    make_tiny_directory(target_path, "qwen2", seed=1)
    save_random_eagle_head(target_path, head_path, draft_vocab=torch.arange(0, 256, 2))
    prompts = [[5, 6, 7, 8, 9] * 6 + [10, 11], [20, 21, 22, 23] * 5, list(range(30, 72)), [100, 101] * 9]
    greedy = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    expected = plain_greedy_outputs(target_path, prompts, greedy)
    for disable in (False, True):
        args = fused_args("EAGLE3", head_path, adaptive=not disable, speculative_num_steps=num_steps,
                          speculative_eagle_topk=topk, speculative_num_draft_tokens=num_steps + 1 if topk == 1 else 5)
        with tiny_engine(target_path, max_total_tokens=200, **args) as engine:
            core = engine.core
            assert (core.adaptive is None) == disable
            if not disable:   # no probe sees a draft accepted: once plain, the batch stays plain
                core.overlap = OverlapSchedule(core.runner, core.scheduler, core.sampler)
            outputs = engine.generate(input_ids=prompts, sampling_params=greedy)
            assert [o["output_ids"] for o in outputs] == expected
            assert sum(o["meta_info"]["preemptions"] for o in outputs) > 0
            stream = engine.generate(input_ids=prompts[1], sampling_params={**greedy, "max_new_tokens": 60},
                                     stream=True)
            next(iter(stream))
            stream.close()     # aborts it
            sampled = engine.generate(input_ids=prompts[:2], sampling_params={"temperature": 1.0, "max_new_tokens": 20,
                                                                              "ignore_eos": True})
            assert [len(o["output_ids"]) for o in sampled] == [20, 20]
            if topk == 1:
                wait_until_fused_state_is_free(engine)
            else:
                wait_until_head_kv_is_free(engine)
            if not disable:
                assert core.adaptive.steps_per_tier[1] > 0     # it decoded plainly


@pytest.mark.parametrize("held_rows", [None, 6], ids=["held-default", "held-6"])
def test_plain_stretches_copy_to_the_device_without_waiting_and_feed_only_past_the_budget(target, random_head,  # noqa: F811
                                                                                          monkeypatch, held_rows):
    """A plain stretch's feeds and probes queue their inputs without a blocking host-to-device
    copy (torch.tensor(..., device=...) waits for the step launched ahead on a GPU, then the
    GPU idles while the head's launches follow: H200, random 1.5B, batch 1, ~4 ms a feed), and
    states are fed between probes only once what is held reaches the budget (fed every 32
    plain steps before, at ~4 ms a feed against a ~1.3-ms plain step at batch 1)."""
    path, _, _, held_out = target
    _, head_path, _, _ = random_head
    row_bytes = 3 * 64 * 4   # EAGLE-3's three layers of the tiny target, fp32
    if held_rows is not None:
        monkeypatch.setattr(eagle, "HELD_STATES_BYTES", held_rows * row_bytes)
    with tiny_engine(path, **fused_args("EAGLE3", head_path, adaptive=True, speculative_num_steps=3)) as engine:
        drafter = engine.core.drafter
        policy = scripted(engine, overlap=True, script=[False])   # plain throughout, a probe every 10th step
        feeds, blocking = [], []
        feed, tensor = drafter.feed, torch.tensor

        def counting_feed(reqs):
            feeds.append(len(reqs))
            return feed(reqs)

        def watched_tensor(*args, **kwargs):
            if kwargs.get("device") is not None:
                blocking.append(kwargs["device"])
            return tensor(*args, **kwargs)
        drafter.feed = counting_feed
        runner = drafter.runner
        catch_up, draft = runner.catch_up, runner.draft

        def watched(function):
            def call(*args, **kwargs):
                torch.tensor = watched_tensor
                try:
                    return function(*args, **kwargs)
                finally:
                    torch.tensor = tensor
            return call
        runner.catch_up, runner.draft = watched(catch_up), watched(draft)
        prompt = held_out[0].tokens[:held_out[0].prompt_len]
        engine.generate(input_ids=[prompt], sampling_params={"temperature": 0.0, "max_new_tokens": 96,
                                                             "ignore_eos": True})
        assert drafter.states.row_bytes == row_bytes
    assert policy.plain_steps >= 95 and policy.drafting_steps == 0
    assert not blocking
    if held_rows is None:
        # the probes, every 10 plain steps, feed what waits; the feeds are the prompt's, at its
        # prefill, and the request's release (what its head lacks is fed then, to be cached
        # beside the target's KV: head_prefix_cache.py)
        assert feeds == [1, 1]
    else:                  # 6 rows held (3 the batch's own) between probes: fed then
        assert len(feeds) >= 9 and set(feeds) == {1}


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunked"])
def test_the_prefill_that_ends_a_prompt_feeds_the_head_its_rows(target, random_head, chunk):  # noqa: F811
    """The head reads a prompt's rows 0 .. P - 2 in one forward queued by the prefill step whose
    states reach the prompt's last token (chunks before it only hand their states over; with
    chunks of 4 a chunk may end one token short, the last token cached by a decode step), so a
    request's first drafting step catches nothing up: it feeds the chain's rows alone; output
    stays plain's."""
    path, _, _, held_out = target
    _, head_path, _, _ = random_head
    prompts = [c.tokens[:c.prompt_len] for c in held_out[:3]]
    assert max(map(len, prompts)) > 4
    params = {"temperature": 0.0, "max_new_tokens": 16}
    with tiny_engine(path, chunked_prefill_size=chunk, **fused_args("EAGLE3", head_path)) as engine:
        core, fed = engine.core, []
        runner, launch = core.drafter.runner, core.prefill.launch
        catch_up, in_prefill = runner.catch_up, []

        def prefill_launch(*args):
            in_prefill.append(True)
            try:
                return launch(*args)
            finally:
                in_prefill.pop()

        def recording(rows, starts, tokens, slots, features):
            fed.append((bool(in_prefill), starts, [len(t) for t in tokens]))
            return catch_up(rows, starts, tokens, slots, features)
        core.prefill.launch, runner.catch_up = prefill_launch, recording
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        wait_until_fused_state_is_free(engine)
    assert [o["output_ids"] for o in outputs] == plain_greedy_outputs(path, prompts, params)
    assert fed and all(during_prefill for during_prefill, _, _ in fed), fed
    assert sorted(n for _, starts, lengths in fed for start, n in zip(starts, lengths) if start == 0) == \
        sorted(len(p) - 1 for p in prompts), fed


def test_step_mix_counts_fused_eagle_steps_as_drafting(target, random_head):  # noqa: F811
    """gpu_suite's RunWatch: EAGLE's fused steps verify and draft in the drafter's own step;
    they are drafting steps, not plain ones."""
    from specserve.bench.gpu_suite import run
    from specserve.bench.run_watch import RunWatch
    path, _, _, held_out = target
    _, head_path, _, _ = random_head
    with tiny_engine(path, **fused_args("EAGLE3", head_path, speculative_num_steps=3)) as engine:   # always drafting
        watch = RunWatch(engine)
        try:
            summary, = run(engine, [c.tokens[:c.prompt_len] for c in held_out[:2]], 2, 16, "eagle3", watch=watch)
        finally:
            watch.close()
        assert engine.core.events.listeners == []    # close stopped its listening
    mix = summary["step_mix"]
    # plain: steps whose requests have no room left for drafts (max_new_tokens); was every step
    assert mix["draft"]["steps"] >= 10 and mix["plain"]["steps"] <= 2, mix
    assert summary["draft_nodes_mean"] == 4


def test_the_policy_chains_fused_steps_while_it_drafts(target, head_dir):  # noqa: F811
    """The real policy on the steps-ahead path (a GPU engine's, forced on), a trained head and
    steps priced so that drafting may pay: while its bucket drafts, fused steps are queued before
    the step they follow is read (engine/draft_ahead.py), the policy's choice and shadows made
    for them once that step is committed; output stays plain decoding's, all is freed."""
    from tests.spec_fixtures import price_steps
    from tests.test_draft_ahead import ahead_on

    path, _, _, held_out = target
    algorithm, head_path, _, _ = head_dir
    args = fused_args(algorithm, head_path, adaptive=True, speculative_num_steps=3)
    with tiny_engine(path, max_running_requests=8, **args) as engine:
        ahead_on(engine)
        price_steps(engine, 0.010, 0.001)   # a 4-node step costs 1.3 plain steps
        fused = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=[c.tokens[:c.prompt_len] for c in held_out],
                                  sampling_params={"temperature": 0.0, "max_new_tokens": 32})
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out]
        wait_until_fused_state_is_free(engine)
        tiers = engine.core.adaptive.steps_per_tier
    assert fused.chained > 0 and fused.engine == 0, (fused.chained, fused.engine)
    assert tiers[max(tiers)] > 0 and tiers[1] > 0, tiers    # drafting episodes and plain ones (its probes)


class RatesHeard(PolicyListener):
    """The rates of every choice the policy made for a drafting step of a bucket."""

    def __init__(self, bucket: int):
        self.bucket = bucket
        self.choices: list[dict[int, float]] = []

    def rated(self, bucket, batch_size, rids, num_nodes, keys, choosing, choice, rates) -> None:
        if choosing and bucket == self.bucket:
            self.choices.append(dict(rates))


def test_a_fused_chains_episode_is_rated_tier_against_tier(target, head_dir):  # noqa: F811
    """A fused chain's step runs every chain whatever the cut, so its policy's tiers are plain
    decoding and the whole chain: with a cut tier among them, chained steps never priced it,
    and every choice of the episode went unrated (no rates while a tier is unpriced), its end
    decided by whether drafting was expected to beat plain at all rather than at leave_margin."""
    from tests.spec_fixtures import price_steps
    from tests.test_draft_ahead import ahead_on

    path, _, _, held_out = target
    algorithm, head_path, _, _ = head_dir
    args = fused_args(algorithm, head_path, adaptive=True, speculative_num_steps=3)
    with tiny_engine(path, max_running_requests=8, **args) as engine:
        ahead_on(engine)
        price_steps(engine, 0.010, 0.001)
        heard = RatesHeard(bucket=8)   # (the batch's: a bucket it drains into is priced there anew)
        engine.core.adaptive.listen(heard)
        outputs = engine.generate(input_ids=[c.tokens[:c.prompt_len] for c in held_out],
                                  sampling_params={"temperature": 0.0, "max_new_tokens": 32})
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out]
        assert engine.core.adaptive.tiers == [1, 4]
        wait_until_fused_state_is_free(engine)
    # the episode's first steps price the chain (one makeshift step is no price to choose by)
    rated = [i for i, rates in enumerate(heard.choices) if rates]
    assert rated and rated[0] <= 2 and len(heard.choices) - rated[0] >= 4, heard.choices
    assert all(set(rates) == {1, 4} for rates in heard.choices[rated[0]:]), heard.choices


@pytest.mark.parametrize("overlap", [False, True], ids=["verify", "overlap"])
def test_the_step_that_feeds_the_head_the_prompts_is_the_policys_one_prefill_step(target, random_head,  # noqa: F811
                                                                                overlap):
    """ProposalHints.took_prefill: the step that draws a batch's first chains after its prompts
    (whose rows the prefill's step fed) is recorded as the drafter's prefill (the policy leaves
    it out of its episode); the later drafting steps, after plain stretches too (their catch-up
    feeds decoded rows only), are not."""
    path, _, _, held_out = target
    _, head_path, _, _ = random_head
    with tiny_engine(path, **fused_args("EAGLE3", head_path, adaptive=True, speculative_num_steps=3)) as engine:
        policy = scripted(engine, overlap)
        steps, record = [], policy.record_step

        def recording(batch_size, tree_size, seconds, tokens=None, steady=True, nodes=None, prefill=False):
            steps.append((tree_size, prefill))
            record(batch_size, tree_size, seconds, tokens, steady, nodes, prefill)
        policy.record_step = recording
        engine.generate(input_ids=[c.tokens[:c.prompt_len] for c in held_out[:4]],
                        sampling_params={"temperature": 0.0, "max_new_tokens": 32})
    drafting = [i for i, (tree_size, _) in enumerate(steps) if tree_size > 1]
    assert len(drafting) >= 3 and any(steps[i - 1][0] == 1 for i in drafting[1:])   # episodes after plain stretches
    assert [i for i, (_, prefill) in enumerate(steps) if prefill] == drafting[:1], steps
