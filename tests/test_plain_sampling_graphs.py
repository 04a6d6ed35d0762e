"""The sampling graphs' host side (sampling/plain_graphs.py; the graphs themselves run in
tests/gpu/test_decode_launch_cuda.py): one packed buffer holds every column without overlap,
its float columns exact, only a decode graph's logits buffer (or its first rows) is taken, and
with a graph's replay stood in for on the CPU, each step's tokens are the eager sampler's."""
from __future__ import annotations

import weakref

import numpy as np
import torch

from specserve.sampling.columns import FLOAT_COLUMNS, INT_COLUMNS, SamplingColumns
from specserve.sampling.plain_graphs import PlainSamplingGraphs


def test_the_packed_columns_hold_each_value_apart():
    rows = 4
    inputs = SamplingColumns.allocate(rows, "cpu")
    columns = inputs.columns()
    assert set(columns) == set(FLOAT_COLUMNS) | set(INT_COLUMNS) and inputs.rows == rows
    values = {name: (np.arange(rows) + 10 * i + (0.25 if name in FLOAT_COLUMNS else 0)).tolist()
              for i, name in enumerate(columns)}
    inputs.fill(values)
    for name, view in inputs.columns().items():
        assert view.dtype == (torch.float32 if name in FLOAT_COLUMNS else torch.long)
        assert view.shape == (rows,) and view.tolist() == values[name], name
    # the packed buffer is what a single copy sends: a copy of it carries every column
    copy = SamplingColumns(inputs.packed.clone())
    assert all(torch.equal(copy.columns()[name], columns[name]) for name in columns)
    inputs.fill({name: [7] for name in columns})   # without padding the rows past the values are kept
    assert inputs.columns()["seeds"].tolist() == [7] + values["seeds"][1:]
    inputs.fill({name: [5, 6] for name in columns}, padding={name: 0.5 if name in FLOAT_COLUMNS else 9 for name in columns})
    assert inputs.columns()["seeds"].tolist() == [5, 6, 9, 9] and inputs.columns()["top_ps"].tolist() == [5, 6, 0.5, 0.5]


def test_only_a_decode_graphs_logits_are_covered():
    buffer = torch.zeros(8, 1, 32)[:, 0]   # a decode graph's (bucket, vocab) logits, a view of (bucket, 1, vocab)
    graphs = PlainSamplingGraphs([buffer], vocab_size=32)
    assert graphs.covers(buffer) and graphs.covers(buffer[:3])
    assert not graphs.covers(buffer[1:4])          # not the buffer's first rows
    assert not graphs.covers(buffer.clone())       # another tensor: the eager path samples it
    assert not graphs.covers(torch.zeros(8, 32))


class _EagerGraph:
    """A CUDA graph's stand-in on the CPU: replay runs the captured function again into the
    output the capture returned (what a replay writes). Like a CUDA graph it does not keep the
    function, nor what the function reads: whoever holds the graph must."""

    def __init__(self, run):
        self.run = weakref.ref(run)

    def replay(self):
        run = self.run()
        assert run is not None, "the captured function (and the tensors it reads) was freed before a replay"
        self.output.copy_(run())

    def pool(self):
        return None


def eager_capture(run, pool):
    graph = _EagerGraph(run)
    graph.output = run()
    return graph, graph.output


class _NoEvent:
    def synchronize(self):
        pass


def test_graphed_plain_sampling_gives_the_eager_samplers_tokens(monkeypatch):
    """The graphed path's host side (sampling/plain_graphs.py) on the CPU, a graph's replay
    stood in for by running its function again: each batch's parameters packed into the bucket's
    inputs, rows past the batch padded, a graph per set of filters, the two host buffers in turn,
    and each step's tokens those of the eager sampler on the same logits."""
    from specserve.request.req import Req
    from specserve.request.sampling_params import SamplingParams
    from specserve.sampling import plain_graphs
    from specserve.sampling.sampler import Sampler
    monkeypatch.setattr(plain_graphs, "capture_graph", eager_capture)
    monkeypatch.setattr(plain_graphs.torch.cuda, "Event", _NoEvent)
    monkeypatch.setattr(plain_graphs, "record", lambda event: event)
    vocab, bucket = 64, 8
    buffer = torch.zeros(bucket, 1, vocab)[:, 0]
    graphed, eager = Sampler(vocab, torch.device("cpu")), Sampler(vocab, torch.device("cpu"))
    graphed.graph_plain_steps([buffer])
    filters = ({"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {}, {"temperature": 0.0}, {"top_p": 0.7, "min_p": 0.05})
    reqs = [Req(rid=str(i), prompt_ids=[1, 2, 3], params=SamplingParams(**{"temperature": 0.8, **f}), detokenizer=None,
                seed=100 + i, stop_ids=frozenset(), max_new_tokens=8) for i, f in enumerate(filters)]
    generator = torch.Generator().manual_seed(0)
    batches = [reqs, reqs[:3], reqs[1:2], reqs[2:3], reqs[3:5], reqs]
    for step, batch in enumerate(batches * 2):
        buffer.copy_(torch.randn(bucket, vocab, generator=generator) * 3)
        positions = [10 + step + i for i in range(len(batch))]
        logits = buffer[:len(batch)]
        assert graphed.plain_graphs.covers(logits)
        tokens = graphed.sample_plain(logits, batch, positions)
        assert tokens.tolist() == eager.sample_plain(logits.clone(), batch, positions).tolist(), step
    # one graph per set of filters over the one bucket: top-k / top-p, min-p, both, neither
    assert {key[1:] for key in graphed.plain_graphs.graphs} == {(True, True), (True, False), (False, True),
                                                                (False, False)}


def test_capture_all_takes_every_bucket_and_filter_set_largest_first(monkeypatch):
    """The warm-up's capture_all: each bucket's four graphs (top-k/top-p, min-p, both, neither),
    the largest bucket's first (so the shared pool is sized once); a sampled step afterwards
    captures nothing."""
    from specserve.sampling import plain_graphs
    captured_rows = []

    def recording_capture(run, pool):
        graph, output = eager_capture(run, pool)
        captured_rows.append(output.shape[0])
        return graph, output
    monkeypatch.setattr(plain_graphs, "capture_graph", recording_capture)
    monkeypatch.setattr(plain_graphs.torch.cuda, "Event", _NoEvent)
    monkeypatch.setattr(plain_graphs, "record", lambda event: event)
    vocab = 32
    buffers = [torch.zeros(bucket, 1, vocab)[:, 0] for bucket in (1, 8, 4)]
    graphs = PlainSamplingGraphs(buffers, vocab_size=vocab)
    assert graphs.capture_all() == 12
    assert captured_rows == [8] * 4 + [4] * 4 + [1] * 4
    assert graphs.capture_all() == 0
    values = {"temperatures": [0.7, 0.0], "top_ps": [0.9, 1.0], "min_ps": [0.0, 0.0], "top_ks": [vocab, vocab],
              "seeds": [3, 0], "positions": [5, 6]}
    tokens = graphs.sample(buffers[2][:2], values, need_top_k_top_p=True, need_min_p=False)
    assert tokens.shape == (2,) and len(captured_rows) == 12
