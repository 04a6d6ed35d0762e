"""EAGLE heads with the prefix cache on (kv/draft_rows.py, speculative/model_drafters/head_prefix_cache.py):
the tree keeps each cached position's head row beside the target's KV, so a request that
hits a cached prefix feeds its head the target states of the uncached suffix only.

Greedy output is the same with the cache on and off for EAGLE-3 and EAGLE chains (fused),
EAGLE-2 trees, NAIVE_EAGLE and MTP, over shared prompts, a second chat turn, and a cache
small enough that prefixes are evicted and requests preempted; afterwards every target
slot and every head slot is free or cached exactly once. Random tiny targets and heads.
"""
from __future__ import annotations

import random

import pytest
import torch

from specserve.kv.draft_rows import EvictingSlots, bigrams
from specserve.kv.pool import SlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.request.req import ReqState
from tests.fused_fixtures import fused_args, save_random_eagle_head, save_random_mtp_head
from tests.spec_fixtures import (assert_draft_pool_is_free, cached_draft_rows, make_tiny_directory, tiny_engine,
                                 wait_until_all_kv_is_free)

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 11, "max_new_tokens": 24, "ignore_eos": True}
SYSTEM = [5, 6, 7, 8, 9] * 6
PROMPTS = [SYSTEM + [10, 11], SYSTEM + [40, 41, 42], [20, 21, 22, 23] * 5, list(range(30, 72)), [100, 101] * 9]
FOLLOW_UP = [3, 4, 5, 6]

