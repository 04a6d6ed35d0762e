"""FR-Spec token maps (--speculative-token-map): the builder keeps a toy corpus's most
frequent ids in SGLang's file format; a head restricted to a map drafts only its tokens on
chain and tree paths (trees equal a from-scratch reference of the restricted head, sampled
drafts put no q outside it) and greedy output stays plain decoding's, for EAGLE and EAGLE3;
a bad file, ids out of range, a map that leaves no draft token, or the flag without an
EAGLE algorithm is one clear error naming the field.

Targets: tests/test_eagle_drafter.py's 16-token model with trained heads over half its
vocabulary, and a 256-token random model with a random head over all of it (SGLang's
EAGLE-2 case: the map slices the whole lm_head).
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from specserve.args import ServerArgs
from specserve.build_token_map import conversation_text, count_tokens
from specserve.build_token_map import main as build_token_map
from specserve.errors import ArgumentError, NotSupportedError
from specserve.speculative.heads.eagle_checkpoint import load_head, save_head
from specserve.speculative.heads.token_map import hot_token_ids, read_token_map, write_token_map
from specserve.speculative.model_drafters import fused_chain
from specserve.training.eagle_trainer import build_head
from tests.spec_fixtures import LETTERS, ProposeSpy, make_tiny_directory, plain_greedy_outputs, tiny_engine
from tests.test_draft_ahead import ahead_on
from tests.test_eagle_drafter import NUM_STEPS, eagle_args, head_dir, target  # noqa: F401
from tests.test_eagle_drafter_tree import check_trees

EOS = 2          # the letter tokenizer's </s>, the tiny models' eos_token_id
LETTER = {letter: 3 + i for i, letter in enumerate(LETTERS)}   # a..m are ids 3..15


# ---- the map file and the builder ----
def test_the_builder_keeps_a_toy_corpus_most_frequent_ids_in_sglangs_format(tmp_path):
    make_tiny_directory(tmp_path / "model", vocab_size=16, tokenizer="letter")
    # every turn counts (human and gpt); other speakers and empty turns do not
    conversations = [{"conversations": [{"from": "human", "value": "a a a b b c"},
                                       {"from": "gpt", "value": "a a a a a b b b b c c c d d d e e f"},
                                       {"from": "system", "value": "m m m m m m m m m m m m m m m"},
                                       {"from": "human", "value": "  "}]},
                     {"conversations": [{"from": "human", "value": "b c d e g"}, {"from": "gpt", "value": "a c"}]}]
    corpus = tmp_path / "sharegpt.json"
    corpus.write_text(json.dumps(conversations))
    frequency = ["a", "b", "c", "d", "e"]           # a 9, b 7, c 6, d 4, e 3, f 1, g 1
    for size, expected in ((3, ["a", "b"]), (6, frequency)):
        out = tmp_path / f"map{size}.pt"
        ids = build_token_map(["--model", str(tmp_path / "model"), "--size", str(size), "--out", str(out),
                               "--dataset-path", str(corpus)])
        # most frequent first; the eos (never in the text) takes the least frequent one's place
        assert ids == [LETTER[x] for x in expected] + [EOS]
        raw = torch.load(out, weights_only=True)          # what SGLang's load_token_map reads
        assert isinstance(raw, list) and torch.tensor(raw, dtype=torch.int64).tolist() == ids
        assert read_token_map(str(out), vocab_size=16).tolist() == ids
    with pytest.raises(ArgumentError, match="--size must be in \\[1, 16\\]"):
        build_token_map(["--model", str(tmp_path / "model"), "--size", "17", "--out", str(out),
                         "--dataset-path", str(corpus)])


def test_hot_ids_rank_by_count_then_id_and_keep_the_always_ids():
    counts = torch.tensor([0, 5, 2, 5, 0, 9])
    assert hot_token_ids(counts, 3) == [5, 1, 3]
    assert hot_token_ids(counts, 3, always=[4]) == [5, 1, 4]           # in the place of the least frequent
    assert hot_token_ids(counts, 3, always=[1, 1]) == [5, 1, 3]        # already in: nothing changes
    assert hot_token_ids(counts, 6) == [5, 1, 3, 2, 0, 4]              # unseen ids fill the map, lower first
    with pytest.raises(ValueError, match="size"):
        hot_token_ids(counts, 7)


def test_counting_reads_the_chat_template(smollm2_path):
    """A chat model's text is counted as it reads it: turn markers and the end-of-turn token too."""
    from specserve.model.loader import load_tokenizer
    tokenizer = load_tokenizer(smollm2_path)
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    text = conversation_text(messages, tokenizer)
    counts = count_tokens([tokenizer(text, add_special_tokens=False).input_ids], len(tokenizer))
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert int(counts[im_end]) == int(counts[im_start]) >= 2 and im_end == EOS


