"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models, plus vLLM's
/tokenize and /detokenize. Requests become engine calls through `ServerState`; responses
and server-sent events follow OpenAI's shapes (usage, logprobs, `data: [DONE]`).

As SGLang, the server serves one model and takes a request's `model` as whatever name the
client knows it by: any name is served by it (responses name the served model)."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from specserve.server.disconnect import gather_all
from specserve.server.protocol import (SSE_DONE, APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                       TokenId, error_event, finish_reason, matched_stop, sse)
from specserve.server.state import INLINE_TEXT_CHARS, ServerState
from specserve.server.tool_calls import ToolCalls, stream_delta


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        state.check_model_exists(model)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await state.parse(request, CompletionRequest)
        id_lists = [await state.encode(p) if isinstance(p, str) else p for p in body.prompts()]
        explicit = "max_tokens" in body.model_fields_set and body.max_tokens is not None
        for ids in id_lists:
            state.check_token_ids(ids, param="prompt")
            state.check_length(ids, body.max_tokens if explicit else None)
        max_new_tokens = body.max_tokens if body.max_tokens is not None else state.context_length
        params = body.sampling_params(max_new_tokens)
        logprob_args = (body.logprobs is not None, body.logprobs or 0)
        echo = [await state.decode(ids) if body.echo else "" for ids in id_lists]
        reply = _Reply(f"cmpl-{uuid.uuid4().hex}", "text_completion", state.model_name)
        if body.stream:
            streams = [await state.open_stream(ids, params, *logprob_args) for ids in id_lists]
            return _sse_response(_completion_events(state, reply, streams, echo, body.logprobs is not None,
                                                    body.include_usage))
        results = await state.unless_disconnected(request, gather_all(
            *(state.generate(ids, params, *logprob_args) for ids in id_lists)))
        choices = []
        for index, result in enumerate(results):
            meta = result["meta_info"]
            logprobs = _completion_logprobs(state, meta, 0)[0] if body.logprobs is not None else None
            choices.append({"index": index, "text": echo[index] + result["text"], "logprobs": logprobs,
                            "finish_reason": finish_reason(meta["finish_reason"]),
                            "matched_stop": matched_stop(meta["finish_reason"])})
        return JSONResponse(reply.body(choices, _usage([r["meta_info"] for r in results])))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await state.parse(request, ChatCompletionRequest)
        tools = ToolCalls.of(body, getattr(state.engine.tokenizer, "chat_template", None))
        ids = await _chat_prompt_ids(state, body.messages, tools)
        max_tokens = body.max_output_tokens
        state.check_length(ids, max_tokens, param="messages")
        params = body.sampling_params(max_tokens if max_tokens is not None else state.context_length - len(ids))
        if tools is not None:
            params.update(tools.grammar_params())
        logprob_args = (body.logprobs, body.top_logprobs or 0)
        reply = _Reply(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", state.model_name)
        if body.stream:
            chunks = await state.open_stream(ids, params, *logprob_args)
            return _sse_response(_chat_events(state, reply, chunks, body.logprobs, body.include_usage, tools))
        result = await state.unless_disconnected(request, state.generate(ids, params, *logprob_args))
        meta = result["meta_info"]
        message, called = tools.message(result["text"]) if tools is not None else (
            {"role": "assistant", "content": result["text"]}, False)
        choice = {"index": 0, "message": message, "logprobs": _chat_logprobs(state, meta) if body.logprobs else None,
                  "finish_reason": "tool_calls" if called else finish_reason(meta["finish_reason"]),
                  "matched_stop": matched_stop(meta["finish_reason"])}
        return JSONResponse(reply.body([choice], _usage([meta])))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await state.parse(request, _TokenizeRequest)
        if isinstance(body.prompt, str):
            tokens = await state.encode(body.prompt, body.add_special_tokens)
            return {"tokens": tokens, "count": len(tokens), "max_model_len": state.context_length}
        tokens = [await state.encode(p, body.add_special_tokens) for p in body.prompt]   # batched: our extension
        return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": state.context_length}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await state.parse(request, _DetokenizeRequest)
        if body.tokens and isinstance(body.tokens[0], list):
            return {"prompt": [await state.decode(t) for t in body.tokens]}
        return {"prompt": await state.decode(body.tokens)}


async def _chat_prompt_ids(state: ServerState, messages: list[ChatMessage], tools: ToolCalls | None) -> list[int]:
    """The conversation (and its tools) through the chat template, tokenized (both off the
    event loop when long)."""
    chars = sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or [])
                for m in messages)
    state.check_text_length(chars, param="messages")
    inputs = [m.as_template_input() for m in messages]
    if tools is not None:
        inputs = tools.template_messages(inputs)
    return await state.offload(_render_and_encode, state, inputs, tools.template_tools() if tools else None,
                               heavy=chars > INLINE_TEXT_CHARS)


def _render_and_encode(state: ServerState, messages: list[dict], tools: list[dict] | None) -> list[int]:
    try:
        prompt = state.engine.apply_chat_template(messages, tools=tools)
    except Exception as error:  # a template may raise on a conversation it does not allow
        raise APIError(f"could not apply the chat template: {error}", param="messages") from None
    return state.encode_now(prompt, add_special_tokens=False)   # the template holds any BOS itself


