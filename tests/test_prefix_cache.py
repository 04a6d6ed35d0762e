"""The prefix cache without a model: the radix tree (match, split, insert, locks, LRU
eviction) against a reference, and the scheduler stepped by hand on a tiny KV pool, with
the accounting invariant (every slot free, cached, or held by one running request, and
every table row naming its request's slots) checked after every step.
The same with a real model, outputs compared with and without the cache:
test_prefix_cache_engine.py."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.engine.scheduler import SHARED_PREFIX_MIN, Scheduler
from specserve.kv.pool import KVPool, SlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.request.req import Batch, Req, ReqState
from specserve.request.sampling_params import SamplingParams


# ---- the radix tree ----
def _tree(size: int = 64) -> tuple[RadixCache, SlotAllocator]:
    allocator = SlotAllocator(size)
    return RadixCache(allocator), allocator


def _cache(tree: RadixCache, allocator: SlotAllocator, tokens: list[int]) -> list[int]:
    """Inserts `tokens` with fresh slots (freeing those of an already cached prefix); returns the tree's slots."""
    slots = allocator.alloc(len(tokens))
    inserted = tree.insert(tokens, slots)
    allocator.free(slots[:inserted.cached])
    return inserted.slots


def test_match_splits_a_node_and_insert_keeps_the_first_copy():
    tree, allocator = _tree()
    first = _cache(tree, allocator, [1, 2, 3, 4])
    assert tree.match_length([1, 2, 3, 9]) == 3 and len(tree.root.children) == 1   # a look changes nothing
    slots, node = tree.match_prefix([1, 2, 3, 9])
    assert slots == first[:3] and node.key == [1, 2, 3] and node.children[4].key == [4]   # split at the match
    second = _cache(tree, allocator, [1, 2, 5])
    assert second[:2] == first[:2] and second[2] not in first       # the cached prefix kept its slots
    assert sorted(tree.held_slots()) == sorted(first + second[2:])
    assert tree.size == 5 and tree.evictable_size == 5 and allocator.available() == 64 - 5
    assert tree.match_prefix([7])[0] == [] and tree.match_prefix([1, 2, 5, 6])[0] == second
    with pytest.raises(ValueError, match="3 tokens but 2 slots"):
        tree.insert([1, 2, 3], [9, 9])


def test_locked_paths_survive_eviction_and_unlocked_leaves_go_least_recently_used_first():
    tree, allocator = _tree()
    old, middle, new = (_cache(tree, allocator, [k, k + 1, k + 2]) for k in (10, 20, 30))
    locked = _cache(tree, allocator, [40, 41])
    _, node = tree.match_prefix([40, 41])
    tree.lock(node)
    tree.match_prefix([10, 11, 12])                  # `old` is used again: `middle` is now the oldest
    assert tree.locked_size == 2 and tree.evictable_size == 9
    assert tree.evict(1) == 3                        # a whole leaf goes
    assert tree.match_length([20, 21, 22]) == 0 and tree.match_length([10, 11, 12]) == 3
    assert tree.clear() == 6                         # everything unlocked
    assert sorted(tree.held_slots()) == sorted(locked) and allocator.available() == 64 - 2
    assert set(old + middle + new) <= set(allocator.free_list())
    tree.unlock(node)
    assert tree.evictable_size == 2 and tree.evict(100) == 2 and tree.size == 0
    with pytest.raises(RuntimeError, match="not locked"):
        tree.unlock(node)


def test_evicting_a_leaf_exposes_its_parent():
    tree, allocator = _tree()
    _cache(tree, allocator, [1, 2, 3, 4])
    _cache(tree, allocator, [1, 2, 7])              # [1, 2] is now an inner node with two leaves
    assert tree.evict(4) == 5                        # both leaves (3 tokens), then the parent they exposed
    assert tree.size == 0 and allocator.available() == 64