CONFIGS = {
    "EAGLE3-chain": ("EAGLE3", {"speculative_num_steps": 3}),
    "EAGLE-chain": ("EAGLE", {"speculative_num_steps": 3}),
    "EAGLE3-tree": ("EAGLE3", {"speculative_num_steps": 3, "speculative_eagle_topk": 2,
                               "speculative_num_draft_tokens": 6}),
    "NAIVE_EAGLE": ("NAIVE_EAGLE", {}),
    "MTP": ("MTP", {}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target path, {kind: head path}): a random 256-token target, random heads of each kind."""
    root = tmp_path_factory.mktemp("eagle-prefix-cache")
    target = root / "target"
    make_tiny_directory(target, "llama", seed=1)
    heads = {}
    for kind in ("EAGLE3", "EAGLE"):
        heads[kind] = root / kind
        save_random_eagle_head(target, heads[kind], algorithm=kind, draft_vocab=torch.arange(0, 256, 2))
    heads["NAIVE_EAGLE"] = heads["EAGLE3"]
    heads["MTP"] = root / "MTP"
    save_random_mtp_head(target, heads["MTP"], std=0.1)
    return target, heads


def engine_for(models, config: str, **extra):
    target, heads = models
    algorithm, args = CONFIGS[config]
    return tiny_engine(target, **fused_args(algorithm, heads[algorithm], **args), **extra)


def two_turns(engine, params: dict = GREEDY) -> tuple[list[list[int]], list[list[int]], list[int], int]:
    """(first turn's outputs, second turn's outputs, second turn's cached tokens, preemptions)."""
    first = engine.generate(input_ids=PROMPTS, sampling_params=params)
    seconds = [p + o["output_ids"] + FOLLOW_UP for p, o in zip(PROMPTS, first)]
    second = engine.generate(input_ids=seconds, sampling_params=params)
    return ([o["output_ids"] for o in first], [o["output_ids"] for o in second],
            [o["meta_info"]["cached_tokens"] for o in second], sum(o["meta_info"]["preemptions"] for o in first + second))


def wait_until_everything_is_free(engine) -> None:
    """Every target slot and every head slot is free or the prefix cache's, exactly once
    (the ledger's check covers both pools), and no request keeps head state."""
    wait_until_all_kv_is_free(engine)
    drafter = engine.core.drafter
    assert not drafter.kv.sequences and drafter.states.held_rows == 0
    assert_draft_pool_is_free(drafter.kv.pool, cached_draft_rows(engine))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_output_is_the_same_with_the_cache_on_and_off(models, config):
    with engine_for(models, config, disable_radix_cache=True) as uncached:
        expected = two_turns(uncached)
        assert expected[2] == [0] * len(PROMPTS)
        assert uncached.core.scheduler.kv.tree is None
        wait_until_everything_is_free(uncached)
    with engine_for(models, config) as cached:
        first, second, cached_tokens, _ = two_turns(cached)
        assert (first, second) == expected[:2]
        # turn 2 finds turn 1's prompt and answer but its last token (a bigram needs the token after it)
        assert cached_tokens == [len(p) + len(o) - 1 for p, o in zip(PROMPTS, first)]
        wait_until_everything_is_free(cached)
        assert len(cached_draft_rows(cached)) == cached.core.scheduler.cached_slots() > 0
        # a third round of the same requests runs from the cache
        assert two_turns(cached)[:2] == expected[:2]
        wait_until_everything_is_free(cached)


@pytest.mark.parametrize("config", ["EAGLE3-chain", "NAIVE_EAGLE"])
def test_seeded_sampling_is_the_same_with_the_cache_on_and_off(models, config):
    """Seeded requests sample what plain decoding samples (the coupled rule), cache or not."""
    with engine_for(models, config, disable_radix_cache=True) as uncached:
        expected = two_turns(uncached, SEEDED)
    with engine_for(models, config) as cached:
        first, second, cached_tokens, _ = two_turns(cached, SEEDED)
        assert (first, second) == expected[:2] and min(cached_tokens) > 0
        wait_until_everything_is_free(cached)


@pytest.mark.parametrize("config", ["EAGLE3-chain", "EAGLE3-tree"])
def test_a_small_cache_evicts_prefixes_and_their_head_rows(models, config):
    """A cache that holds one or two requests: cached prefixes are evicted (head rows with
    them) and requests preempted while others run; the outputs stay the uncached ones."""
    with engine_for(models, config, disable_radix_cache=True) as uncached:
        expected = two_turns(uncached)
    with engine_for(models, config, max_total_tokens=160) as small:
        tree = small.core.scheduler.kv.tree
        evict, evictions = tree.evict, []
        tree.evict = lambda count: evictions.append(evict(count)) or evictions[-1]   # the target's allocations'
        first, second, _, preemptions = two_turns(small)
        assert (first, second) == expected[:2]
        assert preemptions > 0 and sum(evictions) > 0
        wait_until_everything_is_free(small)
        assert cached_draft_rows(small)
        assert small.flush_cache() > 0
        assert not cached_draft_rows(small) and small.core.scheduler.cached_slots() == 0
        pool = small.core.drafter.kv.pool
        assert pool.slots.available() == pool.size     # flushing the cache gave every head row back


@pytest.mark.parametrize("config, extra", [
    ("EAGLE3-chain", {"adaptive": True}),                                      # plain stretches, probes
    ("EAGLE3-tree", {"max_total_tokens": 200, "chunked_prefill_size": 16}),    # chunked prompts, a small cache
    ("MTP", {"max_total_tokens": 200, "chunked_prefill_size": 16}),
], ids=["EAGLE3-chain-adaptive", "EAGLE3-tree-chunked", "MTP-chunked"])
def test_three_turns_of_varied_requests(models, config, extra):
    """Twelve conversations over a shared 40-token start cut at random places, random answer
    lengths, three turns: the same tokens cached or not, and everything accounted after each."""
    target, heads = models
    algorithm, args = CONFIGS[config]
    rng = random.Random(1)
    start = [rng.randrange(3, 256) for _ in range(40)]
    prompts = [start[:rng.randrange(0, 40)] + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 20))]
               for _ in range(12)]
    params = [{"temperature": 0, "max_new_tokens": rng.randrange(1, 30), "ignore_eos": True} for _ in prompts]
    engine_args = {**fused_args(algorithm, heads[algorithm], adaptive=extra.get("adaptive", False), **args),
                   **{k: v for k, v in extra.items() if k != "adaptive"}}
    turns = {}
    for disable in (True, False):
        with tiny_engine(target, disable_radix_cache=disable, **engine_args) as engine:
            conversation, turns[disable] = list(prompts), []
            for _ in range(3):
                outputs = engine.generate(input_ids=conversation, sampling_params=params)
                turns[disable].append([o["output_ids"] for o in outputs])
                conversation = [c + o["output_ids"] + FOLLOW_UP for c, o in zip(conversation, outputs)]
                wait_until_everything_is_free(engine)
    assert turns[False] == turns[True]


