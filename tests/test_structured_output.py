"""Structured output on SmolLM2 (fp32, CPU): every constrained output parses and validates
against its schema, regex or EBNF grammar, with and without NGRAM speculation, greedy and
sampled; greedy output with speculation equals plain output under the same grammar, token
for token, with drafts accepted; a bad grammar is one ValueError naming its field, and the
engine goes on serving; a grammar request leaves its unconstrained neighbours' outputs as
they are alone."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.spec_fixtures import ngram_args, wait_until_all_kv_is_free
from tests.test_spec_greedy import plain, smol  # noqa: F401 (fixtures: SmolLM2 engines, a plain one)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
VERDICT = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["answer", "confidence"]}
INVENTORY = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "label": {"type": "string", "maxLength": 12}},
    "required": ["id", "label"]}}}, "required": ["items"]}
SCHEMAS = {"person": PERSON, "verdict": VERDICT, "inventory": INVENTORY}
REGEX = r"(yes|no), because [a-z ]{3,30}\."
EBNF = 'root ::= "Answer: " choice ("; " choice)* "."\nchoice ::= "A" | "B" | "C"'


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


# prompts that show JSON the answer may copy: n-gram drafts of it get accepted
PROMPTS = [
    chat('Copy this JSON exactly: {"name": "Alice", "age": 30, "tags": ["cat", "dog"]}'),
    chat('Here is an example: {"answer": "yes", "confidence": 0.9}. Is the sky blue? Answer in the same JSON.'),
    chat('Inventory: {"items": [{"id": 1, "label": "apple"}, {"id": 2, "label": "pear"}]}. Repeat it as JSON.'),
]
GREEDY = {"temperature": 0, "max_new_tokens": 96}
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 96}


@pytest.fixture(scope="module")
def ngram(smol):
    return smol.make(**ngram_args(6))


def constrained_requests() -> list[tuple[str, str, dict]]:
    """(kind, prompt, params): every schema on every prompt, greedy and sampled (seeded), then
    the regex and the EBNF grammar greedy and sampled."""
    requests = []
    for name, schema in SCHEMAS.items():
        for i, prompt in enumerate(PROMPTS):
            requests.append((name, prompt, {**GREEDY, "json_schema": json.dumps(schema)}))
            requests.append((name, prompt, {**SAMPLED, "seed": 10 + i, "json_schema": json.dumps(schema)}))
    question = chat("Is water wet? Say yes or no and why.")
    for seed in (1, 2):
        requests.append(("regex", question, {**SAMPLED, "seed": seed, "regex": REGEX}))
        requests.append(("ebnf", question, {**SAMPLED, "seed": seed, "ebnf": EBNF}))
    requests.append(("regex", question, {**GREEDY, "regex": REGEX}))
    requests.append(("ebnf", question, {**GREEDY, "ebnf": EBNF}))
    return requests


def check_valid(kind: str, output: dict) -> None:
    assert output["meta_info"]["finish_reason"]["type"] == "stop", (kind, output["text"])
    text = output["text"]
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "ebnf":
        assert re.fullmatch(r"Answer: [ABC](; [ABC])*\.", text), text
    else:
        jsonschema.validate(json.loads(text), SCHEMAS[kind])


@pytest.mark.parametrize("engine_name", ["plain", "ngram"])
def test_every_constrained_output_validates(request, engine_name):
    engine = request.getfixturevalue(engine_name)
    requests = constrained_requests()
    outputs = engine.generate([prompt for _, prompt, _ in requests], [params for _, _, params in requests])
    for (kind, _, _), output in zip(requests, outputs):
        check_valid(kind, output)
    wait_until_all_kv_is_free(engine)


def test_greedy_speculative_equals_plain_under_each_grammar(plain, ngram):
    requests = [(kind, prompt, params) for kind, prompt, params in constrained_requests() if params["temperature"] == 0]
    prompts, params = [p for _, p, _ in requests], [q for _, _, q in requests]
    expected = plain.generate(prompts, params)
    got = ngram.generate(prompts, params)
    for (kind, _, _), want, have in zip(requests, expected, got):
        assert have["output_ids"] == want["output_ids"], (kind, want["text"], have["text"])
    # drafts were verified and accepted, not skipped: the JSON prompts' answers copy them
    assert max(out["meta_info"]["spec_accept_length"] for out in got) > 1.5
    # one at a time too (a batch of one has no neighbours to share steps with)
    single = ngram.generate(prompts[0], params[0])
    assert single["output_ids"] == expected[0]["output_ids"]


@pytest.mark.parametrize("field, value", [
    ("json_schema", '{"type": "objjject"}'),
    ("json_schema", "{not json"),
    ("regex", "a(b"),
    ("ebnf", 'root ::= undefined_rule'),
    ("structural_tag", '{"format": {"type": "no such format"}}'),
    ("json_schema", 42),
])
def test_bad_grammar_is_one_error_naming_the_field(ngram, field, value):
    with pytest.raises(ValueError, match=field):
        ngram.generate(PROMPTS[0], {**GREEDY, field: value})
    out = ngram.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 4})   # the engine still serves
    assert out["meta_info"]["completion_tokens"] == 4


def test_two_grammars_in_one_request_are_refused(ngram):
    with pytest.raises(ValueError, match="at most one of json_schema, regex"):
        ngram.generate(PROMPTS[0], {"json_schema": "{}", "regex": "a+"})


def test_grammar_requests_leave_their_neighbours_alone(ngram):
    """A plain request batched with grammar requests (and a bad one refused beside it) gives
    the output it gives alone."""
    free = (PROMPTS[0], {**GREEDY, "max_new_tokens": 40})
    alone = ngram.generate(*free)
    with pytest.raises(ValueError, match="regex"):
        ngram.generate([free[0], PROMPTS[1]], [free[1], {**GREEDY, "regex": "(("}])
    prompts = [free[0], PROMPTS[1], PROMPTS[2]]
    params = [free[1], {**GREEDY, "json_schema": json.dumps(VERDICT)}, {**SAMPLED, "seed": 3, "regex": REGEX}]
    together = ngram.generate(prompts, params)
    assert together[0]["output_ids"] == alone["output_ids"]
    jsonschema.validate(json.loads(together[1]["text"]), VERDICT)
    assert re.fullmatch(REGEX, together[2]["text"])


def test_ignore_eos_ends_where_the_grammar_ends(ngram):
    out = ngram.generate(PROMPTS[1], {**GREEDY, "ignore_eos": True, "json_schema": json.dumps(VERDICT)})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(out["text"]), VERDICT)


def test_forbidden_drafts_are_cut_with_their_subtrees(ngram):
    """A tree root -> "yes" -> ",", root -> "maybe" -> "," under the regex: the "maybe" branch
    goes, its child with it; the masks allow "yes"/"no" at the root and "," after "yes"."""
    from types import SimpleNamespace

    import torch

    from specserve.grammar.apply import apply_grammar_bitmask
    from specserve.grammar.tree_masks import grammar_bitmask, prune_proposal, token_allowed
    from specserve.request.grammar_spec import GrammarSpec
    from specserve.verify.tree import TreeProposal

    token = lambda text: ngram.tokenizer.convert_tokens_to_ids(text)
    yes, maybe, comma, no = token("yes"), token("maybe"), token(","), token("no")
    req = SimpleNamespace(grammar=ngram.grammars.matcher(GrammarSpec("regex", REGEX)))
    plain_req = SimpleNamespace(grammar=None)
    proposal = TreeProposal.from_lists([([0, yes, maybe, comma, comma], [-1, 0, 0, 1, 2]),
                                        ([0, maybe, comma], [-1, 0, 1])])
    pruned = prune_proposal([req, plain_req], proposal)
    assert pruned.tokens[0, :3].tolist() == [0, yes, comma] and pruned.parents[0, :3].tolist() == [-1, 0, 1]
    assert pruned.num_nodes.tolist() == [3, 3]   # the tree without a grammar is whole
    masks = grammar_bitmask([req, plain_req], pruned.tokens, pruned.parents, pruned.num_nodes, ngram.vocab_size)
    root, after_yes = masks[0, 0].numpy(), masks[0, 1].numpy()
    assert token_allowed(root, yes) and token_allowed(root, no) and not token_allowed(root, maybe)
    assert token_allowed(after_yes, comma) and not token_allowed(after_yes, yes)
    assert (masks[1] == -1).all()
    logits = apply_grammar_bitmask(torch.zeros(2, 3, ngram.vocab_size), masks)
    assert torch.isfinite(logits[0, 0]).sum() == int(sum(token_allowed(root, t) for t in range(ngram.vocab_size)))
    assert torch.isfinite(logits[1]).all()


def test_greedy_trees_are_pruned_only_while_the_constrained_drafts_are_few(ngram):
    """A greedy request's tree (its verification unmasked) loses its forbidden branch while the
    step's constrained drafts are at most PRUNE_GREEDY_NODES nodes; beyond, it is verified whole
    and its path kept to the grammar afterwards. A sampling request's tree is always pruned."""
    from types import SimpleNamespace

    from specserve.grammar.drafts import PRUNE_GREEDY_NODES, constrain_proposal
    from specserve.request.grammar_spec import GrammarSpec
    from specserve.verify.tree import TreeProposal

    token = lambda text: ngram.tokenizer.convert_tokens_to_ids(text)
    yes, maybe, comma = token("yes"), token("maybe"), token(",")
    tree = ([0, yes, maybe, comma, comma], [-1, 0, 0, 1, 2])
    # the branch of `maybe` (forbidden at the root) is cut where pruned: 3 nodes kept of 5
    kept = lambda proposal, rows: proposal.num_nodes.tolist()[:rows]

    def requests(n):
        return [SimpleNamespace(grammar=ngram.grammars.matcher(GrammarSpec("regex", REGEX))) for _ in range(n)]

    few = requests(2)
    assert kept(constrain_proposal(few, TreeProposal.from_lists([tree] * 2), [16] * 2, [False] * 2), 2) == [3, 3]
    many = PRUNE_GREEDY_NODES // len(tree[0]) + 1                    # more constrained nodes than the bound
    reqs = requests(many)
    big = constrain_proposal(reqs, TreeProposal.from_lists([tree] * many), [16] * many, [True] + [False] * (many - 1))
    assert kept(big, many) == [3] + [5] * (many - 1)


