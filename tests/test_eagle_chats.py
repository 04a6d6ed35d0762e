"""Training data from whole chats (eagle_chats.py), with SmolLM2's tokenizer and chat
template: every user turn yields a prompt whose context is the chat so far and ends where
that turn's reply begins; long prompts lose their oldest turns; the fixed-text replies are
the spans of the assistant turns."""
from __future__ import annotations

import pytest

from specserve.training.eagle_chats import reply_text_conversation, reply_text_conversations, turn_prompts

CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
    {"role": "user", "content": "Which one is older?"},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from specserve.model.loader import load_tokenizer
    return load_tokenizer(smollm2_path)


def test_every_user_turn_yields_a_prompt_that_ends_before_its_reply(tokenizer):
    prompts = turn_prompts([CHAT], tokenizer, max_prompt_tokens=1024)
    assert len(prompts) == 3
    conversation = reply_text_conversation(CHAT, tokenizer, max_tokens=1024)
    starts = [start for start, _ in conversation.reply_spans]
    # turns 1 and 2 have replies in the chat: their prompts are the chat's text up to the reply
    for prompt, reply_start in zip(prompts, starts):
        assert prompt == conversation.tokens[:reply_start]
    for number, prompt in enumerate(prompts):
        text = tokenizer.decode(prompt)
        user_turns = [m["content"] for m in CHAT if m["role"] == "user"]
        replies = [m["content"] for m in CHAT if m["role"] == "assistant"]
        assert text.endswith(user_turns[number] + "<|im_end|>\n<|im_start|>assistant\n")
        assert all(turn in text for turn in user_turns[:number + 1] + replies[:number])   # the chat so far
        assert not any(turn in text for turn in user_turns[number + 1:] + replies[number:])   # nothing after
    # the last turn has no reply in the chat: its prompt is the whole chat and the assistant header
    assert tokenizer.decode(prompts[2]) == tokenizer.apply_chat_template(CHAT, tokenize=False,
                                                                         add_generation_prompt=True)


def test_a_long_prompt_loses_its_oldest_turns(tokenizer):
    whole = turn_prompts([CHAT], tokenizer, max_prompt_tokens=1024)[2]
    alone = turn_prompts([CHAT[4:]], tokenizer, max_prompt_tokens=1024)[0]
    prompts = turn_prompts([CHAT], tokenizer, max_prompt_tokens=len(whole) - 1)
    assert prompts[:2] == turn_prompts([CHAT], tokenizer, 1024)[:2]
    text = tokenizer.decode(prompts[2])
    assert "Italy" in text and "France" not in text and len(prompts[2]) < len(whole)   # turns 2 and 3 only
    # turn 3 alone does not fit: left out (a shorter turn still fits)
    short = turn_prompts([CHAT], tokenizer, max_prompt_tokens=len(alone) - 1)
    assert 1 <= len(short) < 3 and not any("older" in tokenizer.decode(prompt) for prompt in short)
    assert len(turn_prompts([CHAT, CHAT], tokenizer, 1024, limit=4)) == 4


def test_reply_text_spans_are_the_assistant_turns(tokenizer):
    conversation = reply_text_conversation(CHAT, tokenizer, max_tokens=1024)
    assert conversation.is_fixed_text and conversation.prompt_len == conversation.reply_spans[0][0]
    replies = [m["content"] for m in CHAT if m["role"] == "assistant"]
    for (start, end), reply in zip(conversation.reply_spans, replies):
        # the reply and the end-of-turn marks the target predicts after it
        assert tokenizer.decode(conversation.tokens[start:end]).startswith(reply + "<|im_end|>")
    assert tokenizer.decode(conversation.tokens) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert conversation.answer_len == sum(end - start for start, end in conversation.reply_spans)
    # cut short: only the replies that start within the cut, the last one cut too
    second_start = conversation.reply_spans[1][0]
    cut = reply_text_conversation(CHAT, tokenizer, max_tokens=second_start + 3)
    assert cut.reply_spans == [conversation.reply_spans[0], [second_start, second_start + 3]]
    # no reply (or one that answers no user turn): nothing to learn
    assert reply_text_conversations([CHAT[:1], CHAT[1:2], CHAT], tokenizer, 1024) == [conversation]


@pytest.fixture(scope="module")
def sharegpt_chats():
    """Real chats, of one to many turns, some longer than the prompts' 256 tokens."""
    from specserve.training.eagle_chats import training_chats
    return training_chats(None, None)[:48]


def test_turn_prompts_in_worker_processes_equal_the_serial_ones(tokenizer, sharegpt_chats):
    serial = turn_prompts(sharegpt_chats, tokenizer, max_prompt_tokens=256, workers=1)
    assert len(serial) > len(sharegpt_chats)   # later turns too, in 8 chunks of 6 chats
    assert turn_prompts(sharegpt_chats, tokenizer, max_prompt_tokens=256, workers=2) == serial
    # a limit: the same first prompts, from the chats that hold them (and more where turns were left out)
    limit = len(serial) // 3 + 1
    assert turn_prompts(sharegpt_chats, tokenizer, 256, limit=limit, workers=2) == serial[:limit]
    assert turn_prompts(sharegpt_chats, tokenizer, 256, limit=limit, workers=1) == serial[:limit]


def test_reply_text_in_worker_processes_equals_the_serial_one(tokenizer, sharegpt_chats):
    serial = reply_text_conversations(sharegpt_chats, tokenizer, max_tokens=256, workers=1)
    assert len(serial) >= len(sharegpt_chats) // 2
    assert reply_text_conversations(sharegpt_chats, tokenizer, max_tokens=256, workers=2) == serial


def test_few_chats_or_one_core_are_tokenized_serially():
    from specserve.training.chat_pool import pool_workers
    assert pool_workers(10_000, chat_seconds=0.01, cores=1) == 1
    assert pool_workers(40, chat_seconds=0.01, cores=16) == 1          # 0.4 s of work: less than a start
    assert pool_workers(600, chat_seconds=0.006, cores=2) == 1         # saves 1.8 s, starting costs 2.5 s
    assert pool_workers(600, chat_seconds=0.012, cores=2) == 2
    assert pool_workers(2800, chat_seconds=0.02, cores=16) == 16       # an H100 machine's 56 s
    assert pool_workers(320, chat_seconds=0.05, cores=128) == 10       # a worker has 32 chats or more