class RowCounter:
    """Counts, for one engine, the target states handed to the head (observe_hidden) and the
    head rows its forwards computed from them (catch-up rows and the rows a chain feeds)."""

    def __init__(self, drafter):
        self.states = self.head_rows = 0
        observe, catch_up, draft = drafter.observe_hidden, drafter.runner.catch_up, drafter.runner.draft

        def observe_hidden(reqs, starts, states, rows, owned=False):
            self.states += sum(map(len, rows))
            return observe(reqs, starts, states, rows, owned)

        def count_catch_up(rows, starts, tokens, slots, features):
            self.head_rows += sum(map(len, tokens))
            return catch_up(rows, starts, tokens, slots, features)

        def count_draft(rows, features, sample):
            self.head_rows += sum(len(row.tokens) for row in rows)
            return draft(rows, features, sample)

        drafter.observe_hidden, drafter.runner.catch_up, drafter.runner.draft = observe_hidden, count_catch_up, count_draft


@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["cached", "uncached"])
def test_a_second_turn_feeds_the_head_only_its_new_tokens(models, disable_radix_cache):
    """Turn 2 (one request, one token: its prefill then its release) hands the head the target
    states of what the cache lacked, and the head computes those rows only; uncached, every
    position's. (An EAGLE-2 tree drafter: all its head forwards are the counted ones.)"""
    prompt = PROMPTS[0]
    with engine_for(models, "EAGLE3-tree", disable_radix_cache=disable_radix_cache) as engine:
        answer = engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        second = prompt + answer + FOLLOW_UP
        wait_until_everything_is_free(engine)   # turn 1 released (its head fed), counted apart
        counter = RowCounter(engine.core.drafter)
        out = engine.generate(input_ids=second, sampling_params={**GREEDY, "max_new_tokens": 1})
        cached = out["meta_info"]["cached_tokens"]
        wait_until_everything_is_free(engine)
        new_positions = len(second) - cached
        assert counter.states == new_positions
        if disable_radix_cache:
            assert cached == 0 and counter.head_rows == 0   # nothing drafted, nothing cached: no head forward
        else:
            assert cached == len(prompt) + len(answer) - 1 and new_positions == len(FOLLOW_UP) + 1
            assert counter.head_rows == new_positions       # fed at its release, to be cached
            # and a turn that drafts: its first proposal feeds the rows of its uncached suffix only
            counter.head_rows = 0
            third = second + out["output_ids"] + FOLLOW_UP
            engine.generate(input_ids=third, sampling_params={**GREEDY, "max_new_tokens": 2})
            assert counter.states <= new_positions + len(FOLLOW_UP) + 1 + 2 * 6
            assert counter.head_rows < len(FOLLOW_UP) + 1 + 6 * 2 < len(third)
            wait_until_everything_is_free(engine)


def test_requests_that_end_apart_feed_the_head_in_one_forward(models):
    """Requests that end at different steps wait (parked: Scheduler.release_parked) and leave the
    head one catch-up forward over all of their rows, not one forward each (their prompts' rows
    went in one forward at their prefill); every row is cached and the next turn finds them."""
    with engine_for(models, "EAGLE3-chain") as engine:
        drafter = engine.core.drafter
        feeds, feed = [], drafter.feed
        drafter.feed = lambda reqs: (feeds.append(len(reqs)), feed(reqs))[1]
        params = [{**GREEDY, "max_new_tokens": 1 + 3 * i} for i in range(len(PROMPTS) - 1)]
        outputs = engine.generate(input_ids=PROMPTS[1:], sampling_params=params)
        wait_until_everything_is_free(engine)
        assert sorted(len(o["output_ids"]) for o in outputs) == [1, 4, 7, 10]
        # the prefill's feed of the prompts that decode past their first token, then the releases'
        # (drafting feeds count too)
        assert feeds[0] == len(PROMPTS) - 2
        assert sum(feeds[1:]) == len(PROMPTS) - 1 and len(feeds[1:]) < len(PROMPTS) - 1
        feeds.clear()
        seconds = [p + o["output_ids"] + FOLLOW_UP for p, o in zip(PROMPTS[1:], outputs)]
        again = engine.generate(input_ids=seconds, sampling_params={**GREEDY, "max_new_tokens": 1})
        assert [o["meta_info"]["cached_tokens"] for o in again] == \
            [len(p) + len(o["output_ids"]) - 1 for p, o in zip(PROMPTS[1:], outputs)]
        wait_until_everything_is_free(engine)


def head_cache_after_first_draft(engine, prompt: list[int]) -> torch.Tensor:
    """The K of the head's rows 0 .. R - 1 (every row the request's first draft reads) for a
    request of `prompt`, read right after that draft."""
    drafter = engine.core.drafter
    runner, pool, seen = drafter.runner, drafter.kv.pool, []
    draft = runner.draft

    def reading_draft(rows, features, sample):
        result = draft(rows, features, sample)
        if not seen:
            row = rows[0]
            entries = pool.req_to_token[row.req_row * runner.topk, :row.prefix_len + len(row.tokens)].long()
            seen.append(pool.k_buffers[0][entries].clone())
        return result

    runner.draft = reading_draft
    try:
        engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3})
    finally:
        runner.draft = draft
    return seen[0]


