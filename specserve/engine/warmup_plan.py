"""WarmupPlan: which request shapes the start-up warm-up runs, derived from the engine.

On a GPU a step can meet something built on first use: a Triton kernel specialisation
(the extend kernel with or without split keys, the split merge, decode attention outside
the graphs, the tree-masked extend of an eager verify), a cuBLAS kernel for a new row
count (its module loads lazily), the GEMV autotune when batch-1 steps run eagerly, a
pinned host buffer, a sampler op never launched before. What varies between them is the
shape of a step, so the plan names shapes, a few per class:

- prompt lengths, each prefilled alone: 1 (a one-row step, also the last chunk of a
  prompt one token past a chunk boundary), then x4 up to the chunk size, and one prompt
  longer than a chunk (its second chunk attends to a cached prefix);
- decode batch sizes: every captured graph bucket, and the sizes that decode eagerly
  (above the largest graph, or all of them without graphs), there also with one request
  whose context is long enough for attention to split its keys (the split count follows
  the batch's longest context);
- two prompts together, more tokens than the largest prefill graph takes (where chunks are
  larger): an eager prefill of few prompts splits its keys (few row blocks fill the GPU
  with splits), an extend-kernel variant no other shape builds (an H100 suite round
  compiled it for 1.4 s inside a prefill of two ShareGPT second turns at 64);
- draft tree sizes (the tiers an adaptive draft length chooses between, the full size
  otherwise), verified at every graph bucket and at the smaller eager sizes;
- sampling variants (filters, penalties, logprobs, min_new_tokens, stop strings), in one
  batch, plain and with drafts;
- a prompt that arrives while others decode (its chunks paced between decode steps).

A batch's prompts fit one prefill chunk together: once some of its requests decode, the
others' prefill is paced in small chunks and the batch never decodes as a whole.

A CPU compiles nothing (no Triton, no graphs; oneDNN and MKL only pick a kernel per row
count), and its first request of any shape is as fast as the next one (BENCHMARKS.md,
cold start), so it gets no plan: the warm-up would only delay its start.
"""
from __future__ import annotations

from dataclasses import dataclass

from specserve.speculative.adaptive.policy import tiers_for

SHORT_PROMPT = 6           # tokens of the prompts in a batch (256 of them fit a 2048-token chunk)
DRAFT_PROMPT = 64          # tokens of the prompt an adaptive draft length drafts for
SPLIT_CONTEXT = 300        # a context long enough for attention to split its keys (>= 2 blocks of 128)
PREFILL_GROWTH = 4         # prompt lengths grow by this factor from 1 to the chunk size
NEW_TOKENS = 4             # decode steps after each prefill: the launch-ahead schedule needs >= 3
MAX_EAGER_BATCH = 256
LONGEST_PROMPT = 8192      # without chunking (-1): kernels pick nothing new for longer prompts, which only cost time
MAX_EAGER_TREE_BATCH = 64


@dataclass(frozen=True)
class EngineShape:
    """What the plan depends on, read from the built engine in one place."""
    cuda: bool
    graph_batch_sizes: tuple[int, ...]     # captured buckets; () without CUDA graphs
    graph_tree_sizes: tuple[int, ...]      # tokens per request of the captured graphs
    max_running: int
    kv_slots: int
    context_length: int
    chunk_size: int
    num_draft_tokens: int | None           # None without a drafter
    prefill_graph_tokens: int = 0          # the largest prefill graph's tokens; 0 without prefill graphs

    @classmethod
    def of(cls, core, args) -> "EngineShape":
        runner, graphs = core.runner, core.runner.graphs
        return cls(cuda=runner.device.type == "cuda",
                   graph_batch_sizes=tuple(graphs.buckets) if graphs is not None else (),
                   graph_tree_sizes=tuple(graphs.sizes) if graphs is not None else (),
                   max_running=runner.max_running_requests, kv_slots=runner.pool.size,
                   context_length=runner.context_length,
                   chunk_size=runner.chunk_size,
                   num_draft_tokens=core.num_draft_tokens if core.drafter is not None else None,
                   prefill_graph_tokens=runner.prefill_graphs.buckets[-1] if runner.prefill_graphs else 0)


@dataclass(frozen=True)
class BatchShape:
    """`size` requests prefilled together: `long_prompts` of them with a `longest`-token prompt,
    the others SHORT_PROMPT."""
    size: int
    longest: int = SHORT_PROMPT
    long_prompts: int = 1

    @property
    def prompt_lengths(self) -> list[int]:
        return [self.longest] * self.long_prompts + [SHORT_PROMPT] * (self.size - self.long_prompts)