class _TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    prompt: str | list[str]
    add_special_tokens: bool = True


class _DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    tokens: list[TokenId] | list[list[TokenId]]


class _Reply:
    """The fields every response and chunk of one request repeats."""

    def __init__(self, reply_id: str, kind: str, model: str):
        self.id, self.kind, self.model, self.created = reply_id, kind, model, int(time.time())

    def body(self, choices: list[dict], usage: dict | None, chunk: bool = False, with_usage: bool = False) -> dict:
        kind = self.kind + ".chunk" if chunk and self.kind == "chat.completion" else self.kind
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or not chunk or with_usage:
            out["usage"] = usage
        return out


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "specserve",
            "root": state.model_path, "max_model_len": state.context_length}


def _usage(metas: list[dict]) -> dict:
    prompt = sum(m["prompt_tokens"] for m in metas)
    completion = sum(m["completion_tokens"] for m in metas)
    cached = sum(m.get("cached_tokens", 0) for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# --- logprobs ---
def _completion_logprobs(state: ServerState, meta: dict, text_offset: int) -> tuple[dict, int]:
    """OpenAI's completions logprobs object for the tokens in `meta`; returns the next offset."""
    tokens, offsets, token_logprobs = [], [], []
    for logprob, token_id, _ in meta.get("output_token_logprobs", []):
        text = state.token_text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        token_logprobs.append(logprob)
        text_offset += len(text)
    top = None
    if "output_top_logprobs" in meta:
        top = [{state.token_text(t): lp for lp, t, _ in row} for row in meta["output_top_logprobs"]]
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, text_offset


def _chat_logprobs(state: ServerState, meta: dict) -> dict:
    tops = meta.get("output_top_logprobs")
    content = []
    for i, (logprob, token_id, _) in enumerate(meta.get("output_token_logprobs", [])):
        entry = _chat_token(state, token_id, logprob)
        entry["top_logprobs"] = [_chat_token(state, t, lp) for lp, t, _ in tops[i]] if tops else []
        content.append(entry)
    return {"content": content, "refusal": None}


def _chat_token(state: ServerState, token_id: int, logprob: float) -> dict:
    text = state.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


# --- server-sent events ---
async def _chat_events(state: ServerState, reply: _Reply, chunks: AsyncIterator[dict], logprobs: bool,
                       include_usage: bool, tools: ToolCalls | None = None) -> AsyncIterator[bytes]:
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    yield sse(reply.body([first], None, chunk=True, with_usage=include_usage))
    split = tools.stream() if tools is not None else None   # content, and tool calls at the end
    try:
        meta = None
        async for chunk in chunks:
            meta = chunk["meta_info"]
            reason = meta["finish_reason"]
            delta = {"content": chunk["text"]} if chunk["text"] else {}
            if split is not None:
                delta = stream_delta(split, chunk["text"], reason is not None)
            if not delta and reason is None and not (logprobs and chunk["output_ids"]):
                continue
            choice = {"index": 0, "delta": delta, "logprobs": _chat_logprobs(state, meta) if logprobs else None,
                      "finish_reason": "tool_calls" if delta.get("tool_calls") else finish_reason(reason)}
            if reason is not None:
                choice["matched_stop"] = matched_stop(reason)
            yield sse(reply.body([choice], None, chunk=True, with_usage=include_usage))
        if include_usage and meta is not None:
            yield sse(reply.body([], _usage([meta]), chunk=True))
    except Exception as error:
        yield error_event(error, state.engine_stopped)
    yield SSE_DONE


async def _completion_events(state: ServerState, reply: _Reply, streams: list[AsyncIterator[dict]], echo: list[str],
                             logprobs: bool, include_usage: bool) -> AsyncIterator[bytes]:
    finals: dict[int, dict] = {}
    offsets = [len(e) for e in echo]
    try:
        for index, text in enumerate(echo):
            if text:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
                yield sse(reply.body([choice], None, chunk=True, with_usage=include_usage))
        async for index, chunk in _merged(streams):
            meta = chunk["meta_info"]
            reason = meta["finish_reason"]
            if reason is not None:
                finals[index] = meta
            # a step's tokens make a chunk even when their text is empty (a byte of a UTF-8 character
            # not yet whole), as SGLang's and vLLM's completions stream: a client sees each step
            if not chunk["text"] and reason is None and not chunk["output_ids"]:
                continue
            choice = {"index": index, "text": chunk["text"], "logprobs": None, "finish_reason": finish_reason(reason)}
            if logprobs:
                choice["logprobs"], offsets[index] = _completion_logprobs(state, meta, offsets[index])
            if reason is not None:
                choice["matched_stop"] = matched_stop(reason)
            yield sse(reply.body([choice], None, chunk=True, with_usage=include_usage))
        if include_usage and finals:
            yield sse(reply.body([], _usage(list(finals.values())), chunk=True))
    except Exception as error:
        yield error_event(error, state.engine_stopped)
    yield SSE_DONE


async def _merged(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """(index, chunk) from several streams as they arrive; one stream needs no tasks."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, None))
        except Exception as error:
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:    # the client left or one failed: cancelling aborts the others
            task.cancel()