@pytest.mark.parametrize("config", ["EAGLE-chain", "EAGLE3-tree", "MTP"])
def test_the_head_cache_of_a_second_turn_is_what_an_uncached_engine_computes(models, config):
    """The rows a second turn takes from the tree hold the K/V its head would compute from the
    target's states (the tree's row p is the one of bigram p: no row is shifted or stale)."""
    caches = []
    for disable in (True, False):
        with engine_for(models, config, disable_radix_cache=disable, max_running_requests=1) as engine:
            answer = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)["output_ids"]
            second = PROMPTS[1] + answer + FOLLOW_UP
            caches.append(head_cache_after_first_draft(engine, second))
            wait_until_everything_is_free(engine)
    uncached, cached = caches
    assert len(cached) == len(uncached) == len(PROMPTS[1]) + len(answer) + len(FOLLOW_UP)
    assert torch.allclose(cached, uncached, atol=1e-5)


def test_tree_entries_keep_their_draft_rows_through_splits_and_eviction():
    """RadixCache with a draft allocator: an insert takes one draft row per token, a split
    keeps each row with its token, a repeated prefix keeps the first copy, and an evicted
    leaf frees its target slots and draft rows alike."""
    target, draft = SlotAllocator(16), SlotAllocator(16)
    tree = RadixCache(target, draft_allocator=draft)
    first_slots, first_rows = target.alloc(4), draft.alloc(4)
    tree.insert(bigrams([1, 2, 3, 4, 5], 0, 4), first_slots, draft_slots=first_rows)
    other_slots, other_rows = target.alloc(3), draft.alloc(3)
    inserted = tree.insert(bigrams([1, 2, 9, 9], 0, 3), other_slots, draft_slots=other_rows)
    assert inserted.cached == 1 and inserted.draft_slots == first_rows[:1] + other_rows[1:]
    draft.free(other_rows[:1])
    target.free(other_slots[:1])
    slots, node = tree.match_prefix(bigrams([1, 2, 3, 4, 5], 0, 4))
    assert slots == first_slots and tree.path_draft_slots(node) == first_rows
    with pytest.raises(ValueError, match="draft_slots"):
        tree.insert([7], [target.alloc(1)[0]])
    evicting = EvictingSlots(draft, tree.evict)
    taken = evicting.alloc(draft.available() + 2)    # two rows short: the least recently used leaf goes
    assert taken is not None and set(other_rows) <= set(taken)   # the evicted rows among them
    assert tree.size == 4 and sorted(tree.held_slots(draft=True)) == sorted(first_rows)
    assert target.available() + tree.size == 16 - 1    # its target slots came back too (one is the raise's)


# ---- the ledger and scheduler with a head's rows, stepped by hand (no model) ----
class UnfedHead:
    """A draft head's rows as kv/draft_rows.DraftRows sees them, without a model: a request's
    head has rows only for what it adopted from the tree and, once it leaves, what a feed
    gives it then (as EagleDrafter's, whose rows of a prefill wait for its next draft)."""

    def __init__(self, pool):
        self.pool = pool
        self.rows: dict[str, list[int]] = {}
        self.shared: dict[str, int] = {}
        self.fed_at_release = 0

    def adopt(self, req, slots):
        self.rows[req.rid], self.shared[req.rid] = list(slots), len(slots)

    def before_leaving(self, reqs):
        pass   # fed one by one in rows_to_cache

    def rows_to_cache(self, req, start, end, finishing):
        rows = self.rows.setdefault(req.rid, [])
        assert start == len(rows) == self.shared.get(req.rid, 0)
        if not finishing:
            return []
        rows.extend(self.pool.slots.alloc(end - start))
        self.fed_at_release += end - start
        return rows[start:end]

    def share(self, req, start, slots, cached):
        own = self.rows[req.rid][start:start + len(slots)]
        assert own[cached:] == slots[cached:]   # past what another request cached first: its own rows
        self.pool.slots.free([slot for slot, tree in zip(own[:cached], slots) if slot != tree])
        self.rows[req.rid][start:start + len(slots)] = slots
        self.shared[req.rid] = start + len(slots)

    def detach(self, req):
        rows = self.rows.pop(req.rid, [])
        self.pool.slots.free(rows[self.shared.pop(req.rid, 0):])

    def own_slots(self):
        return {rid: rows[self.shared.get(rid, 0):] for rid, rows in self.rows.items()}

    def cached_rows(self, req):
        return self.rows.get(req.rid, [])[:self.shared.get(req.rid, 0)]


