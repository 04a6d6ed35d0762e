"""STANDALONE through the Engine: greedy output equals plain decoding at every draft length
and batch size, whatever the draft model (a noisy copy of the target that drafts well but
not always, the target itself, which drafts perfectly, a model of another architecture);
the draft model's own KV pool gives back every slot however a request ends (finish, a stop
inside an accepted chain, abort, preemption, a full draft pool, a failing draft step); the
flags and the server's command line.

Models are tiny random-weight Hugging Face directories with one tokenizer (fast on a CPU).
"""
from __future__ import annotations

import httpx
import pytest
import torch

from specserve.args import ServerArgs
from lab.server_overhead import wait_healthy
from specserve.errors import ArgumentError, NotSupportedError
from tests.server_process import free_port, start_server, stop_server
from tests.spec_fixtures import make_tiny_directory, plain_greedy_outputs, tiny_engine, truncated_mid_path, \
    wait_until_all_kv_is_free
from tests.standalone_fixtures import make_noisy_draft, standalone_args, wait_until_draft_kv_is_free
from tests.test_spec_kv import PROMPTS

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("standalone-target")
    make_tiny_directory(path, "llama", seed=1)
    return path


@pytest.fixture(scope="module")
def noisy_draft(target_dir, tmp_path_factory):
    """Accepts 2-4 of 5 tokens per step on average, every length from 1 to 5 occurring."""
    return make_noisy_draft(target_dir, tmp_path_factory.mktemp("standalone-noisy"), sigma=0.02)


@pytest.fixture(scope="module")
def plain_outputs(target_dir) -> list[list[int]]:
    return plain_greedy_outputs(target_dir, PROMPTS, GREEDY)


def accept_histogram(outputs: list[dict]) -> dict[int, int]:
    total: dict[int, int] = {}
    for out in outputs:
        for length, count in out["meta_info"]["spec_accept_histogram"].items():
            total[length] = total.get(length, 0) + count
    return total


# ---- greedy identity ----
@pytest.mark.parametrize("num_steps", [1, 2, 4])
def test_greedy_output_equals_plain_decoding(target_dir, noisy_draft, plain_outputs, num_steps):
    with tiny_engine(target_dir, **standalone_args(noisy_draft, num_steps)) as engine:
        outputs = []
        for batch_size in (1, 3, 6):
            out = engine.generate(input_ids=PROMPTS[:batch_size], sampling_params=GREEDY)
            assert [o["output_ids"] for o in out] == plain_outputs[:batch_size], f"batch {batch_size}"
            outputs += out
        histogram = accept_histogram(outputs)
        # rejected at once, and all accepted (the next chain then feeds d_K first): both happen
        assert 1 in histogram and num_steps + 1 in histogram, histogram
        wait_until_draft_kv_is_free(engine)
        wait_until_all_kv_is_free(engine)


def test_the_target_as_its_own_draft_accepts_every_draft(target_dir, plain_outputs):
    with tiny_engine(target_dir, **standalone_args(target_dir, 3)) as engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == plain_outputs
        # 40 tokens: the prefill's, nine chains of 3 drafts + a bonus, and a last step cut to 3 tokens
        assert all(o["meta_info"]["spec_accept_histogram"] == {4: 9, 3: 1} for o in outputs)
        wait_until_draft_kv_is_free(engine)


def test_the_adaptive_draft_length_keeps_the_output(target_dir, noisy_draft, plain_outputs):
    """Steps cut the chain to a tier, plain steps run between drafted ones and probe now and
    then: the draft caches lag and catch up; output and accounting stay exact."""
    with tiny_engine(target_dir, **standalone_args(noisy_draft, 4, adaptive=True)) as engine:
        for _ in range(2):
            outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outputs] == plain_outputs
        wait_until_draft_kv_is_free(engine)
        wait_until_all_kv_is_free(engine)


def test_a_draft_model_of_another_architecture(target_dir, plain_outputs, tmp_path):
    make_tiny_directory(tmp_path, "qwen2", seed=7)   # same vocabulary size, its own random weights
    with tiny_engine(target_dir, **standalone_args(tmp_path, 2)) as engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == plain_outputs
        wait_until_draft_kv_is_free(engine)