def test_a_path_that_strays_from_the_grammar_takes_the_masked_picks(ngram):
    """Greedy paths verified without masks, then kept to the regex: where the model's argmax is
    outside the grammar the masked argmax replaces it and the walk goes on down the child that
    drafted it (the KV table then needs writing); a path the grammar allows stays as it is."""
    import numpy as np
    import torch

    from specserve.grammar.greedy_paths import keep_to_grammar
    from specserve.request.grammar_spec import GrammarSpec

    def token(text):
        ids = ngram.tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == 1, (text, ids)
        return ids[0]
    yes, no, maybe, comma, because, it, newline = (token(t) for t in ("yes", "no", "maybe", ",", " because", " it", "\n"))
    fresh, after_yes = (ngram.grammars.matcher(GrammarSpec("regex", REGEX)) for _ in range(2))
    assert after_yes.accept(yes)
    # row 0: a lone root, the model's pick "maybe" forbidden, "no" the best allowed one
    # row 1: root "yes" -> "," -> " because" drafted; the model wants a newline after "yes"
    # row 2: no grammar, its path left alone
    logits = torch.zeros(3, 3, ngram.vocab_size)
    logits[0, 0, maybe], logits[0, 0, no], logits[0, 0, yes] = 9.0, 5.0, 4.0
    logits[1, 0, newline], logits[1, 0, comma] = 9.0, 5.0
    logits[1, 1, because] = 9.0
    logits[1, 2, it] = 9.0
    tree_tokens = np.array([[0, 0, 0], [yes, comma, because], [7, 8, 0]])
    tree_parents = np.array([[-1, -1, -1], [-1, 0, 1], [-1, 0, -1]])
    num_nodes = np.array([1, 3, 2])
    tokens = [[maybe], [newline], [8, 5]]
    accepted = np.array([[0, -1, -1], [0, -1, -1], [0, 1, -1]])
    accept_lens = np.array([1, 1, 2])
    rewritten = keep_to_grammar([fresh, after_yes, None], tokens, accepted, accept_lens,
                                lambda rows, nodes: logits[rows, nodes], tree_tokens, tree_parents, num_nodes)
    assert tokens == [[no], [comma, because, it], [8, 5]]
    assert accepted.tolist() == [[0, -1, -1], [0, 1, 2], [0, 1, -1]] and accept_lens.tolist() == [1, 3, 2]
    assert rewritten
    assert fresh.accept(no) and after_yes.accept(comma)   # what the commit accepts: the kept paths
    # a path the grammar allows throughout: nothing read, nothing changed
    tokens, accepted = [[because, it]], np.array([[0, 1, -1]])
    assert not keep_to_grammar([after_yes], tokens, accepted, np.array([2]), None, tree_tokens[1:2], tree_parents[1:2],
                               num_nodes[1:2])
    assert tokens == [[because, it]]


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "NAIVE_EAGLE", "STANDALONE"])
def test_model_drafters_refuse_grammars_naming_the_field(ngram, algorithm):
    """Their fused and chained steps verify on the device without the grammar's masks: a
    grammar request is refused before it enters such an engine (not served unconstrained)."""
    from types import SimpleNamespace

    from specserve.engine.engine import Engine
    from specserve.request.sampling_params import SamplingParams

    engine = SimpleNamespace(args=SimpleNamespace(speculative_algorithm=algorithm), grammars=ngram.grammars)
    with pytest.raises(ValueError, match=f"regex: .*{algorithm}"):
        Engine._grammar_matcher(engine, SamplingParams(regex="a+"))
    assert Engine._grammar_matcher(engine, SamplingParams()) is None