def test_head_rows_join_the_cache_at_release_and_nobody_waits_for_a_chunk():
    """A request sharing a prompt that another computes in this very step is not held back
    (the chunk is not cached before the other's release: its head has no rows for it); once
    the first leaves, its prompt and output are cached with the head's rows, a later request
    adopts them, and the ledger's check (which covers the head's pool) holds at every step."""
    from specserve.kv.pool import KVPool
    from specserve.request.req import ReqState
    from tests.test_prefix_cache import SYSTEM, _req, _run_all, _scheduler, _step
    scheduler = _scheduler(chunk=128)
    head_pool = KVPool(1, 1, 2, 256, max_requests=8, max_context=512, dtype=torch.float32, device=torch.device("cpu"))
    head = UnfedHead(head_pool)
    scheduler.kv.keep_draft_rows(head, head_pool)
    first, second = _req("a", SYSTEM + [201]), _req("b", SYSTEM + [301])
    scheduler.add(first)
    scheduler.add(second)
    batch = _step(scheduler)
    assert batch.reqs == [first, second] and second.state is ReqState.RUNNING   # both compute the prefix
    assert scheduler.cached_slots() == 0                                           # nothing cached yet
    _run_all(scheduler)
    # each left with its prompt and output but its last token cached, keyed on token pairs: the
    # second shares the first's pairs up to the one that ends the system prompt
    assert scheduler.cached_slots() == (len(first.all_ids) - 1) + (len(second.all_ids) - len(SYSTEM))
    assert head.fed_at_release == len(first.all_ids) - 1 + len(second.all_ids) - 1   # the second's duplicates freed
    assert sorted(tree_rows := list(scheduler.kv.tree.held_slots(draft=True))) == sorted(set(tree_rows))
    assert len(tree_rows) + head_pool.slots.available() == head_pool.size
    third = _req("c", SYSTEM + [201, 100, 101, 102, 103])
    scheduler.add(third)
    _step(scheduler)
    assert third.cached_tokens == len(SYSTEM) + 1 + 3 and len(head.cached_rows(third)) == third.cached_tokens
    _run_all(scheduler)
    assert scheduler.flush_cache() > 0 and head_pool.slots.available() == head_pool.size


def test_a_parked_request_is_released_when_its_next_turn_waits():
    """With head rows in the cache a finished request is parked, not released, while others run;
    a waiting request that continues it (a chat's next turn, whose answer may be tokenized
    otherwise) releases it before admission, so it finds the first turn cached. One that does
    not continue it leaves it parked."""
    from specserve.kv.pool import KVPool
    from tests.test_prefix_cache import SYSTEM, _req, _scheduler, _step
    scheduler = _scheduler(chunk=128, size=512)
    head_pool = KVPool(1, 1, 2, 512, max_requests=8, max_context=512, dtype=torch.float32, device=torch.device("cpu"))
    scheduler.kv.keep_draft_rows(UnfedHead(head_pool), head_pool)
    short, long = _req("a", SYSTEM + [201], max_new_tokens=2), _req("b", [7, 8, 9], max_new_tokens=40)
    scheduler.add(short)
    scheduler.add(long)
    while short.state is not ReqState.FINISHED:
        _step(scheduler)
    assert scheduler.parked.reqs == [short] and short.kv_slots and scheduler.cached_slots() == 0
    stranger = _req("c", [50, 51, 52], max_new_tokens=40)
    scheduler.add(stranger)
    _step(scheduler)
    assert scheduler.parked.reqs == [short] and stranger.cached_tokens == 0
    answer_again = short.output_ids[:1] + [999]   # the answer's text tokenized again: its tokens may differ
    next_turn = _req("d", short.prompt_ids + answer_again + [301, 302])
    scheduler.add(next_turn)
    _step(scheduler)
    assert scheduler.parked.reqs == [] and not short.kv_slots
    while next_turn.state is ReqState.WAITING:   # admitted at the next prefill turn
        _step(scheduler)
    assert next_turn.cached_tokens == len(short.prompt_ids)   # up to where the answer's tokens differ
