"""ProbeSchedule: which plain steps probe, and for which requests of the batch.

After a plain step's tokens are committed, while the GPU runs the next step, the engine
proposes for up to PROBE_REQUESTS requests of the batch as shadows only (`probe`): no
verify is paid for, yet the evidence keeps coming. Which requests: a window rotating through
the batch (`requests`), or, for a model drafter, those whose draft caches lack the fewest rows
(engine/core.py's _probe_sample: each proposal first feeds what its cache lacks).

A probe is host time a plain step would not spend (the proposals, their shadows, and the
drafter's indexing of the tokens committed since the last probe, which plain steps leave
to the probes), and where a plain step is short that time is not hidden: on an H100 a
0.5B at batch 1 (plain steps ~0.9 ms) ran 0.70-0.79x of a plain engine in plain mode, and
on the CPU (lab/plain_step_host.py) probing and indexing on every plain step were
nearly all of the host time a plain step of the speculative engine added. So a bucket
probes every k-th plain step (`due`), k the smallest that keeps the probes' measured
host time within PROBE_BUDGET of its plain step's measured cost (at most MAX_PROBE_EVERY, or
the drafter's own cap: a model drafter's probe is forwards and a host sync, 3-4 ms on an H200
at batch 1 against a 1.27-ms plain step, so every 32nd step it cost ~10%).
The budget is 1%: what a probe step costs beyond its timed part (colder caches) measured
up to as much again. New requests are the exception: the first plain step after a
prefill completes probes (`admit`), since a new request's drafts may match from its first
token (a repeated or edited prompt) where the batch's history says nothing about it; one
probe per prefill step, whatever the number of requests it completed. Where a probe sees
the whole batch (at most PROBE_REQUESTS requests) the 2nd, 4th, 8th and 16th plain steps
after an admission probe too: an answer's first tokens rarely match (a code fence, a line
of preamble) where what follows often copies the prompt. On an H100 at batch 1 (1.5B,
code-types) the one probe at the first step saw no match and the bucket decoded plainly
for the next 41 steps, at 692 tok/s where its drafting episode had made 1863. For the same
reason a small batch probes at once when it enters a bucket other than its last step's:
the requests left when a wave drains carry their evidence into a bucket that may have been
held plain (H100, 1.5B, repeated turn 2 at concurrency 8: 36 drafting steps at 39 tokens
each, then 46-54 plain steps for the last one or two requests). A batch larger than a
probe covers probes for admissions at most every ADMIT_GAP plain steps: where prefills
complete every few steps (ShareGPT at 64 on an H100, 0.5B: ~48 prefill steps in ~260 decode
steps) admission probes were most of the 92 plain steps of 3.7 ms against 1.7 ms for the
others, and a probe there samples PROBE_REQUESTS of the batch, often not the new requests.
Sampling only the newly admitted requests in such a probe (and expecting of the others what
the last window probe saw) was tried and measured worse, A/B in one H200 lease (session 21,
chat cells at 32/64, both rounds): geomean 0.903x plain against 0.944x (0.5B), 0.933x against
0.942x (1.5B); reverted.
After a drafting episode that won by the switch margin (modes.py), a batch a
probe covers whole probes its next plain steps REOPEN_FOLLOW_UPS (`reopen`): the drafts that
paid are often back within a few tokens (the copy resumes after an edit), and at k ~10 the
bucket would decode plainly well past that (policy_sim's copies with edits at batch 1: 1.6x
plain with the bucket held and probed at k, ~2.2x with these follow-ups).
A batch larger than a probe covers backs its admission probes off while they keep it plain:
its admission gap doubles after each such probe, up to ADMIT_GAP << ADMIT_BACKOFF_DOUBLINGS,
and a probe that switches resets it. On an H200 at 64 (0.5B, ShareGPT, session 34) prefills
completed every few steps and admission probes came every 8 plain steps, 62-88 us of a plain
step's host time on average, where the host nearly set the pace and the speculative engine's
plain steps took 4-10% longer than a plain engine's.
A probe that costs forwards (a model drafter's: `every_at_least` > 1) takes only the first
of these, the admission probe of a batch it covers whole; a large batch probes on its k alone.
There admissions made a probe every `every_at_least` plain steps, each a head catch-up (~5 ms):
with the head's feeds, a 1.5B EAGLE-3 engine's plain steps at 64 cost +15-25% over a plain
engine's on an H200 (session 16).
In a bucket a probe covers whole, such costly probes back off while they find drafting not
worth it: after each probe that did not switch the bucket to drafting, its cap doubles (up
to BACKOFF_DOUBLINGS times) and, from the SKIP_ADMIT_AFTER-th in a row, admissions no longer
probe it; a switch resets both. With the cap alone, a 1.5B EAGLE-3 engine whose head never
drafted (accept 1.17, every probe "stays plain") made 0.92-0.96x of plain's tok/s at batch
1 (H200, session 25): a ~4.5-ms probe per admission and per 128 plain steps of ~1.3 ms.
Backed off, the budget (a probe's cost against 1% of a plain step) sets k again: a random
0.5B head held plain went 0.88-0.95x -> 0.91-0.96x at batch 1 (a cell with one stall left
out) and 0.82-0.91x -> 0.86-0.99x at 8 (one wave a cell, one lease). Larger buckets keep
the cap: there the backed-off run was worse in 3 of 5 cells at 64 (0.60-0.74x against
0.68-0.78x), perhaps the head's held states fed in larger, rarer catch-ups; not traced.
A batch that drafted in a larger bucket and shrinks into a plain one (a wave that drains)
probes that bucket's next plain step, a costly probe too (`left_drafting`): its requests'
evidence is fresh and a model drafter's caches hold their rows, so the probe costs the
drafts alone. Without it a 1.5B EAGLE-3 engine's drain decoded plainly from 16 requests
down (H100, ShareGPT second turns at 32 and 64: the smaller buckets' first costly probe
was 16 plain steps away, about what each bucket lasts), 35-45 plain steps of ~1.8 ms at
the end of a run where drafting makes 1.5x there; its cells made 1.01-1.11x against
pinned drafting's 1.10-1.17x. With it they moved within their rounds' spread (H100, one
lease, two runs: 1.00x / 1.00x at 64, 1.07x / 1.04x at 32, against 1.02x / 0.99x and
1.09x / 1.01x): in the traces the buckets a drain enters had no rates yet, and a probe
does not switch a bucket whose plain decoding is not steadily priced (docs/journal/2026-12-06.md,
session 68).
On the overlap schedule a probe runs only while a step launched ahead computes: one due on
a step that launches none (a request ends in it) is put off to the next plain step
(`put_off`) instead of adding its host time to a step the GPU waits for.
"""
from __future__ import annotations

