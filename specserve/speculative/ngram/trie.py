"""A shared n-gram trie of token ids: the model-free drafter behind NGRAM / LOOKAHEAD.

Every path from the root is an n-gram (at most ``max_trie_depth`` tokens) that occurred in
some inserted sequence; a node's count is how often its n-gram occurred. A draft is the
continuation of the longest suffix of a request's tokens that the trie has seen continued.

The trie itself is C (``trie.c``, beside this file), compiled on first use with the
system C compiler into ``$SPECSERVE_CACHE_DIR`` (default ``~/.cache/specserve``) and called
through ctypes, one call per ``insert`` or ``propose``: ~2-5 us per token indexed where the
pure-Python original (``trie_py.py``) takes ~20-70, and proposals several times
cheaper (``python -m lab.bench_ngram`` from the repository root). This file is the Python face:
the build, and the conversions. On a machine without a working C compiler, ``NgramTrie(config)``
gives the pure-Python trie instead (same behaviour, one warning). A trie is not thread-safe:
its caller keeps calls from overlapping (NgramDrafter: writer.py's lock); ``insert``
releases the GIL, the other calls keep it.

- Insertion is incremental: a stream (one request, keyed by ``owner``) keeps its frontier,
  the nodes of the n-grams ending at its last token. A new token adds one child to each,
  ``max_trie_depth`` hash look-ups; no history is re-scanned.
- Each node keeps ``top``: its ``max_bfs_breadth`` best children by (count, last update)
  descending, re-placed on every count increment (a count only grows, so a child only moves
  forward). Proposing never sorts a node's children, even a token with thousands.
- Eviction, when over ``capacity``, down to ``evict_to * capacity``: CLOCK, the usual cheap
  approximation of LRU, over leaves. Nodes wait in a FIFO in creation order; the oldest
  leaves go unless their count grew since they were queued (then they are queued again,
  as are inner nodes). Amortised O(1) per node, never a scan of the trie, and a node with
  a recently used descendant stays. Ids are reused; a generation tells incarnations apart.
- Owner priority: an owner's stream also records, for each n-gram it inserted, the token
  that last followed it in that owner's own tokens (its prompt and output). ``propose(...,
  owner=k)`` ranks that child first at every node whatever its global count (PROB scores it
  as conditional probability 1). It costs a map entry per n-gram; ``release(k)`` frees it.

Token ids must fit in an int32 (an OverflowError otherwise). Memory: ~160 bytes per node
(the default million-node capacity, ~160 MB resident; the Python original took ~500), plus
12-24 bytes per n-gram of each live owner's stream.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import secrets
import shlex
import shutil
import struct
import subprocess
import weakref
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specserve.runner.forecast_step import empty_table
from specserve.speculative.ngram.config import NgramConfig
from specserve.speculative.ngram.forecast import CANDIDATE_SPAN
from specserve.speculative.ngram.trie_py import PythonNgramTrie
from specserve.verify.tree import TreeProposal

logger = logging.getLogger("specserve")

_SOURCE = Path(__file__).with_name("trie.c")
# -ffp-contract=off: PROB's path probabilities are computed exactly as Python computes them.
_CFLAGS = ("-O2", "-std=c99", "-shared", "-fPIC", "-Wall", "-Wextra", "-ffp-contract=off")
_EXTRA_CFLAGS_ENV = "SPECSERVE_NGRAM_CFLAGS"  # e.g. "-fsanitize=address,undefined -g"
_NO_MEMORY = -1  # the C side's codes: -1 out of memory, -2 a bad argument
_MAX_DRAFT = 1 << 20  # num_draft_tokens beyond any tree worth verifying
# Token lists go to C as bytes of int32s; a precompiled Struct packs a short list fastest.
_PACKERS = [struct.Struct(f"{n}i").pack for n in range(65)]


class NgramTrie:
    def __new__(cls, config: NgramConfig):
        # Without a C compiler the pure-Python trie stands in, so every caller of
        # NgramTrie(config) keeps working (slower) instead of failing.
        if cls is NgramTrie and compiled_trie_unavailable() is not None:
            return PythonNgramTrie(config)
        return super().__new__(cls)

    def __init__(self, config: NgramConfig):
        if config.capacity > 1 << 30 or config.max_bfs_breadth > (1 << 15) - 1:
            raise ValueError("the C trie holds at most 2**30 nodes and ranks at most 32767 children")
        self.config = config
        self.last_match_length = 0  # of the last propose: its longest suffix with a continuation
        self._max_window = config.max_window
        # Tokens fed between capacity checks: bounds the overshoot to capacity / 2.
        self._chunk = max(1, config.capacity // (2 * config.max_trie_depth))
        self._breadths = config.breadth_table()
        self._streams: dict[int, int] = {}  # owner -> its stream's slot in the C trie
        lib = self._lib = _library()
        breadths = array("i", [b for row in self._breadths for b in row])  # alive during the call
        self._handle = lib.ngt_create(
            config.capacity, int(config.capacity * config.evict_to), self._chunk,
            config.min_match_window, self._max_window, config.max_bfs_breadth,
            config.max_trie_depth, config.match_type == "PROB", breadths.buffer_info()[0])
        if not self._handle:
            raise MemoryError("cannot allocate the n-gram trie")
        self._finalizer = weakref.finalize(self, lib.ngt_free, self._handle)
        # The two hot calls skip ctypes' per-argument conversion (see _SIGNATURES).
        self._handle_arg = ctypes.c_void_p(self._handle)
        self._propose_c, self._propose_batch_c = lib.ngt_propose, lib.ngt_propose_batch
        # Inserts release the GIL (a prompt's take milliseconds): a writer thread runs them in
        # parallel with Python; the caller keeps other calls out meanwhile (NgramDrafter's lock).
        self._insert_c = _library_without_gil().ngt_insert
        self._insert_many_c = _library_without_gil().ngt_insert_many
        self._grow_output(64)
        self._batch_capacity = (0, 0)
        self._grow_batch_output(64 * 16, 64)

    def insert(self, tokens: Sequence[int], owner: int | None = None) -> None:
        """Index every n-gram (up to max_trie_depth long) that ends in ``tokens``.

        With ``owner``, ``tokens`` continue that owner's earlier tokens (n-grams spanning
        the calls are indexed), so a request calls ``insert(prompt, rid)`` once and then
        ``insert(accepted, rid)`` per step. Without, ``tokens`` stand alone.
        """
        tokens = _as_list(tokens)
        data = _int32_bytes(tokens)
        slot = self._slot(owner)
        if tokens and self._insert_c(self._handle_arg, data, len(tokens), slot) < 0:
            raise MemoryError("the n-gram trie is out of memory")

    def insert_many(self, streams: Sequence[tuple[int | None, Sequence[int]]]) -> None:
        """``insert(tokens, owner)`` for each (owner, tokens), in order, in one C call that
        releases the GIL once: a writer thread calling ``insert`` per stream (a flush hands it
        ~64) takes the GIL back from the step loop after each."""
        joined, offsets, slots = array("i"), array("q", [0]), array("i")
        for owner, tokens in streams:
            joined.extend(_as_list(tokens))
            offsets.append(len(joined))
            slots.append(self._slot(owner))
        if not joined:
            return
        result = self._insert_many_c(self._handle_arg, joined.buffer_info()[0], offsets.buffer_info()[0],
                                     slots.buffer_info()[0], len(slots))
        if result < 0:
            _checked(result)

    def _slot(self, owner: int | None) -> int:
        """The owner's stream slot in the C trie, made on first use (-1: no owner)."""
        slot = -1 if owner is None else self._streams.get(owner)
        if slot is None:
            slot = self._streams[owner] = _checked(
                self._lib.ngt_stream_new(self._handle, self.config.owner_priority))
        return slot

    def propose(self, context: Sequence[int], num_draft_tokens: int, one_branch: bool,
                owner: int | None = None) -> tuple[list[int], list[int]]:
        """Draft tree after ``context[-1]`` (the root, not returned): ``(tokens, parents)``
        in BFS order, ``parents[i] < i``, -1 = the root, at most ``num_draft_tokens - 1``
        nodes; empty lists when no suffix of ``context`` has a continuation.

        The longest suffix with a continuation is expanded first; while the budget is not
        full, the continuations of shorter suffixes are merged in (a path already in the
        draft is shared, not repeated) as a weaker, wider second opinion. ``one_branch``:
        a chain instead, re-matched on the extended context where the trie runs out.

        ``owner``: rank the owner's own continuations first. When ``context`` ends with
        the tokens the owner inserted last, matching also reads the owner's frontier
        instead of walking each suffix from the root.
        """
        budget = num_draft_tokens - 1
        self.last_match_length = 0
        if budget <= 0:
            return [], []
        if budget > self._out_capacity:
            if budget > _MAX_DRAFT:
                raise ValueError(f"num_draft_tokens is at most {_MAX_DRAFT + 1}")
            self._grow_output(budget)
        window = _as_list(context[-self._max_window:])
        slot = -1 if owner is None else self._streams.get(owner, -1)
        result = self._propose_c(self._handle_arg, _int32_bytes(window), len(window), budget,
                                 (slot + 1) * 2 + (1 if one_branch else 0))
        if result < 0:
            _checked(result)
        count = result & 0xFFFFFFFF
        self.last_match_length = result >> 32
        values = self._out[:2 * count].tolist()  # the tokens, then their parents
        return values[:count], values[count:]

    def propose_batch(self, contexts: Sequence[Sequence[int]], budgets: Sequence[int], one_branch: bool,
                      owners: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``propose`` for every request in one C call. budgets[b]: its num_draft_tokens
        (root included). Returns (tokens, parents, num_nodes, match_lengths): the (batch,
        max budget) int64 trees with the root (the context's last token) first, drafts'
        parents counted from it, padding token 0 / parent -1, and per request its real nodes
        and the length of its matched suffix (views of reused buffers: valid until the next
        call)."""
        batch, width = len(contexts), max(budgets)
        if width > self._out_capacity:
            if width > _MAX_DRAFT:
                raise ValueError(f"num_draft_tokens is at most {_MAX_DRAFT + 1}")
            self._grow_output(width)
        if batch * width > self._batch_capacity[0] or batch > self._batch_capacity[1]:
            self._grow_batch_output(batch * width, batch)
        joined, offsets = array("i"), array("q", [0])
        window = self._max_window
        for context in contexts:   # each context's window only
            joined.extend(_as_list(context[-window:]))
            offsets.append(len(joined))
        streams, branch = self._streams, int(one_branch)
        modes = array("i", [(streams.get(owner, -1) + 1) * 2 + branch for owner in owners])   # as propose's
        drafts = array("i", [b - 1 for b in budgets])
        pointers = [ctypes.c_void_p(a.buffer_info()[0]) for a in (joined, offsets, drafts, modes)]
        result = self._propose_batch_c(self._handle_arg, pointers[0], pointers[1], batch, pointers[2], pointers[3],
                                       width, *self._batch_pointers)
        if result < 0:
            _checked(result)
        tokens, parents, num_nodes, match_lengths = self._batch_out
        return (tokens[:batch * width].reshape(batch, width), parents[:batch * width].reshape(batch, width),
                num_nodes[:batch], match_lengths[:batch])

    def forecast(self, contexts: Sequence[Sequence[int]], owners: Sequence[int], proposal: TreeProposal,
                 nodes: int, candidates: int, one_branch: bool, key_cap: int) -> np.ndarray:
        """forecast.forecast_table's table in one C call (ngt_forecast): for a batch of 8
        requests and chains of 16 nodes its Python loops over propose_batch cost more than a
        GPU step of a 1.5B model."""
        bs, width = proposal.tokens.shape
        table = empty_table(bs, width, candidates, nodes)
        needed = max(CANDIDATE_SPAN * (candidates + width), nodes - 1)
        if needed > self._out_capacity:
            self._grow_output(needed)
        joined, offsets, window = array("i"), array("q", [0]), self._max_window
        for context in contexts:
            joined.extend(_as_list(context[-window:]))
            offsets.append(len(joined))
        streams = self._streams
        modes = array("i", [(streams.get(owner, -1) + 1) * 2 for owner in owners])
        trees = [np.ascontiguousarray(a, dtype=np.int64) for a in (proposal.tokens, proposal.parents, proposal.num_nodes)]
        pointers = [ctypes.c_void_p(a.buffer_info()[0]) for a in (joined, offsets)]
        _checked(self._lib.ngt_forecast(self._handle_arg, pointers[0], pointers[1], bs,
                                        *(ctypes.c_void_p(a.ctypes.data) for a in trees), width,
                                        ctypes.c_void_p(modes.buffer_info()[0]), candidates, CANDIDATE_SPAN, nodes,
                                        int(one_branch), key_cap, ctypes.c_void_p(table.ctypes.data)))
        return table

    def _grow_batch_output(self, cells: int, rows: int) -> None:
        """propose_batch's outputs, reused from call to call (allocating four arrays per
        step costs more than a batch-1 proposal)."""
        cells, rows = max(cells, 2 * self._batch_capacity[0]), max(rows, 2 * self._batch_capacity[1])
        self._batch_out = (np.empty(cells, dtype=np.int64), np.empty(cells, dtype=np.int64),
                           np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64))
        self._batch_pointers = [ctypes.c_void_p(a.ctypes.data) for a in self._batch_out]
        self._batch_capacity = (cells, rows)

    def release(self, owner: int) -> None:
        """A request finished: drop its stream (frontier and owner priority data). Its
        n-grams stay in the shared trie for others."""
        slot = self._streams.pop(owner, None)
        if slot is not None:
            _checked(self._lib.ngt_stream_release(self._handle, slot))

    def num_nodes(self) -> int:
        """Live nodes, the root not counted."""
        return self._lib.ngt_num_nodes(self._handle)

    def _grow_output(self, capacity: int) -> None:
        """propose's output: room for ``capacity`` tokens and as many parents. The C trie keeps
        the address, so the array is replaced, never resized."""
        self._out = array("i", bytes(8 * capacity))
        _checked(self._lib.ngt_set_output(self._handle, self._out.buffer_info()[0], capacity))
        self._out_capacity = capacity

    # ------------------------------------------------ introspection, for tests and debugging
    @property
    def _epoch(self) -> int:
        """Evictions so far."""
        return self._lib.ngt_epoch(self._handle)

    def _check(self) -> int:
        """The C side's structural self-check: 0, or the number of the first broken invariant
        (hash table, sibling lists, rankings, free list, eviction queue, frontiers, follow maps)."""
        return self._lib.ngt_check(self._handle)

    def _nodes(self) -> dict[int, tuple[int, int, int, int]]:
        """Every live node: id -> (token, parent, count, stamp)."""
        n = self.num_nodes()
        ids, tokens, parents = (array("i", bytes(4 * n)) for _ in range(3))
        counts, stamps = array("q", bytes(8 * n)), array("q", bytes(8 * n))
        got = self._lib.ngt_export(self._handle, *(a.buffer_info()[0] for a in
                                                   (ids, tokens, parents, counts, stamps)), n)
        assert got == n
        return {i: (token, parent, count, stamp)
                for i, token, parent, count, stamp in zip(ids, tokens, parents, counts, stamps)}

    def _children(self, node: int) -> dict[int, int]:
        """token -> child, from the node's sibling list."""
        n = _checked(self._lib.ngt_children(self._handle, node, None, None, 0))
        ids, tokens = array("i", bytes(4 * n)), array("i", bytes(4 * n))
        _checked(self._lib.ngt_children(self._handle, node, ids.buffer_info()[0],
                                        tokens.buffer_info()[0], n))
        return dict(zip(tokens, ids))

    def _child(self, node: int, token: int) -> int | None:
        """The child through the hash table."""
        return _checked(self._lib.ngt_child(self._handle, node, token)) or None

    def _top(self, node: int) -> tuple[int, ...]:
        out = array("i", bytes(4 * self.config.max_bfs_breadth))
        n = _checked(self._lib.ngt_top(self._handle, node, out.buffer_info()[0], len(out)))
        return tuple(out[:n])

    def _frontier(self, owner: int) -> tuple[list[int], list[int], int]:
        """An owner's stream: its frontier (node per n-gram length, -1 evicted), tail, epoch."""
        depth = self.config.max_trie_depth
        frontier, tail, state = array("i", bytes(4 * depth)), array("i", bytes(4 * depth)), array("q", bytes(24))
        _checked(self._lib.ngt_stream_state(self._handle, self._streams[owner],
                                            frontier.buffer_info()[0], tail.buffer_info()[0],
                                            state.buffer_info()[0]))
        return frontier[:state[0]].tolist(), tail[:state[1]].tolist(), state[2]

    def _matches(self, window: Sequence[int], owner: int | None = None) -> list[tuple[int, int]]:
        """(node, suffix length) for each suffix of ``window`` (at most max_window long) that
        has a continuation, longest first; through the owner's frontier where it applies."""
        buffer = _int32_buffer(window)
        slot = -1 if owner is None else self._streams[owner]
        nodes, lengths = array("i", bytes(4 * len(buffer))), array("i", bytes(4 * len(buffer)))
        n = _checked(self._lib.ngt_matches(self._handle, buffer.buffer_info()[0], len(buffer), slot,
                                           nodes.buffer_info()[0], lengths.buffer_info()[0],
                                           len(buffer)))
        return list(zip(nodes[:n], lengths[:n]))


def _as_list(tokens: Sequence[int]) -> Sequence[int]:
    if type(tokens) is list or type(tokens) is tuple:
        return tokens
    to_list = getattr(tokens, "tolist", None)  # numpy / torch: plain ints
    return to_list() if to_list is not None else list(tokens)


def _int32_bytes(tokens: Sequence[int]) -> bytes:
    """A list or tuple of ints as int32s; an OverflowError for an id beyond int32."""
    try:
        if len(tokens) < len(_PACKERS):
            return _PACKERS[len(tokens)](*tokens)
    except struct.error:
        pass  # array says what is wrong
    return array("i", tokens).tobytes()


def _int32_buffer(tokens: Sequence[int]) -> array:
    return array("i", _as_list(tokens))


def _checked(result: int) -> int:
    if result == _NO_MEMORY:
        raise MemoryError("the n-gram trie is out of memory")
    if result < 0:
        raise ValueError(f"the n-gram trie rejected an argument (code {result})")
    return result


# ---------------------------------------------------------------- building the C library
_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
_SIGNATURES = {  # name: (restype, argtypes)
    "ngt_create": (_P, [_I64, _I64, _I64, _I32, _I32, _I32, _I32, _I32, _P]),
    "ngt_free": (None, [_P]),
    # Hot: no argtypes, whose conversion costs more than a short call's work. Their C
    # parameters are pointers and int32s, which is what ctypes passes for a c_void_p, a
    # bytes object and an int.
    "ngt_insert": (_I64, None),
    "ngt_propose": (_I64, None),
    "ngt_insert_many": (_I64, [_P, _P, _P, _P, _I64]),
    "ngt_set_output": (_I64, [_P, _P, _I64]),
    "ngt_propose_batch": (_I64, None),
    "ngt_forecast": (_I64, [_P, _P, _P, _I32, _P, _P, _P, _I32, _P, _I32, _I32, _I32, _I32, _I32, _P]),
    "ngt_stream_new": (_I64, [_P, _I32]),
    "ngt_stream_release": (_I64, [_P, _I32]),
    "ngt_num_nodes": (_I64, [_P]),
    "ngt_epoch": (_I64, [_P]),
    "ngt_check": (_I64, [_P]),
    "ngt_export": (_I64, [_P, _P, _P, _P, _P, _P, _I64]),
    "ngt_children": (_I64, [_P, _I32, _P, _P, _I64]),
    "ngt_child": (_I64, [_P, _I32, _I32]),
    "ngt_top": (_I64, [_P, _I32, _P, _I64]),
    "ngt_stream_state": (_I64, [_P, _I32, _P, _P, _P]),
    "ngt_matches": (_I64, [_P, _P, _I64, _I32, _P, _P, _I64]),
}


@functools.cache
def compiled_trie_unavailable() -> str | None:
    """None when the C trie loads; else why not (logged once as a warning)."""
    try:
        _library()
    except (RuntimeError, OSError) as error:
        reason = " ".join(str(error).split())[:300]
        logger.warning("NGRAM drafting runs on the pure-Python n-gram trie, several times slower than the "
                       "compiled one: %s", reason)
        return reason
    return None


@functools.cache
def _library() -> ctypes.PyDLL:
    """The compiled trie, built once per source version and flags. PyDLL: calls keep the GIL
    (a proposal takes microseconds: releasing and taking back the GIL would add to it)."""
    if array("i").itemsize != 4:
        raise RuntimeError("the n-gram trie needs a 4-byte C int")
    path, flags = _library_path()
    if not path.exists():
        _compile(path, flags)
    return _load(ctypes.PyDLL, path)


@functools.cache
def _library_without_gil() -> ctypes.CDLL:
    """The same library through CDLL, whose calls release the GIL: inserts, which run on the
    drafter's writer thread (writer.py) in parallel with the engine's step loop."""
    _library()   # built
    return _load(ctypes.CDLL, _library_path()[0])


def _load(kind: type[ctypes.CDLL], path: Path) -> ctypes.CDLL:
    lib = kind(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype = restype
        if argtypes is not None:
            function.argtypes = argtypes
    return lib


def _library_path() -> tuple[Path, list[str]]:
    """Where the library for this source, these flags and this platform lives, and the flags."""
    flags = [*_CFLAGS, *shlex.split(os.environ.get(_EXTRA_CFLAGS_ENV, ""))]
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), " ".join(flags).encode(),
                                     platform.machine().encode(), platform.system().encode()]))
    cache = Path(os.environ.get("SPECSERVE_CACHE_DIR") or Path.home() / ".cache" / "specserve")
    return cache / f"ngram_trie-{key.hexdigest()[:16]}.so", flags


def _compile(path: Path, flags: list[str]) -> None:
    """Builds to a temporary name and renames: processes starting together (pytest-xdist,
    several servers) each build, and none loads a half-written file."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise RuntimeError(f"the n-gram trie ({_SOURCE.name}) is C compiled on first use, and no C "
                           "compiler was found: install one (cc, gcc or clang) or set CC")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RuntimeError(f"cannot create {path.parent} for the compiled n-gram trie: {error}; "
                           "set SPECSERVE_CACHE_DIR to a writable directory") from error
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    command = [*shlex.split(compiler), *flags, "-o", str(temporary), str(_SOURCE)]
    try:
        try:
            result = subprocess.run(command, capture_output=True, text=True)
        except OSError as error:
            raise RuntimeError(f"cannot run the C compiler {compiler!r}: {error}") from error
        if result.returncode != 0:
            raise RuntimeError(f"compiling the n-gram trie failed: {shlex.join(command)}\n{result.stderr}")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