@dataclass(frozen=True)
class WarmupPlan:
    prompt_lengths: tuple[int, ...]               # one request each, alone
    decode_batches: tuple[BatchShape, ...]
    tiers: tuple[int, ...]                        # draft tree sizes to verify (empty without a drafter)
    tier_batches: tuple[BatchShape, ...]          # each tier is verified at each of these
    late_prompt_length: int = SPLIT_CONTEXT       # a prompt arriving while others decode (0: none)
    new_tokens: int = NEW_TOKENS                  # tokens each plain request generates
    sampling_variants: bool = True                # one batch of every sampling variant (with drafts too)

    @property
    def longest_tier(self) -> int:
        return max(self.tiers, default=1)


def plan_warmup(shape: EngineShape) -> WarmupPlan | None:
    """The plan for a GPU engine; None on a CPU (see the module docstring)."""
    if not shape.cuda:
        return None
    tiers = _tiers(shape)
    # a prompt must leave room for its tokens and a draft in the context, and share the cache
    longest = min(shape.context_length - NEW_TOKENS - max(tiers, default=1) - 2, shape.kv_slots // 2,
                  LONGEST_PROMPT)
    eager = _eager_batch_sizes(shape)
    # a verify step's logits are (batch x tree x vocabulary) fp32: past the graphs, trees are
    # verified at the smaller eager sizes only (at 256 x 16 nodes they would take gigabytes)
    eager_trees = tuple(bs for bs in eager if bs <= max(eager[0], MAX_EAGER_TREE_BATCH)) if eager else ()
    return WarmupPlan(_prompt_lengths(shape.chunk_size, longest),
                      _fitting(shape, _batches(shape.graph_batch_sizes, eager), 1) + _eager_prompt_pair(shape), tiers,
                      _fitting(shape, _batches(shape.graph_batch_sizes, eager_trees), max(tiers)) if tiers else (),
                      late_prompt_length=max(0, min(SPLIT_CONTEXT, longest)))


def _batches(graph_sizes: tuple[int, ...], eager: tuple[int, ...]) -> list[BatchShape]:
    """Short prompts at every size; outside the graphs also one with a long context."""
    return [BatchShape(bs) for bs in graph_sizes + eager] + [BatchShape(bs, SPLIT_CONTEXT) for bs in eager]


def _eager_prompt_pair(shape: EngineShape) -> tuple[BatchShape, ...]:
    """Two prompts whose tokens together pass the largest prefill graph, where a chunk may: none
    without prefill graphs (every prompt step is eager, and the eager batches split their keys)."""
    if not shape.prefill_graph_tokens or shape.prefill_graph_tokens >= shape.chunk_size:
        return ()
    pair = _fitting(shape, [BatchShape(2, shape.prefill_graph_tokens // 2 + SHORT_PROMPT, long_prompts=2)], 1)
    return tuple(b for b in pair if 2 * b.longest > shape.prefill_graph_tokens)


def _prompt_lengths(chunk: int, longest: int) -> tuple[int, ...]:
    lengths, length = {min(chunk, longest)}, 1
    while length < min(chunk, longest):
        lengths.add(length)
        length *= PREFILL_GROWTH
    past_chunk = chunk + chunk // 2
    if past_chunk <= longest:
        lengths.add(past_chunk)
    return tuple(sorted(n for n in lengths if n >= 1))


def _eager_batch_sizes(shape: EngineShape) -> tuple[int, ...]:
    """Batch sizes that decode outside any graph: above the largest one, or all without graphs."""
    top = min(shape.max_running, MAX_EAGER_BATCH)
    if shape.graph_batch_sizes:
        largest = shape.graph_batch_sizes[-1]
        return tuple(sorted({largest + 1, top})) if top > largest else ()
    sizes, size = {top}, 1
    while size < top:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


def _tiers(shape: EngineShape) -> tuple[int, ...]:
    if shape.num_draft_tokens is None or shape.num_draft_tokens < 2:
        return ()
    graph_sizes = list(shape.graph_tree_sizes) or None
    return tuple(t for t in tiers_for(shape.num_draft_tokens, graph_sizes) if t > 1)


def _fitting(shape: EngineShape, batches: list[BatchShape], tree: int) -> tuple[BatchShape, ...]:
    """The batches (their long prompt cut to what fits) whose prompts fit one chunk and whose
    requests fit the cache together, each with NEW_TOKENS more tokens and a `tree`-node draft."""
    kept = []
    for batch in batches:
        others = (batch.size - batch.long_prompts) * SHORT_PROMPT
        longest = min(batch.longest, (shape.chunk_size - others) // batch.long_prompts,
                      shape.context_length - NEW_TOKENS - tree - 1)
        cache = others + batch.long_prompts * longest + batch.size * (NEW_TOKENS + tree)
        if longest >= SHORT_PROMPT and batch.size <= shape.max_running and cache <= shape.kv_slots:
            kept.append(BatchShape(batch.size, longest, batch.long_prompts))
    return tuple(dict.fromkeys(kept))
