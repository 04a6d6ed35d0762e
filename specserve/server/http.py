"""The HTTP server: `create_app(engine)` builds the FastAPI app.

Handlers only await the engine (`async_generate`), so serving never blocks the engine's
step loop, which runs in its own thread. This file owns the app, the error handlers, the
native endpoints (SGLang's /generate and info routes) and `ServerState`, the per-request
plumbing every endpoint shares: tokenize, submit, time, and abort when the client leaves.
The OpenAI routes live in openai_api.py.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import uuid
from typing import Any, AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specserve.server import openai_api
from specserve.server.metrics import ServerMetrics, engine_load
from specserve.server.protocol import SSE_DONE, APIError, GenerateRequest, error_event, parse_body, sse

logger = logging.getLogger("specserve")


class ClientDisconnected(Exception):
    pass


class ServerState:
    """What every endpoint shares: the engine, the served name, tokenization and metrics."""

    def __init__(self, engine, served_model_name: str | None = None):
        self.engine = engine
        # a copy of our own: the engine thread detokenizes with its tokenizer while we encode here
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.context_length: int = engine.context_length
        self.model_path: str = getattr(engine, "model_path", None) or "default"
        args = getattr(engine, "args", None)
        given_path = getattr(args, "model_path", None)
        self.model_name = served_model_name or os.path.basename(os.path.normpath(given_path or self.model_path)) or "default"
        self.model_aliases = {self.model_name, self.model_path, "default"} | ({given_path} if given_path else set())
        self.metrics = ServerMetrics(engine, self.model_name)
        self._token_text: dict[int, str] = {}

    # --- prompts ---
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_aliases:
            raise APIError(f"The model '{name}' does not exist; this server serves '{self.model_name}'.",
                           status=404, param="model", code="model_not_found")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def check_length(self, ids: list[int], max_new_tokens: int | None, param: str = "prompt") -> None:
        """Errors a client can fix, raised before the request reaches the engine."""
        if not ids:
            raise APIError("the prompt must not be empty", param=param)
        if len(ids) >= self.context_length:
            raise APIError(f"This model's maximum context length is {self.context_length} tokens; "
                           f"the prompt has {len(ids)} tokens.", param=param, code="context_length_exceeded")
        if max_new_tokens is not None and len(ids) + max_new_tokens > self.context_length:
            raise APIError(f"This model's maximum context length is {self.context_length} tokens; you requested "
                           f"{len(ids) + max_new_tokens} ({len(ids)} in the prompt, {max_new_tokens} to generate).",
                           param="max_tokens", code="context_length_exceeded")

    # --- running requests ---
    async def open_stream(self, ids: list[int], params: dict, return_logprob: bool = False,
                          top_logprobs_num: int = 0, rid: str | None = None) -> AsyncIterator[dict]:
        """Validates the request now (APIError on bad input); the returned iterator submits it
        when first advanced and yields the engine's incremental chunks."""
        rid = rid or uuid.uuid4().hex
        try:
            chunks = await self.engine.async_generate(input_ids=ids, sampling_params=params, stream=True, rid=rid,
                                                      return_logprob=return_logprob, top_logprobs_num=top_logprobs_num)
        except ValueError as error:
            raise APIError(str(error)) from None
        return self._timed(chunks, rid, len(ids))

    async def _timed(self, chunks: AsyncIterator[dict], rid: str, prompt_tokens: int) -> AsyncIterator[dict]:
        timer = self.metrics.track(prompt_tokens)
        try:
            async for chunk in chunks:
                timer.on_chunk(len(chunk["output_ids"]))
                if chunk["meta_info"]["finish_reason"] is not None:
                    timer.finish(chunk["meta_info"])
                yield chunk
        except ValueError as error:   # the engine refused it at submission (e.g. a duplicate rid)
            timer.discard()
            raise APIError(str(error)) from None
        except Exception:
            timer.fail("error")
            raise
        finally:
            if not timer.done:        # the consumer went away (client disconnect): free the slots
                timer.fail("abort")
                self.engine.abort_request(rid)

    async def generate(self, ids: list[int], params: dict, return_logprob: bool = False,
                       top_logprobs_num: int = 0, rid: str | None = None) -> dict:
        """One request without streaming; its final output dict."""
        timer = self.metrics.track(len(ids))
        try:
            result = await self.engine.async_generate(input_ids=ids, sampling_params=params, rid=rid,
                                                      return_logprob=return_logprob, top_logprobs_num=top_logprobs_num)
        except ValueError as error:
            timer.discard()
            raise APIError(str(error)) from None
        except asyncio.CancelledError:  # the client left
            timer.fail("abort")
            raise
        except Exception:
            timer.fail("error")
            raise
        timer.finish(result["meta_info"])
        return result

    async def unless_disconnected(self, request: Request, work: Awaitable) -> Any:
        """Awaits `work` unless the client disconnects first; then cancels it (which aborts
        the engine request and frees its KV slots) and raises ClientDisconnected."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
            watcher.cancel()
        if task.cancelled():
            raise ClientDisconnected()
        return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(engine, served_model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """The app for `engine` (a started Engine); `served_model_name` and `api_key` default to
    the engine's ServerArgs."""
    args = getattr(engine, "args", None)
    api_key = api_key if api_key is not None else getattr(args, "api_key", None)
    if served_model_name is None:
        served_model_name = getattr(args, "served_model_name", None)
    state = ServerState(engine, served_model_name)
    app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    _add_error_handlers(app)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    _add_native_routes(app, state)
    openai_api.add_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError):
        return JSONResponse(APIError(str(error.errors()[:1])).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(str(error.detail), error.status_code, type=kind).body(), status_code=error.status_code)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, error: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, error: Exception):
        logger.exception("request to %s failed", request.url.path, exc_info=error)
        body = APIError(f"internal server error: {type(error).__name__}: {error}", 500, type="server_error").body()
        return JSONResponse(body, status_code=500)