def test_drafts_are_the_draft_models_own_greedy_continuation(target_dir, noisy_draft):
    """Whatever the last verify step accepted (nothing, some, every draft), the chain drafts
    what the draft model alone continues the request's tokens with: the draft KV that was
    kept, the catch-up and the chain's positions are right."""
    import transformers
    num_steps = 4
    with tiny_engine(target_dir, **standalone_args(noisy_draft, num_steps)) as engine:
        drafter, proposals = engine.core.drafter, []
        propose = drafter.propose

        def spy(reqs, max_nodes):
            proposal, num_nodes = propose(reqs, max_nodes)
            proposals.extend((r.prompt_ids + r.output_ids, proposal.tokens[i, 1:].tolist())
                             for i, (r, n) in enumerate(zip(reqs, num_nodes)) if n > 1)
            return proposal, num_nodes
        drafter.propose = spy
        outputs = engine.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)
    assert len(set(accept_histogram(outputs))) == num_steps + 1     # every accept length occurred
    draft = transformers.AutoModelForCausalLM.from_pretrained(noisy_draft).eval()
    for context, drafts in proposals[::3]:
        expected = draft.generate(torch.tensor([context]), max_new_tokens=num_steps, do_sample=False,
                                  attention_mask=torch.ones(1, len(context), dtype=torch.long))
        assert drafts == expected[0, len(context):].tolist(), f"context of {len(context)} tokens"


# ---- the draft pool, however a request ends ----
def test_every_way_to_finish_frees_the_draft_pool(target_dir, noisy_draft, plain_outputs):
    with tiny_engine(target_dir, **standalone_args(noisy_draft, 4)) as engine:
        reference = plain_outputs[0]
        stop_token = next(t for i, t in enumerate(reference) if i >= 12 and t not in reference[:i])
        params = [
            GREEDY,
            {**GREEDY, "stop_token_ids": [stop_token]},                 # a stop inside an accepted chain
            {**GREEDY, "max_new_tokens": 1},
            {**GREEDY, "max_new_tokens": 2},
            {**GREEDY, "stop_token_ids": [reference[2]], "min_new_tokens": 20},
            {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True, "seed": 3},
            {"temperature": 0.7, "top_k": 5, "max_new_tokens": 33, "ignore_eos": True},
            {**GREEDY, "repetition_penalty": 1.3, "max_new_tokens": 25},
        ]
        outputs = engine.generate(input_ids=[PROMPTS[0]] * len(params), sampling_params=params)
        assert outputs[0]["output_ids"] == reference
        cut = outputs[1]
        assert cut["output_ids"][-1] == stop_token and cut["meta_info"]["finish_reason"]["type"] == "stop"
        assert cut["output_ids"] == reference[:len(cut["output_ids"])]
        assert [len(o["output_ids"]) for o in outputs[2:4]] == [1, 2]
        assert len(outputs[4]["output_ids"]) >= 20
        assert [len(o["output_ids"]) for o in outputs[5:]] == [40, 33, 25]
        wait_until_draft_kv_is_free(engine)
        wait_until_all_kv_is_free(engine)
        assert any(truncated_mid_path(engine.generate(input_ids=PROMPTS[0], sampling_params={
            **GREEDY, "stop_token_ids": [t]})) for t in reference[12:20])    # some stop cuts a chain
        wait_until_draft_kv_is_free(engine)


def test_abort_mid_stream_frees_the_draft_pool(target_dir, noisy_draft):
    with tiny_engine(target_dir, **standalone_args(noisy_draft, 4)) as engine:
        stream = engine.generate(input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 400},
                                 stream=True, rid="victim")
        received = 0
        for chunk in stream:
            received += len(chunk["output_ids"])
            if received >= 8:
                break
        stream.close()      # the generator's cleanup aborts the request
        wait_until_draft_kv_is_free(engine)
        wait_until_all_kv_is_free(engine)


def test_preemption_releases_the_draft_cache_and_resume_rebuilds_it(target_dir, noisy_draft, plain_outputs):
    # 160 cache tokens cannot hold six requests of 24-42 + 40 tokens; each one alone fits
    with tiny_engine(target_dir, **standalone_args(noisy_draft, 4), max_total_tokens=160) as engine:
        drafter = engine.core.drafter
        released = []
        preempted = drafter.preempted

        def spy(req):
            preempted(req)
            released.append(req.rid not in drafter.kv.sequences)
        drafter.preempted = spy
        for _ in range(2):
            outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outputs] == plain_outputs
            assert sum(o["meta_info"]["preemptions"] for o in outputs) > 0
            wait_until_draft_kv_is_free(engine)
            wait_until_all_kv_is_free(engine)
        assert released and all(released)
        assert max(accept_histogram(outputs)) == 5     # resumed requests draft again