# ---- drafting with a map ----
@pytest.fixture(scope="module")
def frequent_answer_map(target, tmp_path_factory) -> tuple[str, set[int]]:
    """The 4 most frequent answer tokens of the training conversations (and the eos)."""
    _, _, train, _ = target
    counts = count_tokens((c.tokens[c.prompt_len:] for c in train), 16)
    path = str(tmp_path_factory.mktemp("map") / "map.pt")
    write_token_map(path, hot_token_ids(counts, 5, always=[EOS]))
    return path, set(read_token_map(path).tolist())


@pytest.mark.parametrize("ahead", [False, True], ids=["in-order", "chained-ahead"])
def test_a_trained_head_with_the_map_drafts_only_its_tokens_and_keeps_greedy_output(target, head_dir,
                                                                                   frequent_answer_map, ahead):
    """`ahead`: as on a GPU, fused steps are chained ahead (a chained step verifies the
    pending drafts it is adopted with, which the spy records too)."""
    check_map_chains(target, head_dir, frequent_answer_map, ahead=ahead)


def check_map_chains(target, head_dir, frequent_answer_map, ahead: bool = False, **engine_args) -> None:
    """With the map, chains draft only its tokens; without it, others too (the check can
    fail); both give the greedy answers, and chains still get accepted. `ahead`: steps are
    launched ahead as on a GPU (tests/test_draft_ahead.py's ahead_on)."""
    path, _, _, held_out = target
    algorithm, head_path, _, _ = head_dir
    map_path, allowed = frequent_answer_map
    prompts = [c.tokens[:c.prompt_len] for c in held_out]
    greedy = {"temperature": 0.0, "max_new_tokens": 32}
    drafted = {}
    for token_map in (None, map_path):
        with tiny_engine(path, **eagle_args(algorithm, head_path, speculative_token_map=token_map),
                         **engine_args) as engine:
            if ahead:
                ahead_on(engine)
            spy = ProposeSpy(engine.core.drafter)
            outputs = engine.generate(input_ids=prompts, sampling_params=greedy)
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out]
        drafted[token_map] = Counter(t for tokens, _ in spy.trees for t in tokens[1:])
        accepted = sum(len(o["output_ids"]) - 1 for o in outputs) / sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
        assert accepted > 1.5     # the map holds the tokens that matter: chains still get accepted
    assert set(drafted[map_path]) <= allowed and sum(drafted[map_path].values()) > 100
    assert not set(drafted[None]) <= allowed


def restricted_head(head_dir, allowed: set[int]):
    """The saved head, loaded and restricted to `allowed` here (the reference for the engine's)."""
    _, head_path, head, _ = head_dir
    restricted = load_head(head_path, target_num_layers=2)
    restricted.share_embedding(head.embed_tokens.weight)
    restricted.restrict_draft_vocab(torch.tensor(sorted(allowed)))
    return restricted


