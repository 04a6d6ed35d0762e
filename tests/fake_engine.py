"""A fake engine for in-process server tests (FastAPI's TestClient or httpx's ASGI transport):
failures a real engine does not produce on demand. It echoes the prompt, character by
character; a prompt holding "boom" fails inside the engine at its third character."""
from __future__ import annotations

import threading
from types import SimpleNamespace

SLOW_TEXT_RELEASE = threading.Event()   # a text starting with "slow" tokenizes once this is set


class FakeTokenizer:
    chat_template = "fake"

    def __call__(self, text, add_special_tokens=True):
        if text.startswith("slow"):
            assert SLOW_TEXT_RELEASE.wait(timeout=30)
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    """Echoes the prompt; a prompt containing "boom" fails inside the engine."""

    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.context_length = 256
        self.model_path = "/models/fake"
        self.vocab_size = 0x110000
        self.aborted = []

    def load(self):
        return {"num_running": 0, "num_waiting": 0, "kv_free_slots": 100, "kv_total_slots": 100, "kv_usage": 0.0,
                "kv_cached_slots": 0}

    def apply_chat_template(self, messages, **template_kwargs):
        return "".join(m["content"] for m in messages)

    def get_server_info(self):
        return {"model_path": self.model_path}

    def abort_request(self, rid):
        self.aborted.append(rid)

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             top_logprobs_num=0, stream=False, rid=None):
        from specserve.request.sampling_params import SamplingParams
        params = SamplingParams.from_dict(sampling_params)
        text = self.tokenizer.decode(input_ids)[: params.max_new_tokens]

        async def chunks():
            for i, char in enumerate(text):
                if "boom" in self.tokenizer.decode(input_ids) and i == 2:
                    raise RuntimeError(f"request {rid} failed: TypeError: boom")
                last = i == len(text) - 1
                yield {"text": char, "output_ids": [ord(char)], "meta_info": {
                    "id": rid, "prompt_tokens": len(input_ids), "completion_tokens": i + 1,
                    "finish_reason": {"type": "length"} if last else None}}

        if stream:
            return chunks()
        out = {"text": "", "output_ids": []}
        async for chunk in chunks():
            out = {"text": out["text"] + chunk["text"], "output_ids": out["output_ids"] + chunk["output_ids"],
                   "meta_info": chunk["meta_info"]}
        return out
