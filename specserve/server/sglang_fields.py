"""The fields of SGLang's /generate body (`GenerateReqInput`, sglang 0.5.x) that specserve
does not implement, so that SGLang's own clients work against our /generate.

SGLang's `bench_serving --backend sglang` sends `lora_path`, `return_routed_experts` and
`logprob_start_len` with every request, at their defaults; routers and RL frameworks send
routing and session hints. A field at its default asks for nothing and passes silently. A
field set to anything else asks for something we lack (a LoRA adapter, images, hidden
states, disaggregated prefill, ...): it is ignored, and a warning names it, once per field
per process (a benchmark sends it with every request; one line says it). Fields outside
this list stay errors (the model forbids extra fields).
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, model_validator

logger = logging.getLogger("specserve")

StrOrList = str | list[str | None] | None
IntOrList = int | list[int | None] | None


class SGLangGenerateExtras(BaseModel):
    """SGLang-only /generate fields, with SGLang's defaults; every one is ignored."""
    # media we do not take (input_embeds: GenerateRequest)
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: bool = False
    video_config: dict[str, Any] | None = None
    modalities: list[str] | None = None
    positional_embed_overrides: Any = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    image_max_dynamic_patch: int | None = None
    video_max_dynamic_patch: int | None = None
    images_config: dict[str, Any] | None = None
    multi_item_delimiter_indices: list[int] | list[list[int]] | None = None
    # outputs we do not compute
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_sampling_mask: bool | list[bool] | None = None
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    return_hidden_states: Any = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    return_prompt_token_ids: bool = False
    # adapters, custom sampling, sessions, reasoning
    lora_path: StrOrList = None
    lora_id: StrOrList = None
    custom_logit_processor: StrOrList = None
    session_id: str | None = None
    session_params: dict[str, Any] | None = None
    require_reasoning: bool = False
    max_thinking_tokens: int | None = None
    background: bool = False
    # scheduling, routing, disaggregation and tracing hints
    priority: int | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    extra_key: StrOrList = None
    cache_salt: StrOrList = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    kv_router_hint: dict[str, Any] | None = None
    bootstrap_host: StrOrList = None
    bootstrap_port: IntOrList = None
    bootstrap_room: IntOrList = None
    bootstrap_pair_key: StrOrList = None
    decode_tp_size: IntOrList = None
    http_worker_ipc: str | None = None
    need_wait_for_mm_inputs: bool | None = None
    num_items_assigned: dict[str, Any] | None = None
    encoder_urls: list[str] | None = None
    mm_data_mooncake: Any = None
    # logging and metrics
    log_metrics: bool = True
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None

    @model_validator(mode="after")
    def _warn_about_ignored(self):
        for name in ignored_fields(self):
            warn_once(name, getattr(self, name))
        return self


_warned: set[str] = set()


def warn_once(field: str, value: Any) -> None:
    """Logs, the first time per process, that `field` asked for something we ignore."""
    if field in _warned:
        return
    _warned.add(field)
    text = repr(value)
    logger.warning("/generate: %s=%s asks for something specserve does not implement; it is ignored "
                   "(said once per field)", field, text if len(text) <= 80 else text[:77] + "...")


def ignored_fields(body: BaseModel) -> list[str]:
    """The SGLang-only fields `body` sets to something other than their default."""
    defaults = SGLangGenerateExtras.model_fields
    return [name for name in body.model_fields_set
            if name in defaults and getattr(body, name) != defaults[name].default]