def test_random_operations_agree_with_a_reference():
    """Every cached prefix maps to the slot its first insert gave it, for as long as it stays
    cached; matches return exactly the cached prefix; slots are never held twice or lost."""
    rng = random.Random(0)
    tree, allocator = _tree(size=200)
    first_slot: dict[tuple[int, ...], int] = {}     # token prefix -> the slot of its last token
    locked = []
    for _ in range(400):
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
        action = rng.random()
        if action < 0.45 and allocator.available() >= len(tokens):
            for i, slot in enumerate(_cache(tree, allocator, tokens)):
                first_slot.setdefault(tuple(tokens[:i + 1]), slot)
        elif action < 0.6:
            _, node = tree.match_prefix(tokens)
            tree.lock(node)
            locked.append(node)
        elif action < 0.75 and locked:
            tree.unlock(locked.pop(rng.randrange(len(locked))))
        elif action < 0.85:
            tree.evict(rng.randint(1, 20))
        held = set(tree.held_slots())
        present = [p for p in (tuple(tokens[:i + 1]) for i in range(len(tokens)))
                   if first_slot.get(p) in held]
        expected = [first_slot[p] for p in present[:next((i for i, p in enumerate(present) if len(p) != i + 1),
                                                         len(present))]]
        assert tree.match_prefix(tokens)[0] == expected
        assert len(held) == tree.size and held.isdisjoint(allocator.free_list())
        assert len(held) + allocator.available() == 200
        for prefix in [p for p, s in first_slot.items() if s not in held]:
            del first_slot[prefix]   # evicted: a later insert may cache it with another slot


# ---- the scheduler, stepped by hand ----
def _scheduler(size: int = 256, chunk: int = 64, policy: str = "fcfs", max_running: int = 8) -> Scheduler:
    pool = KVPool(1, 1, 2, size, max_requests=8, max_context=512, dtype=torch.float32, device=torch.device("cpu"))
    return Scheduler(pool, max_running, chunk, prefix_cache=True, schedule_policy=policy)


def _req(rid: str, prompt: list[int], max_new_tokens: int = 4) -> Req:
    return Req(rid=rid, prompt_ids=list(prompt), params=SamplingParams(), detokenizer=None, seed=0,
               stop_ids=frozenset(), max_new_tokens=max_new_tokens)


def _step(scheduler: Scheduler, check: bool = True) -> Batch | None:
    """One step without a model: KV for every token fed, a token per sampling request, finish at
    max_new_tokens; the accounting is checked before and after."""
    if check:
        scheduler.check_kv()
    batch = scheduler.schedule()
    if batch is None:
        return None
    lens = batch.extend_lens if batch.is_extend else [1] * batch.size
    samples = batch.samples if batch.is_extend else [True] * batch.size
    for req, length, sample in zip(batch.reqs, lens, samples):
        scheduler.append_kv([req], [scheduler.alloc_slots(length)])
        if sample:
            req.output_ids.append(100 + len(req.output_ids))
            if len(req.output_ids) >= req.max_new_tokens:
                scheduler.finish(req, {"type": "length"})
    if check:
        scheduler.check_kv()
    return batch


def _run_all(scheduler: Scheduler, limit: int = 300, check: bool = True) -> None:
    for _ in range(limit):
        if not scheduler.has_work():
            if check:
                scheduler.check_kv()
            return
        _step(scheduler, check)
    raise AssertionError("the requests never finished")


SYSTEM = list(range(1, 81))   # an 80-token shared prefix


def test_a_request_computes_only_what_the_cache_lacks():
    scheduler = _scheduler()
    first = _req("a", SYSTEM + [201, 202])
    scheduler.add(first)
    _run_all(scheduler)
    assert scheduler.cached_slots() == 82 + 3           # prompt + the outputs whose KV was written
    second = _req("b", SYSTEM + [301, 302, 303])
    scheduler.add(second)
    batch = _step(scheduler)
    assert second.cached_tokens == 80 and batch.extend_lens == [3]
    again = _req("c", SYSTEM + [201, 202])               # the same prompt: all but its last token is cached
    scheduler.add(again)
    _run_all(scheduler)
    assert again.cached_tokens == 81


