"""The baseline every benchmark compares against: `transformers.generate` on the same
prompts, greedy, in batches (left padding), optionally with prompt lookup decoding."""
from __future__ import annotations

import logging
import os
import statistics
import time

import torch
from tqdm import tqdm

logger = logging.getLogger("specserve")


def load_hf_model(model_path: str, dtype: str, device: str):
    import transformers
    from specserve.runner.model_runner import resolve_device, resolve_dtype
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    kwargs = {}
    if model_path.endswith(".gguf"):
        model_path, kwargs["gguf_file"] = os.path.split(model_path)
    logger.info("loading %s into transformers ...", kwargs.get("gguf_file") or model_path)
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, **kwargs)
    logger.info("loaded into transformers in %.1f s", time.perf_counter() - start)
    return model.to(torch_device).eval()


def hf_generate_summary(model_path: str, prompts: list[list[int]], batch_size: int, max_new_tokens: int,
                        ignore_eos: bool, dtype: str = "auto", device: str = "auto",
                        prompt_lookup_num_tokens: int | None = None, model=None, label: str | None = None) -> dict:
    """Output tokens/s and per-batch latency of transformers.generate (prompt lookup needs batch 1)."""
    model = model or load_hf_model(model_path, dtype, device)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    pad = next(iter(eos_ids), 0)
    options = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": pad}
    if ignore_eos:
        options["min_new_tokens"] = max_new_tokens
    if prompt_lookup_num_tokens:
        options["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    _generate(model, prompts[:1], {**options, "max_new_tokens": 4})  # warm-up
    latencies, tokens = [], 0
    name = label or ("transformers prompt-lookup" if prompt_lookup_num_tokens else "transformers generate")
    bar = tqdm(total=len(prompts), desc=name, unit="req", leave=False)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch_start = time.perf_counter()
        outputs = _generate(model, prompts[i:i + batch_size], options)
        latencies.append(time.perf_counter() - batch_start)
        tokens += sum(_generated_length(row, eos_ids, ignore_eos) for row in outputs)
        bar.set_postfix_str(f"{tokens} tokens", refresh=False)
        bar.update(len(outputs))
    duration = time.perf_counter() - start
    bar.close()
    return {"label": name, "requests": len(prompts), "duration_s": duration, "output_tokens": tokens,
            "output_tokens_per_s": tokens / duration, "mean_latency_s": statistics.mean(latencies),
            "p99_latency_s": max(latencies)}


@torch.inference_mode()
def _generate(model, prompts: list[list[int]], options: dict) -> list[list[int]]:
    """Left-padded batch; returns the generated ids of each row."""
    width = max(len(p) for p in prompts)
    pad = options["pad_token_id"]
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, **options)
    return out[:, width:].tolist()


def _generated_length(row: list[int], eos_ids: set[int], ignore_eos: bool) -> int:
    if ignore_eos:
        return len(row)
    for i, token in enumerate(row):
        if token in eos_ids:
            return i + 1
    return len(row)
