"""A completion stream sends one chunk for each step that brought tokens, as SGLang and vLLM do,
also when the step's text is empty (a byte of a UTF-8 character not yet whole): a client that
times tokens by chunks sees every step. No model: the engine's chunks are made here."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from specserve.server.openai_api import _completion_events, _Reply


def _chunk(text: str, ids: list[int], finish: dict | None = None) -> dict:
    return {"text": text, "output_ids": ids,
            "meta_info": {"finish_reason": finish, "prompt_tokens": 3, "completion_tokens": 3}}


async def _engine_chunks():
    yield _chunk("", [200])             # the first byte of "é"
    yield _chunk("é", [169])
    yield _chunk("", [])                # nothing new: no chunk
    yield _chunk("", [5], {"type": "length"})


def _events(stream) -> list:
    async def collect():
        return [event async for event in stream]
    raw = asyncio.run(collect())
    return [json.loads(e.removeprefix(b"data: ")) for e in raw if e != b"data: [DONE]\n\n"]


def test_a_step_whose_text_is_empty_still_makes_a_chunk():
    state = SimpleNamespace(engine_stopped=False)
    events = _events(_completion_events(state, _Reply("cmpl-1", "text_completion", "m"), [_engine_chunks()],
                                        echo=[""], logprobs=False, include_usage=True))
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert [c["text"] for c in choices] == ["", "é", ""]
    assert [c["finish_reason"] for c in choices] == [None, None, "length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