def _add_native_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        ids = state.encode("ping")
        await asyncio.wait_for(state.generate(ids, {"max_new_tokens": 1, "temperature": 0.0}), timeout=60)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        args = getattr(engine, "args", None)
        return {"model_path": state.model_path, "tokenizer_path": getattr(args, "tokenizer_path", None) or state.model_path,
                "served_model_name": state.model_name, "is_generation": True, "context_length": state.context_length}

    @app.get("/get_server_info")
    async def get_server_info():
        m = state.metrics
        info = engine.get_server_info()
        if info.get("api_key"):
            info["api_key"] = "<hidden>"
        return {**info, **engine_load(engine), "served_model_name": state.model_name,
                "spec_verify_steps_total": m.spec_verify_steps, "spec_accepted_tokens_total": m.spec_accepted_tokens,
                "internal_states": [{"avg_spec_accept_length": m.avg_spec_accept_length}]}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/generate")
    async def generate(request: Request):
        body = parse_body(await request.body(), GenerateRequest)
        batch = body.batch_size
        if body.text is not None:
            texts = body.text if isinstance(body.text, list) else [body.text]
            id_lists = [state.encode(text) for text in texts]
        else:
            id_lists = body.input_ids if batch is not None else [body.input_ids]
        params = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * len(id_lists)
        for ids, p in zip(id_lists, params):
            max_new_tokens = (p or {}).get("max_new_tokens")  # its type is the engine's to check
            state.check_length(ids, max_new_tokens if type(max_new_tokens) is int else None,
                               param="text" if body.text is not None else "input_ids")
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(id_lists)
        if len(rids) != len(id_lists) or (body.rid is not None and len(set(rids)) != len(rids)):
            raise APIError("rid must be one distinct id per prompt", param="rid")
        logprob_args = (body.return_logprob, body.top_logprobs_num)
        if body.stream:
            chunks = await state.open_stream(id_lists[0], params[0], *logprob_args, rid=rids[0])
            return StreamingResponse(_native_sse(state, chunks, body.return_text_in_logprobs),
                                     media_type="text/event-stream")
        results = await state.unless_disconnected(request, asyncio.gather(
            *(state.generate(ids, p, *logprob_args, rid=r) for ids, p, r in zip(id_lists, params, rids))))
        if body.return_text_in_logprobs:
            for result in results:
                _add_logprob_text(state, result["meta_info"])
        return JSONResponse(results if batch is not None else results[0])


async def _native_sse(state: ServerState, chunks: AsyncIterator[dict], logprob_text: bool) -> AsyncIterator[bytes]:
    """SGLang's /generate stream: every event carries the whole text and ids so far."""
    text, ids = "", []
    logprobs: dict[str, list] = {}
    try:
        async for chunk in chunks:
            text += chunk["text"]
            ids.extend(chunk["output_ids"])
            meta = chunk["meta_info"]
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if key in meta:
                    so_far = logprobs.setdefault(key, [])
                    so_far.extend(meta[key])
                    meta[key] = so_far
            if logprob_text:
                _add_logprob_text(state, meta)
            yield sse({"text": text, "output_ids": ids, "meta_info": meta})
    except Exception as error:
        yield error_event(error)
    yield SSE_DONE


def _add_logprob_text(state: ServerState, meta: dict) -> None:
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs"] = [(lp, t, state.token_text(t)) for lp, t, _ in meta["output_token_logprobs"]]
    if "output_top_logprobs" in meta:
        meta["output_top_logprobs"] = [[(lp, t, state.token_text(t)) for lp, t, _ in row] for row in meta["output_top_logprobs"]]


class _APIKeyMiddleware:
    """`Authorization: Bearer <api_key>` on every route but /health (pure ASGI: no per-chunk cost)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                body = APIError("invalid or missing API key", 401, type="authentication_error").body()
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