import math

PROBE_REQUESTS = 16    # proposals per probe
PROBE_BUDGET = 0.01    # probes' timed host work may add this fraction to a plain step, on average
MAX_PROBE_EVERY = 32   # ... but a plain bucket is probed at least every this many steps
ADMIT_FOLLOW_UPS = (2, 4, 8, 16)   # plain steps after an admission that probe a small batch again
ADMIT_GAP = 8          # a larger batch probes for admissions no more often than every this many plain steps
ADMIT_BACKOFF_DOUBLINGS = 2   # ... and after probes in a row that kept it plain, up to 4x as seldom
REOPEN_FOLLOW_UPS = (1, 2, 3, 4, 6, 8, 12, 16)   # plain steps after an episode that won which probe a small batch
PROBE_COST_EMA = 0.3
BACKOFF_DOUBLINGS = 3  # a small bucket's costly probe cap grows to 8x after as many probes in a row kept it plain
SKIP_ADMIT_AFTER = 2   # ... and from this many in a row, admissions stop probing the bucket


class ProbeSchedule:
    def __init__(self, budget: float = PROBE_BUDGET, max_every: int = MAX_PROBE_EVERY):
        self.budget = budget
        self.max_every = max_every
        self._offset = 0                          # rotates the requests a probe drafts for
        self._cost: dict[int, float] = {}         # bucket -> host seconds of a probe
        self._unprobed: dict[int, int] = {}       # bucket -> plain steps since its last probe
        self._every: dict[int, int] = {}          # bucket -> k, set when a probe is timed
        self._admitted = False                    # requests started decoding since the last probe
        self._since_admit = max(ADMIT_FOLLOW_UPS)  # plain steps since the last admission
        self._last_step_bucket: int | None = None  # the bucket of the last step taken, either mode
        self._owed: set[int] = set()              # buckets whose due probe was put off (put_off)
        self._kept_plain: dict[int, int] = {}     # bucket -> probes in a row that did not switch it
        self._since_reopen: dict[int, int] = {}   # small bucket -> plain steps since an episode that won ended
        self._left: set[int] = set()              # buckets a drafting batch shrank into, not probed since

    def admit(self) -> None:
        """Requests finished their prefill: the next plain step probes (and, in a small
        batch, its ADMIT_FOLLOW_UPS)."""
        self._admitted = True
        self._since_admit = 0

    def reopen(self, bucket: int) -> None:
        """A drafting episode that won ended: a bucket a probe covers whole probes its next
        plain steps REOPEN_FOLLOW_UPS."""
        if bucket <= PROBE_REQUESTS:
            self._since_reopen[bucket] = 0

    def left_drafting(self, bucket: int) -> None:
        """A batch that drafted in a larger bucket shrank into this plain one: its next plain
        step probes, costly probes too (the module docstring says why)."""
        self._left.add(bucket)

    def note_step(self, bucket: int) -> None:
        """Every step, plain or drafting, after it ran."""
        self._last_step_bucket = bucket

    def requests(self, batch_size: int) -> range:
        """Which requests of a plain step to propose for, as shadows (a rotating window)."""
        count = min(batch_size, PROBE_REQUESTS)
        start = self._offset % batch_size
        self._offset += count
        return range(start, start + count)

    def due(self, bucket: int, every_at_least: int = 1, every_at_most: int | None = None) -> bool:
        """Whether this plain step probes: every k-th plain step of its bucket (counted here),
        or the first after requests were admitted (and, in a bucket a probe covers whole, its
        follow-ups and the first step after the batch entered the bucket), never below
        `every_at_least` (a drafter whose proposals cost forwards); k is capped at
        `every_at_most` (None: the schedule's max_every)."""
        waited = self._unprobed.get(bucket, 0) + 1
        self._since_admit += 1
        small = bucket <= PROBE_REQUESTS
        cheap = every_at_least == 1   # a probe that costs forwards takes less news (module docstring)
        kept_plain = self._kept_plain.get(bucket, 0) if small and not cheap else 0   # costly probes back off
        entered = self._last_step_bucket is not None and bucket != self._last_step_bucket
        admit_gap = ADMIT_GAP << min(self._kept_plain.get(bucket, 0), ADMIT_BACKOFF_DOUBLINGS)
        admitted = self._admitted and (small or (cheap and waited >= admit_gap)) and kept_plain < SKIP_ADMIT_AFTER
        reopened = self._reopened(bucket)   # counted on every plain step of the bucket
        follow_up = cheap and small and (entered or self._since_admit in ADMIT_FOLLOW_UPS or reopened)
        left = bucket in self._left
        news = admitted or bucket in self._owed or follow_up or left
        cap = (self.max_every if every_at_most is None else every_at_most) << min(kept_plain, BACKOFF_DOUBLINGS)
        every = min(self._every.get(bucket, 1), cap)
        if (waited < every_at_least and not left) or (waited < every and not news):
            self._unprobed[bucket] = waited
            return False
        self._unprobed[bucket] = 0
        self._admitted = False
        self._owed.discard(bucket)
        self._left.discard(bucket)
        return True

    def _reopened(self, bucket: int) -> bool:
        """Counts a plain step of a reopened bucket: whether it is one of the follow-ups."""
        since = self._since_reopen.get(bucket)
        if since is None:
            return False
        since += 1
        if since >= max(REOPEN_FOLLOW_UPS):
            del self._since_reopen[bucket]
        else:
            self._since_reopen[bucket] = since
        return since in REOPEN_FOLLOW_UPS

    def verdict(self, bucket: int, switched: bool) -> None:
        """What a probe of the bucket concluded: drafting again (`switched`), or not."""
        self._kept_plain[bucket] = 0 if switched else self._kept_plain.get(bucket, 0) + 1
        if switched:
            self._since_reopen.pop(bucket, None)   # the follow-ups found the drafts back

    def put_off(self, bucket: int) -> None:
        """The probe `due` granted did not run: the bucket's next plain step probes."""
        self._owed.add(bucket)

    def every(self, bucket: int) -> int:
        """k for the bucket: 1 until a probe and a plain step have been timed."""
        return min(self._every.get(bucket, 1), self.max_every)

    def record(self, bucket: int, seconds: float, plain_step_seconds: float | None) -> None:
        """The host time of a probe; sets the bucket's k against its plain step's current
        cost (None while no plain step of the bucket has been timed)."""
        old = self._cost.get(bucket)
        probe = self._cost[bucket] = seconds if old is None else old + PROBE_COST_EMA * (seconds - old)
        if plain_step_seconds:
            self._every[bucket] = max(1, math.ceil(probe / (self.budget * plain_step_seconds)))  # capped in `due`
