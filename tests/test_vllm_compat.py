"""vLLM's `vllm serve` flags (vllm_compat): a realistic command line becomes the ServerArgs it
means, tuning flags warn once, missing features and mistakes are one clear error; and one
server started by `python -m specserve.vllm_serve` answers under its served name."""
from __future__ import annotations

import json
import logging

import httpx
import pytest

from specserve import sglang_compat, vllm_compat
from specserve.args import ServerArgs
from specserve.cli import run_cli
from specserve.vllm_serve import main as vllm_serve_main, server_args

from server_process import free_port, start_server_module, stop_server
from lab.server_overhead import wait_healthy


def spec(**config) -> list[str]:
    return ["--speculative-config", json.dumps(config)]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(sglang_compat, "_warned", set())


def test_a_realistic_vllm_command_line_becomes_the_server_args_it_means():
    args = server_args([
        "Qwen/Qwen2.5-Coder-1.5B-Instruct", "--host", "0.0.0.0", "--served-model-name", "coder",
        "--dtype", "bfloat16", "--max-model-len", "8192", "--gpu-memory-utilization", "0.9", "--max-num-seqs", "256",
        "--max-num-batched-tokens", "4096", "--no-enable-prefix-caching", "--enforce-eager", "-tp", "2",
        "--seed", "7", "--api-key", "k", "--uvicorn-log-level", "critical",
        *spec(method="ngram", num_speculative_tokens=5, prompt_lookup_max=4, prompt_lookup_min=2)])
    assert isinstance(args, ServerArgs)
    expected = dict(model_path="Qwen/Qwen2.5-Coder-1.5B-Instruct", host="0.0.0.0", port=8000, served_model_name="coder",
                    dtype="bfloat16", context_length=8192, mem_fraction_static=0.9, max_running_requests=256,
                    chunked_prefill_size=4096, disable_radix_cache=True, disable_cuda_graph=True, tp_size=2,
                    random_seed=7, api_key="k", log_level="error", speculative_algorithm="NGRAM",
                    # 5 drafts and the root; the adaptive draft length stays on, 5 the most it drafts
                    speculative_num_draft_tokens=6, speculative_disable_adaptive=False,
                    speculative_ngram_max_match_window_size=4, speculative_ngram_min_match_window_size=2)
    assert {name: getattr(args, name) for name in expected} == expected


def test_model_drafters_from_the_speculative_config():
    eagle3 = server_args(["m", *spec(method="eagle3", model="/heads/eagle3", num_speculative_tokens=3)])
    assert (eagle3.speculative_algorithm, eagle3.speculative_draft_model_path) == ("EAGLE3", "/heads/eagle3")
    assert eagle3.speculative_num_steps == 3 and eagle3.speculative_verify_size == 4   # a chain of 3 and its root
    assert server_args([*spec(model="/d/small", num_speculative_tokens=4)]).speculative_algorithm == "STANDALONE"
    assert server_args([*spec(model="yuhuili/EAGLE-LLaMA3-Instruct-8B")]).speculative_algorithm == "EAGLE"
    for method in ("mtp", "qwen3_next_mtp"):
        mtp = server_args([*spec(method=method, model="/nextn", num_speculative_tokens=1)])
        assert (mtp.speculative_algorithm, mtp.speculative_steps) == ("MTP", 1)


def test_defaults_are_specserves_but_for_vllms_port():
    args = server_args([])
    assert args.port == vllm_compat.VLLM_PORT == 8000
    assert args.replace(port=30000) == ServerArgs()


def test_flags_that_meet_and_vllms_token_counts():
    # vllm serve's positional MODEL wins over --model, as in vLLM
    assert server_args(["--model", "a", "b"]).model_path == "b"
    assert server_args(["--model", "a"]).model_path == "a"
    # with chunking off, --max-num-batched-tokens only has to hold a prompt: unchunked prefill
    off = server_args(["--max-num-batched-tokens", "32K", "--no-enable-chunked-prefill"])
    assert off.chunked_prefill_size == -1
    assert server_args(["--max-model-len", "32k"]).context_length == 32000   # vLLM's k and K
    assert server_args(["--max-model-len", "32K"]).context_length == 32768


