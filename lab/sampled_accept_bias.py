"""How far an exact-match walk of sampled draft chains underrates what verification accepts.

While a bucket of the adaptive policy decodes plainly, its evidence for unseeded sampled
requests comes from probes: the head drafts a sampled chain and the chain is walked down the
tokens plain sampling commits, node by node while they match. A node then counts with
probability m = sum(p * q) (p: the target's distribution there, after its temperature and
top-p; q: the head's, at the request's temperature). Verifying that node by rejection
accepts it with probability a = sum(min(p, q)) >= m. Argmax drafts, walked or verified,
count p(argmax q) =: g.

This measures the three per node, and a chain's expected drafts (a0 + a0 a1 + a0 a1 a2 ...),
on text the target sampled itself (prompt + answer, teacher-forced: each row is the root of
a chain whose earlier nodes are the answer's tokens, as eagle_eval.py does for greedy). It
counts, it does not time: any machine gives the same numbers for the same answers.

`python -m lab.sampled_accept_bias --target MODEL.gguf --head heads/DIR [--prompts 8] [--temperature 0.7]
[--top-p 0.95] [--max-new-tokens 96]`: ShareGPT second turns (the bench's), the answers
sampled by a plain engine, then one JSON line: mean tokens a step (1 + expected drafts) by
rejection, by the exact-match walk of sampled chains, and by argmax chains, and the
per-depth means of a, m and g.
"""
from __future__ import annotations

import argparse
import json

import torch

from specserve.bench import datasets
from specserve.engine.engine import Engine
from specserve.verify.filters import apply_sampling_filters
from specserve.speculative.heads.eagle_checkpoint import load_head
from specserve.training.eagle_ttt import ConversationBatch, unroll
from specserve.training.target_features import TargetFeatureExtractor

ROWS_AT_ONCE = 64        # each a vocabulary's floats several times over
CONVERSATIONS_AT_ONCE = 2   # the unrolled head attends over (conversations, heads, T, T)


def node_probabilities(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(rows, 3): per row, sum(min(p, q)), sum(p * q) and p(argmax q), p and q (rows, vocab)."""
    argmax = q.argmax(dim=1, keepdim=True)
    return torch.stack([torch.minimum(p, q).sum(1), (p * q).sum(1), p.gather(1, argmax).squeeze(1)], dim=1)


def chain_tokens(per_node: torch.Tensor) -> torch.Tensor:
    """(rows, depth, 3) -> (rows, 3): 1 + the expected drafts a chain commits, each node's
    probability given its parent's acceptance."""
    return 1 + per_node.cumprod(dim=1).sum(dim=1)


def target_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    rows = len(logits)
    return apply_sampling_filters(logits.float(), torch.full((rows,), temperature), torch.zeros(rows, dtype=torch.long),
                                  torch.full((rows,), top_p), torch.zeros(rows), need_min_p=False)


def head_distribution(head, hidden: torch.Tensor, temperature: float, vocab_size: int) -> torch.Tensor:
    """q over the target's vocabulary: softmax(head logits / T) on the draft vocabulary, as the
    drafters sample it (draft_chain.draft_distribution)."""
    q = torch.softmax(head.logits(hidden).float() / temperature, dim=1)
    full = torch.zeros(len(q), vocab_size)
    return full.index_copy_(1, head.to_target_ids(torch.arange(q.shape[1])), q)


@torch.no_grad()
def measure(engine: Engine, head, conversations: list[tuple[list[int], int]], temperature: float, top_p: float,
            depth: int) -> torch.Tensor:
    """(rows, depth, 3) of node_probabilities over every chain rooted in an answer, depth nodes deep."""
    target = engine.core.runner.model
    lengths = [len(tokens) for tokens, _ in conversations]
    extractor = TargetFeatureExtractor(target, head.config.aux_layers, sum(lengths), len(lengths), max(lengths))
    states = extractor([tokens for tokens, _ in conversations])
    b, t = len(conversations), max(lengths)
    tokens = torch.zeros(b, t, dtype=torch.long)
    layers = torch.zeros(b, t, states.layers.shape[1])
    finals = torch.zeros(b, t, states.final.shape[1])
    start = 0
    for i, (ids, _) in enumerate(conversations):
        n = len(ids)
        tokens[i, :n] = torch.tensor(ids)
        layers[i, :n], finals[i, :n] = states.layers[start:start + n], states.final[start:start + n]
        layers[i, n:], finals[i, n:] = states.layers[start + n - 1], states.final[start + n - 1]
        start += n
    batch = ConversationBatch(tokens, torch.tensor(lengths), torch.tensor([p for _, p in conversations]), layers)
    # chains whose every node predicts an answer token
    rows = torch.stack([batch.predicts_answer(step) for step in range(depth)]).all(0).flatten().nonzero().squeeze(1)
    outputs = unroll(head, batch, depth, rows)
    per_node = []
    for step, hidden in enumerate(outputs):
        # row r's step predicts token r + 2 + step, whose distribution is the target's at r + 1 + step
        at = rows + 1 + step
        parts = []
        for chunk in range(0, len(rows), ROWS_AT_ONCE):   # (rows, vocab) floats: a few at a time
            logits = target.lm_head(finals.view(b * t, -1).index_select(0, at[chunk:chunk + ROWS_AT_ONCE]))
            p = target_distribution(logits, temperature, top_p)
            q = head_distribution(head, hidden[chunk:chunk + ROWS_AT_ONCE], temperature, p.shape[1])
            parts.append(node_probabilities(p, q))
        per_node.append(torch.cat(parts))
    return torch.stack(per_node, dim=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--head", required=True)
    parser.add_argument("--dataset-path", default=None)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--depth", type=int, default=3, help="the chain's drafts")
    ns = parser.parse_args(argv)
    engine = Engine(model_path=ns.target, dtype="float32", device="cpu", log_level="warning")
    try:
        messages = datasets.load_sharegpt_second_turns(ns.dataset_path, ns.prompts, seed=2)
        prompts = [engine.tokenizer(engine.apply_chat_template(m)).input_ids for m in messages]
        outputs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": ns.temperature, "top_p": ns.top_p, "max_new_tokens": ns.max_new_tokens})
        conversations = [(p + o["output_ids"], len(p)) for p, o in zip(prompts, outputs)]
        head = load_head(ns.head, engine.core.runner.model.config.num_layers)
        if head.embed_tokens is None:
            head.share_embedding(engine.core.runner.model.embed_tokens.weight)
        per_node = torch.cat([measure(engine, head, conversations[i:i + CONVERSATIONS_AT_ONCE], ns.temperature,
                                      ns.top_p, ns.depth)
                              for i in range(0, len(conversations), CONVERSATIONS_AT_ONCE)])
    finally:
        engine.shutdown()
    tokens = chain_tokens(per_node).mean(0).tolist()
    print(json.dumps({"chains": len(per_node), "temperature": ns.temperature, "top_p": ns.top_p,
                      "tokens_a_step": {"rejection": round(tokens[0], 3), "walk_of_sampled": round(tokens[1], 3),
                                        "argmax": round(tokens[2], 3)},
                      "per_depth": {name: [round(v, 3) for v in per_node[:, :, i].mean(0).tolist()]
                                    for i, name in enumerate(("a", "m", "g"))}}))


if __name__ == "__main__":
    main()