def test_tokens_the_grammar_forces_are_drafted(plain, ngram):
    """A key no prompt or output holds, so the trie cannot draft it: the grammar's forced
    tokens are verified as drafts and accepted several at a time; the output is plain's."""
    schema = {"type": "object", "properties": {"zebra_crossing_visibility_estimate_in_meters": {"type": "boolean"}},
              "required": ["zebra_crossing_visibility_estimate_in_meters"], "additionalProperties": False}
    params = {**GREEDY, "json_schema": json.dumps(schema)}
    prompt = chat("How far can you see? Answer in JSON.")
    got, want = ngram.generate(prompt, params), plain.generate(prompt, params)
    assert got["output_ids"] == want["output_ids"]
    jsonschema.validate(json.loads(got["text"]), schema)
    meta = got["meta_info"]   # drafting nothing, the engine takes a step per token (28 here)
    assert max(meta["spec_accept_histogram"]) >= 5 and meta["spec_verify_ct"] < 0.75 * meta["completion_tokens"], meta


def test_a_schema_may_come_as_a_dict(ngram):
    out = ngram.generate(PROMPTS[1], {**GREEDY, "json_schema": VERDICT})
    jsonschema.validate(json.loads(out["text"]), VERDICT)


def test_both_mask_paths_agree():
    """xgrammar's CPU kernel (float32 on the CPU) and the torch unpacking (every other case)
    give the same logits: every forbidden token at -inf, every allowed one as it was."""
    import torch

    from specserve.grammar.apply import apply_grammar_bitmask

    vocab = 100   # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = torch.randn(3, 2, vocab)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 2, 4), dtype=torch.int32)
    allowed = torch.tensor([[[(int(bitmask[b, i, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for i in range(2)]
                            for b in range(3)], dtype=torch.bool)
    expected = torch.where(allowed, logits, float("-inf"))
    assert torch.equal(apply_grammar_bitmask(logits, bitmask), expected)
    assert torch.equal(apply_grammar_bitmask(logits.double(), bitmask), expected.double())   # the torch path
