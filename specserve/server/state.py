"""ServerState: what every endpoint shares, and the per-request plumbing they all use:
read and parse the body, tokenize, check lengths, submit, time, and abort when the client
leaves.

The event loop serves every stream, so nothing costly runs on it: bodies of more than a
few kilobytes are parsed, and long texts tokenized or decoded, on a small thread pool
(tokenizers release the GIL while they work), each thread with its own tokenizer copy
(HF fast tokenizers must not be shared between threads).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import os
import re
import threading
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request

from specserve.server.disconnect import run_unless_disconnected
from specserve.server.drain import Drain
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import APIError
from specserve.server.request_body import Body, parse_body, read_body

Result = TypeVar("Result")
INLINE_BODY_BYTES = 64 * 1024     # smaller bodies parse on the loop: a thread hop would cost more
INLINE_TEXT_CHARS = 4096          # the same for texts to tokenize
PREP_THREADS = 4
# a GGUF file's name ends in its quantization: SmolLM2-135M-Instruct.Q4_1.gguf, qwen2-7b-instruct-q4_k_m.gguf
_GGUF_SUFFIX = re.compile(r"([.-](I?Q\d\w*|[BF]?F16|F32|BF16|FP16|FP32))?\.gguf$", re.IGNORECASE)


class ServerState:
    """The engine, the served name, tokenization, metrics and the shutdown's drain."""

    def __init__(self, engine, served_model_name: str | None = None):
        self.engine = engine
        self.tokenizers = _ThreadTokenizers(engine.tokenizer)
        self.context_length: int = engine.context_length
        self.vocab_size: int = engine.vocab_size
        # a text this long cannot fit the context whatever it says: refused without tokenizing it
        self.max_prompt_chars = self.tokenizers.max_chars_for(self.context_length)
        self.model_path: str = getattr(engine, "model_path", None) or "default"
        given_path = getattr(getattr(engine, "args", None), "model_path", None)
        self.model_name = served_model_name or default_model_name(given_path or self.model_path)
        self.model_aliases = {self.model_name, self.model_path, "default"} | ({given_path} if given_path else set())
        self.metrics = ServerMetrics(self.load, self.model_name)
        self.drain = Drain()
        self._prep = concurrent.futures.ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="specserve-prep")
        self._token_text: dict[int, str] = {}

    def close(self) -> None:
        self._prep.shutdown(wait=False, cancel_futures=True)

    @property
    def tokenizer(self):
        """This thread's tokenizer."""
        return self.tokenizers.get()

    # --- request preparation, off the event loop when it is costly ---
    async def offload(self, work: Callable[..., Result], *args: Any, heavy: bool = True) -> Result:
        if not heavy:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._prep, work, *args)

    async def parse(self, request: Request, model: type[Body]) -> Body:
        raw = await read_body(request)
        return await self.offload(parse_body, raw, model, heavy=len(raw) > INLINE_BODY_BYTES)

    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_text_length(len(text), param)
        return await self.offload(self.encode_now, text, add_special_tokens, heavy=len(text) > INLINE_TEXT_CHARS)

    def encode_now(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    async def decode(self, ids: list[int]) -> str:
        self.check_token_ids(ids)
        return await self.offload(self.tokenizer_decode, ids, heavy=len(ids) > INLINE_TEXT_CHARS)

    def tokenizer_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    # --- the engine's state ---
    @property
    def engine_stopped(self) -> bool:
        """Whether the engine can take no further request (its process died, say)."""
        return getattr(self.engine, "fatal_error", None) is not None

    def load(self) -> dict:
        """The engine's load; a stopped engine runs nothing, whatever it last reported."""
        load = self.engine.load()
        if self.engine_stopped:
            load.update(num_running=0, num_waiting=0)
        return load

    def check_engine(self) -> None:
        """A 503 for a new request once the engine has stopped (before a stream's headers go out)."""
        fatal = getattr(self.engine, "fatal_error", None)
        if fatal is not None:
            raise APIError(f"the engine stopped: {fatal}", 503, type="server_error")

    # --- checks a client can act on, made before the request reaches the engine ---
    def check_model_exists(self, name: str) -> None:
        """For /v1/models/{name}: the served name and the model's paths exist, nothing else."""
        if name not in self.model_aliases:
            raise APIError(f"The model '{name}' does not exist; this server serves '{self.model_name}'.",
                           status=404, param="model", code="model_not_found")

    def check_text_length(self, chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise APIError(f"This model's maximum context length is {self.context_length} tokens; the {param} "
                           f"({chars} characters) is far longer.", param=param, code="context_length_exceeded")

    def check_token_ids(self, ids: list[int], param: str = "tokens") -> None:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(f"{param} must hold token ids in [0, {self.vocab_size})", param=param)

    def check_length(self, ids: list[int], max_new_tokens: int | None, param: str = "prompt") -> None:
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
        self.check_engine()
        try:
            chunks = await self.engine.async_generate(input_ids=ids, sampling_params=params, stream=True, rid=rid,
                                                      return_logprob=return_logprob, top_logprobs_num=top_logprobs_num)
        except ValueError as error:
            raise APIError(str(error)) from None
        return self._timed(chunks, rid, len(ids))

    async def _timed(self, chunks: AsyncIterator[dict], rid: str, prompt_tokens: int) -> AsyncIterator[dict]:
        timer = self.metrics.track(prompt_tokens)
        chunks = aiter(chunks)
        try:
            while True:
                async with self.drain.cuttable():   # only the wait: never a write to the client
                    chunk = await anext(chunks, None)
                if chunk is None:
                    return
                timer.on_chunk(len(chunk["output_ids"]))
                if chunk["meta_info"]["finish_reason"] is not None:
                    timer.finish(chunk["meta_info"])
                yield chunk
        except ValueError as error:   # the engine refused it at submission (e.g. a duplicate rid)
            timer.discard()
            raise APIError(str(error)) from None
        except APIError:              # cut by the shutdown (drain.py)
            timer.fail("abort")
            raise
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
        self.check_engine()
        timer = self.metrics.track(len(ids))
        try:
            async with self.drain.cuttable():
                result = await self.engine.async_generate(input_ids=ids, sampling_params=params, rid=rid,
                                                          return_logprob=return_logprob,
                                                          top_logprobs_num=top_logprobs_num)
        except ValueError as error:
            timer.discard()
            raise APIError(str(error)) from None
        except (asyncio.CancelledError, APIError):  # the client left, or the shutdown cut it (drain.py)
            timer.fail("abort")
            raise
        except Exception:
            timer.fail("error")
            raise
        timer.finish(result["meta_info"])
        return result

    async def unless_disconnected(self, request: Request, work: Awaitable[Result]) -> Result:
        """Awaits `work` unless the client disconnects first; then cancels it (which aborts
        the engine requests and frees their KV slots) and raises ClientDisconnected."""
        return await run_unless_disconnected(request, work)


def default_model_name(model_path: str) -> str:
    """The name a model is served under without --served-model-name: its path's last part,
    without a GGUF file's quantization and extension."""
    name = os.path.basename(os.path.normpath(model_path))
    return _GGUF_SUFFIX.sub("", name) or name or "default"


class _ThreadTokenizers:
    """One copy of the tokenizer per thread that uses one, made on first use."""

    def __init__(self, tokenizer):
        self._pristine = copy.deepcopy(tokenizer)   # only ever copied, never used
        self._lock = threading.Lock()
        self._local = threading.local()

    def get(self):
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            with self._lock:
                tokenizer = self._local.tokenizer = copy.deepcopy(self._pristine)
        return tokenizer

    def max_chars_for(self, tokens: int) -> int | None:
        """An upper bound on the characters of a text that tokenizes to < `tokens` tokens:
        every character of the text takes at least one character of some token's string
        (byte-level BPE spells each byte as one character), so a token covers at most the
        longest token string. Twice that, for normalizers that drop characters."""
        get_vocab = getattr(self._pristine, "get_vocab", None)
        if get_vocab is None:
            return None
        longest = max((len(piece) for piece in get_vocab()), default=0)
        return 2 * tokens * longest if longest else None