@pytest.mark.parametrize("topk,steps,nodes", [(2, 3, 6), (3, 3, 10)])
def test_a_restricted_heads_trees_are_the_reference_trees_of_the_restricted_head(target, head_dir,
                                                                               frequent_answer_map, topk, steps,
                                                                               nodes):
    """The engine loads the saved head and the map; the reference drafts from the head
    restricted here, so every tree the engine verifies lies inside the map."""
    algorithm, head_path, head, extractor = head_dir
    map_path, allowed = frequent_answer_map
    restricted = restricted_head(head_dir, allowed)
    assert set(restricted.draft_vocab().tolist()) == allowed & set(head.draft_vocab().tolist())
    check_trees(target, (algorithm, head_path, restricted, extractor), topk, steps, nodes, longest_accepted=3,
                speculative_token_map=map_path)


@pytest.fixture(scope="module")
def full_vocab_target(tmp_path_factory) -> tuple[str, str, str]:
    """(target, EAGLE head over its whole 256-token vocabulary (random), a map of 64 random ids)."""
    from specserve.model.loader import load_checkpoint
    from specserve.runner.model_runner import build_model
    root = tmp_path_factory.mktemp("full-vocab")
    make_tiny_directory(root / "target", "llama", seed=1)
    checkpoint = load_checkpoint(str(root / "target"), dtype=torch.float32)
    model = build_model(checkpoint.config, checkpoint.state_dict, torch.device("cpu"), torch.float32, 512)
    torch.manual_seed(0)
    save_head(build_head(model, "EAGLE", torch.arange(256), max_positions=512), str(root / "head"))
    write_token_map(str(root / "map.pt"), torch.randperm(256, generator=torch.Generator().manual_seed(0))[:64].tolist())
    return str(root / "target"), str(root / "head"), str(root / "map.pt")


PROMPTS = [[5, 6, 7, 8, 9] * 6 + [10, 11], [20, 21, 22, 23] * 5, list(range(30, 72)), [100, 101] * 9]


@pytest.mark.parametrize("topk,nodes", [(1, 4), (3, 8)])
def test_a_full_vocabulary_eagle_head_with_the_map_drafts_only_its_tokens(full_vocab_target, topk, nodes):
    target_path, head_path, map_path = full_vocab_target
    allowed = set(read_token_map(map_path).tolist())
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    expected = plain_greedy_outputs(target_path, PROMPTS, greedy)
    for token_map in (None, map_path):
        args = eagle_args("EAGLE", head_path, speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes,
                          speculative_token_map=token_map)
        with tiny_engine(target_path, **args) as engine:
            assert engine.core.drafter.runner.head.lm_head.weight.shape[0] == (256 if token_map is None else 64)
            spy = ProposeSpy(engine.core.drafter)
            assert [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=greedy)] == expected
        drafted = {t for tokens, _ in spy.trees for t in tokens[1:]}
        assert spy.drafted_nodes > 50
        assert (drafted <= allowed) == (token_map is not None)


def test_sampled_drafts_put_no_probability_outside_the_map(full_vocab_target, monkeypatch):
    target_path, head_path, map_path = full_vocab_target
    allowed = torch.zeros(256, dtype=torch.bool)
    allowed[read_token_map(map_path)] = True
    # no q table for the fused chain: sampled drafts take the unfused chain, whose proposals carry
    # their q (the fused step draws its drafts with the same draft_chain.pick)
    monkeypatch.setattr(fused_chain, "Q_TABLE_BYTES", 0)
    with tiny_engine(target_path, **eagle_args("EAGLE", head_path, speculative_token_map=map_path)) as engine:
        drafter, q = engine.core.drafter, []
        propose = drafter.propose

        def spy(reqs, max_nodes):
            proposal, num_nodes = propose(reqs, max_nodes)
            if proposal.draft_probs is not None:
                q.append(proposal.draft_probs[[i for i, n in enumerate(num_nodes) if n > 1]].clone())
            return proposal, num_nodes
        drafter.propose = spy
        engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True})
    q = torch.cat(q)[:, :NUM_STEPS]          # (drafting rows, draft steps, vocab)
    assert len(q) > 10 and torch.allclose(q.sum(-1), torch.ones(q.shape[:2]), atol=1e-5)
    assert float(q[..., ~allowed].abs().max()) == 0.0


