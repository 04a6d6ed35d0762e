"""GPU check of the Triton attention backend: numbers against torch_native, time against
the bytes-moved roofline, and the CUDA-graph path (capture, then replay another batch).

    python -m lab.check_gpu [--out table.md] [--smoke]

Sizes follow Qwen2.5-1.5B (12 q heads, 2 kv heads, head_dim 128) in bf16. Errors are
measured against torch_native run in fp32 on the same bf16 K/V, next to torch_native's own
bf16 error. Times are GPU time per layer from CUDA-graph replays over enough layers that
the K/V never sits in L2. Roofline = bytes the attention must move (K/V of every key, q,
out, the new K/V) / measured device bandwidth (the better of copy and read); "roof%" =
roofline time / time.
`--smoke` runs tiny sizes on the CPU in Triton's interpreter (no timing of note), to
check the script itself where there is no GPU. Exit status 1 if any check fails.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HEADS = (12, 2, 128)  # num_heads, num_kv_heads, head_dim
TREE_SIZE = 8
TIMING_BYTES = 256 * 2**20  # K/V read per timed call: several times the L2 of an H100/H200
TIMING_MAX_LAYERS = 256


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU in the Triton interpreter")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported below
    elif not torch.cuda.is_available():
        print("check_gpu needs a CUDA device (or --smoke)")
        return 1
    checker = Checker(smoke=args.smoke)
    rows = checker.run()
    table = format_table(rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    failed = [r for r in rows if r["ok"] != "ok"]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


class Checker:
    def __init__(self, smoke: bool, time_native: bool = True):
        from specserve.attention.torch_native import TorchNativeBackend
        from specserve.attention.triton_backend import TritonBackend

        self.smoke = smoke
        self.time_native = time_native
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16  # the interpreter has no bf16 dot
        self.batch_sizes = (1, 3) if smoke else (1, 8, 32, 64)
        self.contexts = (40, 200) if smoke else (512, 2048, 8192)
        self.triton = TritonBackend(*HEADS)
        self.native = TorchNativeBackend(*HEADS)
        self.bandwidth = self._bandwidth()

    def run(self) -> list[dict]:
        from specserve.attention.base import ForwardMode

        rows = []
        for mode, n in ((ForwardMode.DECODE, 1), (ForwardMode.VERIFY, TREE_SIZE)):
            for bs in self.batch_sizes:
                for ctx in self.contexts:
                    rows.append(self._check(mode, [ctx] * bs, [n] * bs))
        prefill_len = 64 if self.smoke else 1024
        rows.append(self._check(ForwardMode.EXTEND, [0, prefill_len], [prefill_len, prefill_len // 2]))
        if not self.smoke:
            for mode, n in ((ForwardMode.DECODE, 1), (ForwardMode.VERIFY, TREE_SIZE)):
                rows.append(self._check_graph(mode, n))
        return rows

    # --- pools and batches ---
    def _pool(self, num_slots: int, max_requests: int, max_context: int, num_layers: int = 1):
        from specserve.kv.pool import KVPool

        pool = KVPool(num_layers=num_layers, num_kv_heads=HEADS[1], head_dim=HEADS[2], size=num_slots,
                      max_requests=max_requests, max_context=max_context, dtype=self.dtype, device=self.device)
        for buffer in pool.k_buffers + pool.v_buffers:
            buffer.normal_()
        return pool

    def _timing_layers(self, prefix_lens: list[int], extend_lens: list[int]) -> int:
        """Layers to cycle through when timing, so that their K/V (like a real model's) far
        exceeds the L2 cache and every layer reads from HBM."""
        if self.smoke:
            return 1
        layer_bytes = 2 * sum(p + e for p, e in zip(prefix_lens, extend_lens)) * HEADS[1] * HEADS[2] * 2
        return max(1, min(TIMING_MAX_LAYERS, -(-TIMING_BYTES // layer_bytes)))

    def _batch(self, pool, mode, prefix_lens: list[int], extend_lens: list[int], seed: int):
        from specserve.attention.base import ForwardBatch, ForwardMode

        gen = torch.Generator().manual_seed(seed)
        bs, num_tokens = len(prefix_lens), sum(extend_lens)
        # shuffled slots, as after many allocations and frees
        slots = (torch.randperm(pool.size, generator=gen)[:sum(prefix_lens) + num_tokens] + 1).to(self.device)
        pool.req_to_token.zero_()
        start = 0
        for row, prefix in enumerate(prefix_lens):
            pool.write_positions(row, 0, slots[start:start + prefix].to(torch.int32))
            start += prefix
        tree_mask = random_trees(bs, max(extend_lens), gen).to(self.device) if mode is ForwardMode.VERIFY else None
        long = dict(dtype=torch.long, device=self.device)
        batch = ForwardBatch(
            mode=mode, input_ids=torch.zeros(num_tokens, **long), positions=torch.zeros(num_tokens, **long),
            out_slots=slots[start:].clone(), req_rows=torch.arange(bs, **long),
            prefix_lens=torch.tensor(prefix_lens, **long), extend_lens=torch.tensor(extend_lens, **long),
            prefix_lens_host=list(prefix_lens), extend_lens_host=list(extend_lens), kv_pool=pool,
            logits_indices=torch.arange(num_tokens, **long), tree_mask=tree_mask)
        q, k, v = (torch.randn((num_tokens, heads, HEADS[2]), generator=gen).to(self.device, self.dtype)
                   for heads in (HEADS[0], HEADS[1], HEADS[1]))
        return batch, q, k, v

    def _reference(self, batch, q, k, v):
        """torch_native in fp32 over the stored (bf16) K/V, and torch_native in the run dtype."""
        self.native.plan(batch)
        exact = self.native.forward(q.float(), k.float(), v.float(), 0, batch)
        return exact, self.native.forward(q, k, v, 0, batch)

    # --- checks ---
    def _check(self, mode, prefix_lens: list[int], extend_lens: list[int]) -> dict:
        layers = self._timing_layers(prefix_lens, extend_lens)
        kv_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        pool = self._pool(sum(kv_lens), len(kv_lens), max(kv_lens), layers)
        batch, q, k, v = self._batch(pool, mode, prefix_lens, extend_lens, seed=len(prefix_lens) + prefix_lens[-1])
        exact, native = self._reference(batch, q, k, v)
        self.triton.plan(batch)
        out = self.triton.forward(q, k, v, 0, batch)
        err = (out.float() - exact).abs().max().item()
        native_err = (native.float() - exact).abs().max().item()
        meta = batch.attn_metadata
        splits = meta.partial_out.shape[2] if meta.partial_out is not None else 1

        def all_layers(backend):
            return lambda: [backend.forward(q, k, v, layer, batch) for layer in range(layers)]

        triton_ms = self._time(all_layers(self.triton)) / layers
        native_ms = None
        if self.time_native:
            self.native.plan(batch)
            native_ms = self._time_native(all_layers(self.native))
            native_ms = None if native_ms is None else native_ms / layers
        roof_ms = self._bytes(batch) / self.bandwidth * 1e3
        return dict(mode=mode.value, bs=len(prefix_lens), ctx=max(prefix_lens), n=max(extend_lens), splits=splits,
                    err=err, native_err=native_err, triton_us=triton_ms * 1e3,
                    native_us=None if native_ms is None else native_ms * 1e3,
                    roof_pct=100 * roof_ms / triton_ms if mode.value != "extend" else None,
                    ok="ok" if err <= max(2 * native_err, 1e-2) and torch.isfinite(out).all() else "FAIL")

    def _check_graph(self, mode, n: int) -> dict:
        """Capture forward for one batch, replay it for another (other lengths, slots, data)."""
        bs = 8
        ctx = max(self.contexts)
        pool = self._pool(bs * (ctx + n), bs, ctx + 2 * TREE_SIZE)
        self.triton.init_cuda_graph_state(max_bs=bs, max_tokens_per_req=TREE_SIZE, kv_pool=pool)
        first, q, k, v = self._batch(pool, mode, [ctx // 4] * bs, [n] * bs, seed=1)
        static = dict(q=q.clone(), k=k.clone(), v=v.clone())
        self.triton.plan_for_capture(first)
        for _ in range(2):  # compile and warm up outside the capture
            self.triton.forward(static["q"], static["k"], static["v"], 0, first)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.triton.forward(static["q"], static["k"], static["v"], 0, first)

        prefix_lens = [ctx - 37 * i for i in range(bs)]  # longer and ragged: other split lengths
        second, q, k, v = self._batch(pool, mode, prefix_lens, [n] * bs, seed=2)
        exact, native = self._reference(second, q, k, v)
        self.triton.plan_for_replay(second)
        first.out_slots.copy_(second.out_slots)  # the runner's static inputs
        for name, value in (("q", q), ("k", k), ("v", v)):
            static[name].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        err = (static_out.float() - exact).abs().max().item()
        native_err = (native.float() - exact).abs().max().item()
        meta = second.attn_metadata
        return dict(mode=f"{mode.value}+graph", bs=bs, ctx=ctx, n=n,
                    splits=meta.partial_out.shape[2] if meta.partial_out is not None else 1,
                    err=err, native_err=native_err, triton_us=None, native_us=None, roof_pct=None,
                    ok="ok" if err <= max(2 * native_err, 1e-2) else "FAIL")

    # --- timing ---
    def _time(self, fn) -> float:
        """Milliseconds of GPU time per call (median), replayed from a CUDA graph: no launch
        overhead, as in the graphed serving loop."""
        if self.smoke:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        from triton.testing import do_bench_cudagraph
        return do_bench_cudagraph(fn, return_mode="median")

    def _time_native(self, fn) -> float | None:
        try:
            return self._time(fn)
        except RuntimeError as error:  # the reference is not required to be graph-safe
            print(f"torch_native not timed: {error}", file=sys.stderr)
            return None

    def _bandwidth(self) -> float:
        """Bytes per second the device moves: the better of a large copy (read + write) and a
        large read (a sum), since attention mostly reads."""
        if self.smoke:
            return 1e10
        src = torch.empty(1024 * 2**20, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        copy = 2 * src.numel() / (self._time(lambda: dst.copy_(src)) * 1e-3)
        words = src.view(torch.float32).normal_()
        read = src.numel() / (self._time(lambda: words.sum()) * 1e-3)
        print(f"measured bandwidth: copy {copy / 1e9:.0f} GB/s, read {read / 1e9:.0f} GB/s")
        return max(copy, read)

    def _bytes(self, batch) -> int:
        num_heads, num_kv_heads, head_dim = HEADS
        item = torch.empty((), dtype=self.dtype).element_size()
        keys = sum(p + e for p, e in zip(batch.prefix_lens_host, batch.extend_lens_host))
        kv_read = 2 * keys * num_kv_heads * head_dim * item
        new_kv = 2 * batch.num_tokens * num_kv_heads * head_dim * item * 2  # read from k/v, written to the pool
        q_out = 2 * batch.num_tokens * num_heads * head_dim * item
        return kv_read + new_kv + q_out


def random_trees(bs: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """(bs, n, n) bool ancestor-or-self masks of random trees (parent of node i < i)."""
    parents = (torch.rand((bs, n), generator=gen) * torch.arange(n)).long()  # (bs, n), parents[:, 0] unused
    mask = torch.zeros((bs, n, n), dtype=torch.bool)
    mask[:, 0, 0] = True
    for i in range(1, n):
        mask[:, i] = mask[torch.arange(bs), parents[:, i]]
        mask[:, i, i] = True
    return mask


def format_table(rows: list[dict]) -> str:
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = ["| mode | bs | ctx | n | splits | max err | native err | triton us | native us | roof% | check |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['bs']} | {r['ctx']} | {r['n']} | {r['splits']} | {r['err']:.2e} | "
                     f"{r['native_err']:.2e} | {cell(r['triton_us'], '.1f')} | {cell(r['native_us'], '.1f')} | "
                     f"{cell(r['roof_pct'], '.0f')} | {r['ok']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
