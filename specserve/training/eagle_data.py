"""Training data for an EAGLE head, made by the target itself (self-distillation).

A Conversation is token ids and the spans of them the head learns to predict: the target's
own answer after a prompt (generated here through our Engine, greedy or sampled), or the
replies of a fixed chat text (eagle_chats.py), where the target's distribution over the
text, not the text, is what the head learns. A head trained on the target's own answers
and distributions learns what it will be asked to predict at serving time, with no data
beyond what PyPI ships.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Conversation:
    tokens: list[int]   # prompt + answer, or a whole chat text
    prompt_len: int     # the (first) answer starts here
    # fixed text: [start, end) of each reply to learn; None: the target's own answer, tokens[prompt_len:]
    reply_spans: list[list[int]] | None = None

    @property
    def answer_len(self) -> int:
        return sum(end - start for start, end in self.answers())

    @property
    def is_fixed_text(self) -> bool:
        return self.reply_spans is not None

    def answers(self) -> list[tuple[int, int]]:
        """[start, end) of each answer."""
        if self.reply_spans is None:
            return [(self.prompt_len, len(self.tokens))]
        return [(start, end) for start, end in self.reply_spans]

    def answer_tokens(self) -> list[int]:
        return [token for start, end in self.answers() for token in self.tokens[start:end]]


def generate_conversations(engine: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                           on_done: Callable[[], None] = lambda: None, seed: int = 0,
                           max_in_flight: int | None = None, deadline: float | None = None) -> list[Conversation]:
    """The target's answers to `prompts`, in order; with a `deadline` (time.perf_counter()),
    no prompt is sent after it and the answers of those sent come back (a prefix of the
    prompts' answers, perhaps shorter than the list). At most max_in_flight (default: all) are
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
            if deadline is not None and time.perf_counter() >= deadline:
                left = 0
            if left and room >= min(wave, left):
                count = min(room, left)
                in_flight |= {asyncio.ensure_future(answer(i)) for i in range(submitted, submitted + count)}
                submitted += count
            if not in_flight:
                break
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()   # an engine error ends generation here

    answers: list[Conversation | None] = [None] * len(prompts)
    asyncio.run(answer_all())
    return [answer for answer in answers if answer is not None]


def save_conversations(path: str, conversations: list[Conversation]) -> None:
    with open(path, "w") as f:
        json.dump([asdict(c) for c in conversations], f)


def load_conversations(path: str) -> list[Conversation]:
    with open(path) as f:
        return [Conversation(**item) for item in json.load(f)]   # files without reply_spans: generated answers