def test_tuning_flags_are_accepted_with_one_warning_each(caplog):
    line = ["--block-size", "32", "--swap-space", "8", "-O", "3", "--trust-remote-code", "--scheduling-policy", "fcfs",
            "--kv-cache-dtype", "auto", "--disable-log-requests", "--enable-auto-tool-choice", "--tool-call-parser",
            "hermes", "--served-model-name", "a", "b", *spec(method="ngram", disable_by_batch_size=4)]
    with caplog.at_level(logging.WARNING, logger="specserve"):
        for _ in range(2):
            server_args(line)
    messages = [r.getMessage() for r in caplog.records]
    ignored = sorted(m.split("=")[0] for m in messages if m.startswith("ignoring vLLM's"))
    # at vLLM's default (fcfs, auto) or asking for what specserve does anyway (logs no requests,
    # parses tool calls): silent
    assert ignored == ["ignoring vLLM's --block-size", "ignoring vLLM's --compilation-config",
                       "ignoring vLLM's --speculative-config disable_by_batch_size", "ignoring vLLM's --swap-space",
                       "ignoring vLLM's --tool-call-parser", "ignoring vLLM's --trust-remote-code"]
    assert sum("/v1/models lists one name, 'a'" in m for m in messages) == 2
    assert len(messages) == len(ignored) + 2


def vllm_serve_error(capfd, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(vllm_serve_main, argv)
    out, err = capfd.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    return exit_info.value.code, err


# argv, exit status (2: argparse's), words the one line holds
MISTAKES = {
    "misspelled flag": (["--max-model-length", "4096"], 2, ["did you mean --max-model-len?"]),
    "bad JSON": (["--speculative-config", "{method: ngram}"], 2, ["--speculative-config", "not valid JSON"]),
    "unknown JSON key": (spec(method="ngram", prompt_lookup_maximum=4), 1,
                         ["unknown key 'prompt_lookup_maximum'", "did you mean prompt_lookup_max?"]),
    "method specserve lacks": (spec(method="medusa", model="m"), 1, ["'medusa'", "eagle3"]),
    "model drafter without its model": (spec(method="eagle3"), 1, ["'eagle3' needs a 'model'"]),
    "feature specserve lacks": (["--quantization", "awq"], 1, ["--quantization='awq'", "vLLM's default (None)"]),
    "pipeline parallelism": (["-pp", "2"], 1, ["--pipeline-parallel-size=2"]),
    "LoRA": (["--enable-lora"], 1, ["--enable-lora=True"]),
    "a value ServerArgs refuses": (["--gpu-memory-utilization", "1.5"], 1,
                                   ["mem_fraction_static", "set by vLLM's --gpu-memory-utilization"]),
    "MTP drafts one token": (spec(method="mtp", model="m", num_speculative_tokens=3), 1, ["--speculative-config"]),
}


@pytest.mark.parametrize("case", MISTAKES)
def test_a_mistake_is_one_line_before_anything_loads(capfd, case):
    argv, status, words = MISTAKES[case]
    code, line = vllm_serve_error(capfd, argv)
    assert code == status and all(word in line for word in words), line


def test_refused_features_are_accepted_at_vllms_default(caplog):
    with caplog.at_level(logging.WARNING, logger="specserve"):
        server_args(["--no-enable-lora", "-pp", "1", "--kv-cache-dtype", "auto", "--max-lora-rank", "16",
                                 *spec(method="ngram", rejection_sample_method="standard", draft_tensor_parallel_size=1)])
    assert not caplog.records


def test_vllm_serve_answers_under_its_served_name():
    """The whole path: vLLM's flags, specserve's server (the default SmolLM2 on the CPU)."""
    port = free_port()
    proc = start_server_module("specserve.vllm_serve", "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "float32", "--uvicorn-log-level", "warning", "--max-model-len", "2048",
                               "--served-model-name", "vllm-name",
                               *spec(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4))
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base_url)
        assert [card["id"] for card in httpx.get(base_url + "/v1/models").json()["data"]] == ["vllm-name"]
    finally:
        stop_server(proc)