def test_a_full_draft_pool_means_no_drafts_for_that_step(target_dir, noisy_draft, plain_outputs):
    with tiny_engine(target_dir, **standalone_args(noisy_draft, 4)) as engine:
        slots = engine.core.drafter.runner.pool.slots
        alloc, calls = slots.alloc, []

        def every_third_refused(count):
            calls.append(count)
            return None if len(calls) % 3 == 0 else alloc(count)
        slots.alloc = every_third_refused
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == plain_outputs
        wait_until_draft_kv_is_free(engine)
        assert len(calls) >= 3 and max(accept_histogram(outputs)) > 1


def test_a_failing_draft_step_fails_nobody_and_leaks_nothing(target_dir, noisy_draft, plain_outputs):
    """A transient failure inside the draft chain: the engine retries the step's requests one
    by one; the draft state of the failed step was dropped, so it is rebuilt by a catch-up."""
    with tiny_engine(target_dir, **standalone_args(noisy_draft, 4)) as engine:
        runner = engine.core.drafter.runner
        chain, calls = runner.chain, []

        def fails_once(rows, sample):
            calls.append(len(rows))
            if len(calls) == 3:
                raise RuntimeError("draft chain failed")
            return chain(rows, sample)
        runner.chain = fails_once
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == plain_outputs
        wait_until_draft_kv_is_free(engine)
        wait_until_all_kv_is_free(engine)


# ---- flags ----
def test_flags_are_checked(target_dir):
    with pytest.raises(ArgumentError, match="speculative_draft_model_path"):
        ServerArgs(speculative_algorithm="STANDALONE")
    with pytest.raises(NotSupportedError, match="speculative_eagle_topk"):
        ServerArgs(**standalone_args(target_dir, 3), speculative_eagle_topk=4)
    with pytest.raises(ArgumentError, match="speculative_num_steps"):
        ServerArgs(**standalone_args(target_dir, 0))
    args = ServerArgs(speculative_algorithm="standalone", speculative_draft_model_path=str(target_dir))
    assert (args.speculative, args.speculative_steps, args.speculative_verify_size) == ("STANDALONE", 3, 4)


def test_a_draft_model_with_another_vocabulary_is_refused(target_dir, tmp_path):
    make_tiny_directory(tmp_path, "llama", vocab_size=300, seed=2)
    with pytest.raises(ArgumentError, match="speculative_draft_model_path.*vocabulary"):
        tiny_engine(target_dir, **standalone_args(tmp_path, 2))


def test_the_server_takes_sglang_flags(target_dir, noisy_draft, plain_outputs):
    port = free_port()
    proc = start_server(port, "--model-path", str(target_dir), "--speculative-algorithm", "STANDALONE",
                        "--speculative-draft-model-path", noisy_draft, "--speculative-num-steps", "3",
                        "--speculative-num-draft-tokens", "4", "--speculative-disable-adaptive")
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base_url)
        out = httpx.post(base_url + "/generate", timeout=60, json={
            "input_ids": PROMPTS[:3], "sampling_params": GREEDY}).json()
        assert [o["output_ids"] for o in out] == plain_outputs[:3]
        info = httpx.get(base_url + "/get_server_info").json()
        assert info["speculative_algorithm"] == "STANDALONE" and info["speculative_num_steps"] == 3
        assert info["internal_states"][0]["avg_spec_accept_length"] > 1.5
    finally:
        stop_server(proc)


def test_a_proposal_that_feeds_a_prompt_is_the_draft_models_prefill(target_dir, noisy_draft):
    """ProposalHints.took_prefill: once a request's first chain has fed the draft model its
    prompt, the drafter says so once; the chains after it feed decoded tokens only."""
    with tiny_engine(target_dir, **standalone_args(noisy_draft, 2)) as engine:
        drafter, calls = engine.core.drafter, []
        propose = drafter.propose

        def watched(reqs, max_nodes):
            out = propose(reqs, max_nodes)
            calls.append(drafter.took_prefill())
            return out
        drafter.propose = watched
        engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
        assert len(calls) >= 3 and calls[0] and not any(calls[1:]), calls
        wait_until_draft_kv_is_free(engine)
