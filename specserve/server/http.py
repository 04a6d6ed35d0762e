"""The HTTP server: `create_app(engine)` builds the FastAPI app.

The engine is an Engine (step loop in a thread of this process: tests, scripts) or an
EngineProcess (the engine in a child process: launch_server); both have the same surface
(engine/front.py). Handlers only await the engine (`async_generate`), so serving never
blocks its step loop, and costly request preparation runs off the event loop (state.py). This file owns the app, the error handlers and the native endpoints
(SGLang's /generate and info routes); the OpenAI routes live in openai_api.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from specserve.errors import EngineFatalError
from specserve.server import openai_api
from specserve.server.disconnect import ClientDisconnected, gather_all
from specserve.server.metrics import spec_accept_length, spec_accept_rate
from specserve.server.protocol import SSE_DONE, APIError, GenerateRequest, client_error, error_event, sse
from specserve.server.state import ServerState


def create_app(engine, served_model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """The app for `engine` (a started Engine); `served_model_name` and `api_key` default to
    the engine's ServerArgs."""
    args = getattr(engine, "args", None)
    api_key = api_key if api_key is not None else getattr(args, "api_key", None)
    if served_model_name is None:
        served_model_name = getattr(args, "served_model_name", None)
    state = ServerState(engine, served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.close()

    app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = state
    _add_error_handlers(app)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    app.add_middleware(_CatchAll, state=state)
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
    @app.exception_handler(ClientDisconnect)       # it left while sending its body
    async def _gone(request: Request, error: Exception):
        return Response(status_code=499)

    @app.exception_handler(EngineFatalError)
    async def _engine_stopped(request: Request, error: EngineFatalError):
        return JSONResponse(APIError(str(error), 503, type="server_error").body(), status_code=503)


def _add_native_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.get("/health")
    async def health():
        state.check_engine()   # the engine stopped: a 503, so that load balancers take this server out
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        ids = await state.encode("ping")
        await asyncio.wait_for(state.generate(ids, {"max_new_tokens": 1, "temperature": 0.0}), timeout=60)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        args = getattr(engine, "args", None)
        return {"model_path": state.model_path, "tokenizer_path": getattr(args, "tokenizer_path", None) or state.model_path,
                "served_model_name": state.model_name, "is_generation": True, "context_length": state.context_length}

    @app.get("/get_server_info")
    async def get_server_info():
        # JSON has no infinity: an unbounded setting (graceful_shutdown_timeout=inf) reads as null
        info = {key: None if isinstance(value, float) and not math.isfinite(value) else value
                for key, value in engine.get_server_info().items()}
        if info.get("api_key"):
            info["api_key"] = "<hidden>"
        load = state.load()
        return {**info, **load, "served_model_name": state.model_name,
                "spec_verify_steps_total": load.get("spec_verify_steps", 0),
                "spec_accepted_tokens_total": load.get("spec_accepted_tokens", 0),
                "internal_states": [{"avg_spec_accept_length": spec_accept_length(load),
                                     "spec_accept_rate": spec_accept_rate(load)}]}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """SGLang's route: drops the cached prefixes no running request holds."""
        freed = await asyncio.to_thread(engine.flush_cache)
        return Response(f"Cache flushed: {freed} KV slots freed.\n", status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/generate")
    async def generate(request: Request):
        body = await state.parse(request, GenerateRequest)
        batch = body.batch_size
        if body.text is not None:
            texts = body.text if isinstance(body.text, list) else [body.text]
            id_lists = [await state.encode(text, param="text") for text in texts]
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
        results = await state.unless_disconnected(request, gather_all(
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
        yield error_event(error, state.engine_stopped)
    yield SSE_DONE


def _add_logprob_text(state: ServerState, meta: dict) -> None:
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs"] = [(lp, t, state.token_text(t)) for lp, t, _ in meta["output_token_logprobs"]]
    if "output_top_logprobs" in meta:
        meta["output_top_logprobs"] = [[(lp, t, state.token_text(t)) for lp, t, _ in row] for row in meta["output_top_logprobs"]]


class _CatchAll:
    """The last resort (pure ASGI, inside Starlette's ServerErrorMiddleware, which would log the
    error a second time and re-raise it to uvicorn, which closes the connection): an exception
    no handler took becomes client_error's JSON (a generic 500, or a 503 once the engine has
    stopped) and one logged traceback. An exception after the response started (a stream's
    body) is re-raised: the response cannot be completed, so the connection must close."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch_start(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch_start)
        except Exception as error:
            if started:
                raise
            answer = client_error(error, self.state.engine_stopped)
            await JSONResponse(answer.body(), status_code=answer.status)(scope, receive, send)


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
