"""A GGUF checkpoint -> a Hugging Face directory (config.json, model.safetensors, tokenizer
files with the chat template), so that every engine of the peer benchmark loads the same
weights: vLLM and SGLang serve HF directories, and so does specserve.

transformers saves a GGUF-loaded model only when it was loaded dequantized
(`GgufConfig(dequantize=True)`); the weights are then cast to `dtype` (bf16 for the peer
comparison). Loading runs on the CPU, so the GPU is left empty for the servers.

`python -m specserve.bench.gguf_to_hf MODEL.gguf OUT_DIR [--dtype bfloat16]`
"""
from __future__ import annotations

import argparse
import json
import os
import time

from specserve.bench.file_lock import exclusive

DONE_MARKER = "converted_from.json"   # written last: a directory without it is incomplete


def convert(gguf_path: str, out_dir: str, dtype: str = "bfloat16") -> str:
    """Writes the HF directory (skipped when a finished conversion of the same file and
    dtype is there; a process converting the same directory meanwhile is waited for);
    returns out_dir."""
    with exclusive(out_dir):
        return _convert(gguf_path, out_dir, dtype)


def _convert(gguf_path: str, out_dir: str, dtype: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    source = {"gguf": os.path.abspath(gguf_path), "size": os.path.getsize(gguf_path), "dtype": dtype}
    if _already_converted(out_dir, source):
        return out_dir
    directory, name = os.path.split(os.path.abspath(gguf_path))
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=getattr(torch, dtype),
                                                 quantization_config=GgufConfig(gguf_file=name, dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model.config.quantization_config = None    # the saved weights are plain: no loader should dequantize
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _drop_quantization_config(out_dir)
    with open(os.path.join(out_dir, DONE_MARKER), "w") as f:
        json.dump({**source, "seconds": round(time.perf_counter() - start, 1)}, f)
    return out_dir


def _already_converted(out_dir: str, source: dict) -> bool:
    try:
        with open(os.path.join(out_dir, DONE_MARKER)) as f:
            done = json.load(f)
    except (OSError, ValueError):
        return False
    return all(done.get(key) == value for key, value in source.items())


def _drop_quantization_config(out_dir: str) -> None:
    """config.json must not announce a GGUF quantization: vLLM and SGLang would look for it."""
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    if "quantization_config" in config:
        del config["quantization_config"]
        with open(path, "w") as f:
            json.dump(config, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ns = parser.parse_args(argv)
    print(convert(ns.gguf, ns.out_dir, ns.dtype))


if __name__ == "__main__":
    main()