def test_a_prefix_two_requests_computed_at_once_is_kept_once():
    """Shorter than SHARED_PREFIX_MIN, a shared prefix is computed by both requests of a step;
    the second to be cached switches to the first's copy (table row rewritten), freeing its own."""
    scheduler = _scheduler()
    shared = SYSTEM[:SHARED_PREFIX_MIN - 4]
    first, second = _req("a", shared + [201, 202]), _req("b", shared + [301, 302])
    scheduler.add(first)
    scheduler.add(second)
    assert _step(scheduler).reqs == [first, second]          # both computed the shared tokens
    assert first.kv_slots[:len(shared)] != second.kv_slots[:len(shared)]
    _step(scheduler)                                        # caches both, then decodes
    assert first.kv_slots[:len(shared)] == second.kv_slots[:len(shared)]
    assert scheduler.cached_slots() == len(shared) + 2 + 2
    _run_all(scheduler)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_a_waiting_request_waits_a_step_for_a_prefix_another_is_computing(policy):
    scheduler = _scheduler(chunk=128, policy=policy)
    first, second = _req("a", SYSTEM + [201]), _req("b", SYSTEM + [301])
    other = _req("c", [900 + i for i in range(8)])
    for req in (first, second, other):
        scheduler.add(req)
    batch = _step(scheduler)
    # b would compute the 80 tokens a computes now: it waits (fcfs: c waits behind it; lpm: c goes)
    assert batch.reqs == ([first] if policy == "fcfs" else [first, other]) and batch.extend_lens[0] == 81
    while second.state is ReqState.WAITING:
        batch = _step(scheduler)
    assert batch.is_extend and batch.reqs[0] is second and batch.extend_lens[0] == 1
    assert second.cached_tokens == 80
    _run_all(scheduler)


def test_lpm_admits_the_longest_cached_prefix_first():
    orders = {}
    for policy in ("fcfs", "lpm"):
        scheduler = _scheduler(policy=policy, max_running=1)
        scheduler.add(_req("warm", SYSTEM + [1]))
        _run_all(scheduler)
        unrelated, sharing = _req("unrelated", [900 + i for i in range(40)]), _req("sharing", SYSTEM + [2])
        scheduler.add(unrelated)
        scheduler.add(sharing)
        orders[policy] = [_step(scheduler).reqs[0].rid]
        _run_all(scheduler)
    assert orders == {"fcfs": ["unrelated"], "lpm": ["sharing"]}


def test_a_prompt_cached_chunk_by_chunk_stays_one_node():
    scheduler = _scheduler(chunk=16)
    req = _req("r", SYSTEM, max_new_tokens=3)
    scheduler.add(req)
    while req.kv_len < 80:
        _step(scheduler)
        assert len(scheduler.kv.tree.root.children) <= 1
    _step(scheduler)    # caches the last chunk, and decodes
    (node,) = scheduler.kv.tree.root.children.values()
    assert node.key == SYSTEM and not node.children and node.lock_count == 1 and req.cache_node is node
    _run_all(scheduler)  # the finished request's outputs join the same node
    (node,) = scheduler.kv.tree.root.children.values()
    assert node.key == req.all_ids[:-1] and node.lock_count == 0


def test_chunked_prefill_caches_each_chunk_and_eviction_makes_room():
    scheduler = _scheduler(size=200, chunk=32)
    for i in range(6):   # distinct 90-token prompts: the pool holds two of them cached
        scheduler.add(_req(f"r{i}", [1000 * (i + 1) + t for t in range(90)]))
        scheduler.check_kv()
        _run_all(scheduler)
        assert scheduler.cached_slots() <= 200
    assert scheduler.kv.tree.match_length([6000 + t for t in range(90)]) == 90    # the newest survives
    assert scheduler.kv.tree.match_length([1000 + t for t in range(90)]) == 0     # the oldest was evicted
    assert scheduler.available_slots() == 200 and scheduler.flush_cache() > 0 and scheduler.cached_slots() == 0