# ---- errors ----
def test_the_flag_needs_an_eagle_algorithm(tmp_path):
    with pytest.raises(ArgumentError, match="speculative_token_map.*EAGLE or EAGLE3.*None"):
        ServerArgs(speculative_token_map="map.pt")
    with pytest.raises(ArgumentError, match="speculative_token_map.*'STANDALONE'"):
        ServerArgs(speculative_token_map="map.pt", speculative_algorithm="STANDALONE",
                   speculative_draft_model_path=str(tmp_path))
    with pytest.raises(NotSupportedError, match="speculative_token_map"):
        ServerArgs(speculative_token_map="map.pt", speculative_algorithm="NGRAM")


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    (b"not a torch file", "not a torch.save file"),
    ({"d2t": torch.zeros(3), "t2d": torch.ones(3)}, "holds a dict with keys \\['d2t', 't2d'\\]"),
    (torch.zeros((2, 3), dtype=torch.long), "holds a 2-D int64 tensor"),
    (torch.tensor([1.0, 2.0]), "holds a 1-D float32 tensor"),
    ([1, "2"], "holds a list with non-integer items"),
    ([], "holds no token ids"),
    ([3, 4, 3], "token id 3 appears more than once"),
    ([-1, 4], "token id -1 is negative"),
    ([4, 16], "token id 16 is out of the target's vocabulary of 16 tokens"),
])
def test_a_bad_map_file_is_an_error_naming_the_field(tmp_path, content, message):
    path = tmp_path / "map.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(ArgumentError, match=f"speculative_token_map='{path}'.*{message}"):
        read_token_map(str(path), vocab_size=16)


def test_the_engine_refuses_a_map_that_does_not_fit(target, head_dir, tmp_path):
    path = target[0]
    algorithm, head_path, head, _ = head_dir
    outside = sorted(set(range(16)) - set(head.draft_vocab().tolist()))
    cases = [([3, 99], "token id 99 is out of the target's vocabulary of 16"),
             (outside, f"none of its {len(outside)} token ids is in the {algorithm} head's draft vocabulary of 8"),
             (head.draft_vocab().tolist()[:2], "speculative_eagle_topk=3 exceeds the head's draft vocabulary of 2")]
    for ids, message in cases:
        write_token_map(str(tmp_path / "map.pt"), ids)
        with pytest.raises(ArgumentError, match=message):
            tiny_engine(path, **eagle_args(algorithm, head_path, speculative_token_map=str(tmp_path / "map.pt"),
                                           speculative_eagle_topk=3, speculative_num_draft_tokens=6))
    with pytest.raises(ArgumentError, match="speculative_token_map=.*no such file"):
        tiny_engine(path, **eagle_args(algorithm, head_path, speculative_token_map=str(tmp_path / "missing.pt")))


def test_a_restricted_head_saves_and_loads_as_a_smaller_head(head_dir, tmp_path):
    _, head_path, head, _ = head_dir
    restricted = load_head(head_path, target_num_layers=2)
    keep = head.draft_vocab()[::2]
    restricted.restrict_draft_vocab(torch.cat([keep, torch.tensor([99])]))     # ids it lacks are left out
    assert restricted.config.draft_vocab_size == len(keep) and torch.equal(restricted.draft_vocab(), keep)
    assert torch.equal(restricted.t2d.nonzero().flatten(), keep)
    hidden = torch.randn(3, head.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(restricted.logits(hidden), head.logits(hidden)[:, ::2])
    save_head(restricted, str(tmp_path))
    reloaded = load_head(str(tmp_path), target_num_layers=2)
    assert reloaded.config == restricted.config and torch.equal(reloaded.draft_vocab(), keep)
