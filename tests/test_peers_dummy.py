"""The peer benchmark with `--load-format dummy`: every engine's server gets `--load-format
dummy` for a directory holding only config.json and a tokenizer (written for a shape of
random_model.SHAPES), so 7-14B shapes compare without checkpoints; specserve runs it on a CPU."""
from __future__ import annotations

import json
import os

import pytest

from specserve.bench import peers
from specserve.bench.peers_engines import ENGINES
from specserve.bench.random_model import SHAPES, write_model_config

DIRECTORIES = {"eagle_head": "/heads/eagle3", "eagle2_head": "/heads/eagle2", "draft_model": "/hf/draft"}
TINY = dict(SHAPES["qwen2.5-7b"], hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096)


def test_every_engine_is_told_to_make_random_weights():
    for name, config in ENGINES.items():
        drafters = {key: value for key, value in DIRECTORIES.items()
                    if getattr(config, f"needs_{key}")}
        command = config.command("/hf/qwen2.5-7b", "qwen2.5-7b", 8000, load_format="dummy", **drafters)
        assert command.count("--load-format") == 1, name
        assert command[command.index("--load-format") + 1] == "dummy", name
        assert "--load-format" not in config.command("/hf/qwen2.5-7b", "qwen2.5-7b", 8000, **drafters), name
    vllm = ENGINES["vllm-plain"].command("/hf/m", "m", 8000, load_format="dummy")
    assert vllm[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/hf/m"]
    sglang = ENGINES["sglang-plain"].command("/hf/m", "m", 8000, load_format="dummy")
    assert sglang[1:5] == ["-m", "sglang.launch_server", "--model-path", "/hf/m"]


def test_a_shape_name_gets_a_config_only_directory(tmp_path):
    ns = peers.parse_args(["run", "--load-format", "dummy", "--models", "qwen2.5-14b", "llama-3.1-8b",
                           "--hf-root", str(tmp_path), "--models-dir", str(tmp_path / "none")])
    assert ns.load_format == "dummy"
    for model in ns.models:
        path = peers.model_directory(model, ns, ns.load_format)
        assert path == str(tmp_path / model)
        assert not [f for f in os.listdir(path) if f.endswith((".safetensors", ".bin"))]
        config = json.load(open(os.path.join(path, "config.json")))
        assert config["hidden_size"] == SHAPES[model]["hidden_size"] and config["torch_dtype"] == "bfloat16"
    with pytest.raises(FileNotFoundError, match="not a shape of random_model.SHAPES"):
        peers.model_directory("no-such-shape", ns, "dummy")
    # the same directory without --load-format dummy: said before any engine starts
    with pytest.raises(FileNotFoundError, match="has no weights: pass --load-format dummy"):
        peers.model_directory("qwen2.5-14b", ns)
    with pytest.raises(SystemExit):
        peers.parse_args(["run", "--load-format", "safetensors"])


def test_specserve_serves_a_config_only_directory_and_peers_get_the_flag(tmp_path):
    hf_root = tmp_path / "hf"
    write_model_config(str(hf_root / "tiny"), TINY)
    out = tmp_path / "out"
    table = peers.run(peers.parse_args([
        "run", "--quick", "--load-format", "dummy", "--models", "tiny", "--hf-root", str(hf_root),
        "--models-dir", str(tmp_path), "--engines", "specserve-plain", "sglang-plain", "--concurrency", "2",
        "--max-new-tokens", "4", "--wheels", str(tmp_path / "no-wheels"), "--envs-root", str(tmp_path / "envs"),
        "--specserve-args", "--device cpu --dtype float32", "--out", str(out)]))
    rows = [json.loads(line) for line in open(out / "peers.jsonl")]
    started = [r for r in rows if r["kind"] == "engine" and r["engine"] == "specserve-plain"]
    assert len(started) == 1 and "error" not in started[0], started
    assert f"--model-path {hf_root / 'tiny'}" in started[0]["command"]
    assert "--load-format dummy" in started[0]["command"]
    cells = [r for r in rows if r["kind"] == "cell" and r["engine"] == "specserve-plain"]
    assert cells and all(c["tok_s"] > 0 and c["output_tokens"] == c["prompts"] * 4 for c in cells)
    sglang = [r for r in rows if r.get("engine") == "sglang-plain"]
    assert len(sglang) == 1 and "no wheels for sglang" in sglang[0]["error"]
    assert os.path.exists(table)
