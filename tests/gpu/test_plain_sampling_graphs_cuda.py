"""A sampling graph replayed again and again (sampling/plain_graphs.py) gives the eager
sampler's tokens each time, and so do graphs of its parts alone: the filters, and the race.

On an H100 (2026-12-07) a graph of the whole sampling gave the eager tokens on its first replay
and tripped a device-side assert ("scatter gather kernel index out of bounds", one thread a
row) on its second, with the same parameters and new logits: the roots' tree tensors it reads
were freed with the capture's closure, and the eager sampler between the replays allocated
their memory (plain_graphs.py keeps them now). The eager call between replays is what these
tests keep; they run from the parts up (pytest -v names the one running when an assert ends
the process)."""
from __future__ import annotations

import torch

from specserve.runner.cuda_graph import capture_graph
from specserve.sampling.columns import SamplingColumns
from specserve.sampling.plain_graphs import PlainSamplingGraphs
from specserve.verify.filters import apply_sampling_filters
from specserve.verify.random import exponential_race
from specserve.verify.rules import verify_sampling
from specserve.verify.tree import DraftTrees

VOCAB = 256   # the tiny test model's (tests/spec_fixtures.py), where the engine's test tripped it
VALUES = {"temperatures": [0.8] * 4, "top_ks": [VOCAB, 20, VOCAB, VOCAB], "top_ps": [0.9, 1.0, 1.0, 1.0],
          "min_ps": [0.0, 0.0, 0.1, 0.0], "seeds": [11, 12, 13, 14], "positions": [20, 21, 22, 23]}
REPLAYS = 4


def device_columns() -> dict[str, torch.Tensor]:
    host = SamplingColumns.allocate(len(VALUES["seeds"]), "cpu")
    host.fill(VALUES)
    return host.to("cuda").columns()


def test_a_graph_of_the_filters_alone_replays_as_eager_on_cuda():
    logits = torch.randn(4, 1, VOCAB, device="cuda")
    columns = device_columns()
    filters = {name: columns[name] for name in ("temperatures", "top_ks", "top_ps", "min_ps")}
    graph, probs = capture_graph(lambda: apply_sampling_filters(logits, **filters), None)
    for _ in range(REPLAYS):
        logits.normal_()
        graph.replay()
        assert torch.equal(probs, apply_sampling_filters(logits, **filters))


def test_a_graph_of_the_race_alone_replays_as_eager_on_cuda():
    probs = torch.softmax(torch.randn(4, 1, VOCAB, device="cuda"), -1)
    columns = device_columns()
    seeds, positions = columns["seeds"], columns["positions"].unsqueeze(1)
    graph, tokens = capture_graph(lambda: exponential_race(probs, seeds, positions), None)
    for _ in range(REPLAYS):
        probs.copy_(torch.softmax(torch.randn_like(probs), -1))
        graph.replay()
        assert torch.equal(tokens, exponential_race(probs, seeds, positions))


def test_a_sampling_graph_replays_as_the_eager_sampler_on_cuda():
    """Through PlainSamplingGraphs, over a decode graph's logits buffer (its first 4 of 8 rows),
    the same parameters every step and new logits: the eager verify_sampling's tokens each time."""
    full = torch.randn(8, 1, VOCAB, device="cuda", dtype=torch.bfloat16)
    graphs = PlainSamplingGraphs([full[:, 0]], VOCAB)
    columns = device_columns()
    roots = DraftTrees.root_only(torch.zeros(4, dtype=torch.long, device="cuda"))
    for _ in range(REPLAYS):
        full.normal_()
        logits = full[:4, 0]
        eager = verify_sampling(roots, logits.unsqueeze(1), **columns).committed_tokens[:, 0]
        assert torch.equal(graphs.sample(logits, VALUES, True, True), eager)