def test_preempting_a_request_whose_prefix_others_hold():
    scheduler = _scheduler(size=120, chunk=128)
    reqs = [_req(f"r{i}", SYSTEM + [500 + i], max_new_tokens=20) for i in range(3)]
    for req in reqs:
        scheduler.add(req)
    preempted_with_others_running = False
    for _ in range(300):
        if not scheduler.has_work():
            break
        _step(scheduler)
        victims = [r for r in reqs if r.preemptions and r.state is ReqState.WAITING]
        if victims and scheduler.running:
            # the shared prefix stays cached and locked by those still running
            assert scheduler.kv.tree.match_length(SYSTEM) == 80 and scheduler.kv.tree.locked_size >= 80
            preempted_with_others_running = True
    assert preempted_with_others_running and not scheduler.has_work()
    assert all(len(r.output_ids) == 20 for r in reqs)
    assert [r.cached_tokens for r in reqs] == [0, 80, 80]   # counted at the first admission only
    scheduler.check_kv()


def test_abort_frees_what_the_request_held_alone():
    scheduler = _scheduler(chunk=32)
    prefilling, decoding = _req("p", SYSTEM + [1]), _req("d", [700 + i for i in range(10)], max_new_tokens=50)
    scheduler.add(decoding)
    _step(scheduler)
    _step(scheduler)
    scheduler.add(prefilling)
    while prefilling.kv_len < 40:
        _step(scheduler)
    scheduler.abort(prefilling)    # its finished chunks were cached; they stay, unheld
    scheduler.abort(decoding)      # its decoded tokens are freed, its cached prompt stays
    scheduler.check_kv()
    assert scheduler.kv.tree.locked_size == 0 and scheduler.available_slots() == 256
    assert scheduler.kv.tree.match_length(SYSTEM) >= 32 and scheduler.kv.tree.match_length(decoding.prompt_ids) == 10


def test_drafts_a_stop_cut_off_are_freed_not_cached():
    """A verify step commits KV for a whole accepted path, then a stop token in its middle
    ends the request: only KV of tokens the request kept may be cached."""
    scheduler = _scheduler()
    req = _req("r", SYSTEM[:20], max_new_tokens=50)
    scheduler.add(req)
    _step(scheduler)
    scheduler.append_kv([req], [scheduler.alloc_slots(4)])   # root + 3 accepted drafts
    req.output_ids.append(42)                                  # ... but a stop came after the first
    scheduler.finish(req, {"type": "stop"})
    scheduler.check_kv()
    assert scheduler.cached_slots() == req.num_tokens == 22


def test_trim_and_the_uncached_warm_up_leave_the_cache_alone():
    scheduler = _scheduler(chunk=128)
    req = _req("r", SYSTEM)
    scheduler.add(req)
    _step(scheduler)
    _step(scheduler)   # the prompt is cached now, under the request's lock
    assert req.cached_len == 80
    scheduler.append_kv([req], [scheduler.alloc_slots(1)])    # KV of a token the failed step never committed
    scheduler.trim_kv(req)
    scheduler.check_kv()
    _run_all(scheduler)
    before = scheduler.cached_slots()
    scheduler.add(_req("x", [1]))
    with pytest.raises(RuntimeError, match="no request"):
        with scheduler.without_prefix_cache():
            pass
    scheduler.abort(scheduler.waiting[0])
    with scheduler.without_prefix_cache():
        scheduler.add(_req("warm", SYSTEM))
        _run_all(scheduler, check=False)   # the cache's slots are out of this ledger's sight meanwhile
        assert scheduler.kv.tree is None
    assert scheduler.cached_slots() == before and scheduler.kv.tree.match_length(SYSTEM) == 80
    scheduler.check_kv()
