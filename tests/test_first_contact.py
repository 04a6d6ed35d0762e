"""What a new user meets first: a mistake is one line on stderr and a non-zero exit, caught
before the weights load; the Python API raises the same message as one type per kind;
SGLang's keyword names work; --help shows defaults; stdout carries only the text."""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

import pytest

from specserve import errors, sglang_compat
from specserve.args import ServerArgs
from specserve.cli import ArgumentParser, run_cli, setup_logging
from specserve.generate import main as generate_main
from specserve.launch_server import main as launch_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_error(capfd, main, argv: list[str]) -> tuple[int, list[str], str]:
    """Runs an entry point as `python -m` would; returns (exit status, stderr lines, stdout)."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, argv)
    out, err = capfd.readouterr()
    return exit_info.value.code, err.splitlines(), out


# ---- one line, non-zero exit, before the model loads ----
@pytest.fixture
def bad_paths(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "corrupt.gguf").write_bytes(b"not a gguf at all")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    return tmp_path


# argv (<tmp> is a scratch directory), words the line must hold
USER_ERRORS = {
    "missing .gguf": (["--model-path", "<tmp>/missing.gguf"], ["missing.gguf", "does not exist"]),
    "empty directory": (["--model-path", "<tmp>/empty"], ["empty", "config.json"]),
    "corrupt GGUF": (["--model-path", "<tmp>/corrupt.gguf"], ["corrupt.gguf", "GGUF"]),
    "not a GGUF file": (["--model-path", "<tmp>/weights.bin"], ["weights.bin", ".gguf"]),
    "hub id offline": (["--model-path", "no-such-org/no-such-model"], ["no-such-org/no-such-model", "hub"]),
    "NAIVE_EAGLE without a head": (["--speculative-algorithm", "NAIVE_EAGLE"], ["NAIVE_EAGLE", "speculative_draft_model_path"]),
    "tensor parallelism that does not split the heads": (["--tp-size", "2", "--log-level", "warning"],
                                                         ["tp_size=2", "9 attention heads"]),
    "a device that is not there": (["--device", "cuda:99"], ["cuda:99"]),
    "bad device name": (["--device", "gpu"], ["device", "'gpu'"]),
    "bad sampling value": (["--temperature", "-1"], ["temperature"]),
    "zero trie capacity": (["--speculative-algorithm", "NGRAM", "--speculative-ngram-capacity", "0"],
                           ["speculative_ngram_capacity"]),
    "SGLang feature we lack": (["--enable-lora"], ["enable_lora", "SGLang"]),
    "compare without speculation": (["--compare-plain"], ["--speculative-algorithm"]),
}


@pytest.mark.parametrize("case", USER_ERRORS)
def test_a_user_error_is_one_line_on_stderr_and_exit_1(capfd, monkeypatch, bad_paths, case):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv, words = USER_ERRORS[case]
    status, lines, out = cli_error(capfd, generate_main, [a.replace("<tmp>", str(bad_paths)) for a in argv])
    assert status == 1 and out == ""
    assert len(lines) == 1 and lines[0].startswith("specserve: error: "), lines
    assert all(word in lines[0] for word in words), lines[0]


def test_a_misspelled_flag_is_one_line_with_a_suggestion(capfd):
    status, lines, out = cli_error(capfd, generate_main, ["--speculative-algoritm", "NGRAM"])
    assert status == 2 and out == ""
    assert len(lines) == 1 and "did you mean --speculative-algorithm?" in lines[0], lines


def test_benchmark_mistakes_are_one_line_before_any_work(capfd):
    from specserve.bench.offline import main as offline_main
    from specserve.bench.serving import main as serving_main
    with socket.socket() as closed:   # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    status, lines, out = cli_error(capfd, serving_main, ["--port", str(port), "--num-prompts", "2"])
    assert status == 1 and out == "" and len(lines) == 1 and f"no server answers at http://127.0.0.1:{port}" in lines[0]
    status, lines, _ = cli_error(capfd, offline_main, ["--dataset-path", "/no/such.json"])
    assert status == 1 and lines == ["specserve: error: --dataset-path: /no/such.json is not a file"]
    status, lines, _ = cli_error(capfd, offline_main, ["--max-concurrency", "1", "0"])
    assert status == 2 and len(lines) == 1 and "--max-concurrency: distinct values of at least 1, got 1 0" in lines[0]
    status, lines, _ = cli_error(capfd, serving_main, ["--num-promts", "2"])
    assert status == 2 and len(lines) == 1 and "did you mean --num-prompts?" in lines[0]


def test_log_level_debug_shows_the_traceback():
    with pytest.raises(errors.ArgumentError, match="tp_size"):
        run_cli(generate_main, ["--tp-size", "2", "--log-level", "debug"])


def test_a_port_in_use_is_reported_before_the_model_loads(capfd):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(errors.PortInUseError, match=str(port)):
            from specserve.net import check_port_free
            check_port_free("127.0.0.1", port)
        # --model-path names nothing loadable: reaching the load would be another error
        status, lines, _ = cli_error(capfd, launch_main, ["--port", str(port), "--model-path", "/no/such.gguf"])
    assert status == 1 and len(lines) == 1 and f"port {port}" in lines[0] and "in use" in lines[0], lines


# ---- the Python API: one type per kind, the CLI's message ----
def test_the_api_raises_the_cli_message_with_one_type_per_kind(capfd):
    with pytest.raises(errors.NotSupportedError) as api_error:
        ServerArgs.from_kwargs(speculative_algorithm="NGRAM", speculative_draft_model_path="x")
    assert isinstance(api_error.value, NotImplementedError)
    _, lines, _ = cli_error(capfd, generate_main, ["--speculative-algorithm", "NGRAM",
                                                   "--speculative-draft-model-path", "x"])
    assert lines == [f"specserve: error: {api_error.value}"]
    with pytest.raises(errors.ArgumentError) as bad_value:
        ServerArgs.from_kwargs(mem_fraction_static=2.0)
    assert isinstance(bad_value.value, ValueError) and "mem_fraction_static" in str(bad_value.value)
    with pytest.raises(errors.ModelNotFoundError) as missing:
        from specserve.model.loader import resolve_model_path
        resolve_model_path("/no/such/model.gguf")
    assert isinstance(missing.value, FileNotFoundError)


def test_a_misspelled_keyword_gets_a_suggestion_not_not_implemented():
    from specserve.engine.engine import Engine
    with pytest.raises(errors.UnknownArgumentError, match=r"speculative_algoritm.*did you mean speculative_algorithm\?"):
        Engine(speculative_algoritm="NGRAM")
    with pytest.raises(TypeError, match="no_such_option'$"):   # nothing close: no suggestion
        ServerArgs.from_kwargs(no_such_option=1)


def test_server_args_built_directly_is_as_forgiving_as_engine(caplog, monkeypatch):
    """`ServerArgs(...)` as SGLang users build it: a typo gets Engine's did-you-mean error,
    SGLang-only tuning names Engine's warning, specserve's aliases their field."""
    with pytest.raises(errors.UnknownArgumentError, match=r"speculative_algoritm.*did you mean speculative_algorithm\?"):
        ServerArgs(speculative_algoritm="NGRAM")
    monkeypatch.setattr(sglang_compat, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="specserve"):
        args = ServerArgs(model_path="m", enable_torch_compile=True, speculative_ngram_max_trie_depth=7)
    assert args.model_path == "m" and args.speculative_ngram_branch_length == 7
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["ignoring SGLang's enable_torch_compile=True"]
    with pytest.raises(errors.NotSupportedError, match="enable_lora"):
        ServerArgs(enable_lora=True)
    assert args.replace(port=1).port == 1 and args.replace(port=1).model_path == "m"


# ---- SGLang's names ----
def test_sglang_spelling_is_primary_and_ours_an_alias():
    assert ServerArgs().speculative_ngram_capacity == 10_000_000   # SGLang's default
    args = ServerArgs.from_kwargs(speculative_ngram_max_trie_depth=7)
    assert args.speculative_ngram_branch_length == 7 == args.speculative_ngram_max_trie_depth
    parser = ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for flag in ("--speculative-ngram-branch-length", "--speculative-ngram-max-trie-depth"):
        assert ServerArgs.from_cli_args(parser.parse_args([flag, "5"])).speculative_ngram_branch_length == 5
    assert ServerArgs.from_cli_args(parser.parse_args(["--model", "m.gguf"])).model_path == "m.gguf"
    with pytest.raises(errors.ArgumentError, match="twice"):
        ServerArgs.from_kwargs(speculative_ngram_branch_length=5, speculative_ngram_max_trie_depth=6)


def test_tuning_options_of_sglang_are_accepted_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(sglang_compat, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="specserve"):
        for _ in range(2):
            ServerArgs.from_kwargs(radix_eviction_policy="lfu", enable_torch_compile=True, page_size=16)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and all(m.startswith("ignoring SGLang's") for m in messages), messages
    assert any("radix_eviction_policy" in m and "prefix" in m for m in messages)


def test_sglang_attention_backends_serve_with_our_kernels(caplog, monkeypatch):
    """--attention-backend fa4 / flashinfer (SGLang's usual settings on an H100 and a B200) serve
    as auto with one warning (fa3 is ours: tests/test_fa3_backend.py); AMD's backend stays
    refused, naming the field."""
    monkeypatch.setattr(sglang_compat, "_warned", set())
    parser = ArgumentParser()
    ServerArgs.add_cli_args(parser)
    with caplog.at_level(logging.WARNING, logger="specserve"):
        for value in ("fa4", "flashinfer"):
            assert ServerArgs.from_cli_args(parser.parse_args(["--attention-backend", value])).attention_backend == "auto"
        assert ServerArgs(attention_backend="triton").attention_backend == "triton"
    assert len(caplog.records) == 1 and "fa4" in caplog.records[0].getMessage()
    assert ServerArgs(attention_backend="fa3").attention_backend == "fa3"
    with pytest.raises(errors.ArgumentError, match="attention_backend"):
        ServerArgs(attention_backend="aiter")


def test_every_sglang_name_is_accepted_at_its_default_and_features_refused_otherwise(caplog):
    with caplog.at_level(logging.WARNING, logger="specserve"):
        ServerArgs.from_kwargs(**{name: default for name, (default, _) in sglang_compat.SGLANG_ONLY_FIELDS.items()})
        ServerArgs.from_kwargs(enable_lora=False, lora_paths=None, dp_size=1, quantization=None)
    assert not caplog.records
    for feature in ({"enable_lora": True}, {"dp_size": 2}, {"quantization": "fp8"}, {"kv_cache_dtype": "fp8_e5m2"}):
        with pytest.raises(errors.NotSupportedError, match=next(iter(feature))):
            ServerArgs.from_kwargs(**feature)


def test_sglang_command_lines_parse():
    parser = ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", "m.gguf", "--disable-radix-cache", "--cuda-graph-bs", "1", "2", "4", "--page-size", "1",
            "--tensor-parallel-size", "1", "--speculative-ngram-branch-length", "12", "--enable-metrics"]
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    assert args.speculative_ngram_branch_length == 12 and args.tp_size == 1 and args.disable_radix_cache


# ---- defaults that depend on the algorithm ----
@pytest.mark.parametrize("argv, expected", [
    ([], (16, True)),                                              # NGRAM, adaptive: a chain of up to 16
    (["--speculative-disable-adaptive"], (8, False)),              # a pinned size: SGLang-like trees of 8
    (["--no-speculative-one-branch"], (16, False)),
    (["--speculative-one-branch", "--speculative-num-draft-tokens", "4"], (4, True)),
])
def test_ngram_draft_size_and_shape_default_by_policy(argv, expected):
    parser = ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m", "--speculative-algorithm", "NGRAM", *argv]))
    assert (args.speculative_num_draft_tokens, args.speculative_one_branch) == expected


def test_model_drafters_and_plain_decoding_keep_eight_nodes():
    assert ServerArgs(model_path="m").speculative_num_draft_tokens == 8
    eagle = ServerArgs(model_path="m", speculative_algorithm="EAGLE", speculative_draft_model_path="h",
                       speculative_eagle_topk=4, speculative_num_steps=3)
    assert (eagle.speculative_num_draft_tokens, eagle.speculative_one_branch) == (8, False)


# ---- --help ----
def test_help_shows_defaults_and_marks_what_is_not_implemented(capsys):
    from specserve.runner.cpu_kv_budget import CPU_KV_MEMORY_FRACTION, CPU_MAX_KV_TOKENS, CPU_MIN_KV_TOKENS
    with pytest.raises(SystemExit):
        generate_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("--speculative-num-draft-tokens INT tree nodes per verify step, the root included (a chain of "
            "STANDALONE / EAGLE: speculative_num_steps + 1; NAIVE_EAGLE / MTP: 2); default: NGRAM with the "
            "adaptive draft length, and the n-gram trie of speculative_hybrid_ngram beside a chain, 16 (the largest "
            "size it picks), otherwise 8") in text
    assert "--speculative-one-branch, --no-speculative-one-branch NGRAM: draft a single chain" in text
    assert CPU_KV_MEMORY_FRACTION == 0.1
    assert (f"on a CPU the model's context length, within {CPU_MIN_KV_TOKENS}-{CPU_MAX_KV_TOKENS} tokens and "
            "a tenth of the available memory") in text
    assert ("--tp-size INT, --tensor-parallel-size INT tensor parallelism: one process per rank, each holding "
            "1/tp_size of the heads, MLP and vocabulary (gloo on a CPU, NCCL on GPUs: cuda:0..tp_size-1); a model "
            "drafter runs once, on rank 0, with whole weights") in text
    assert "--speculative-token-map STR EAGLE / EAGLE3: FR-Spec hot-token map" in text
    assert "--radix-eviction-policy" in text and "ignored with a warning" in text   # named in the SGLang section only
    assert "--disable-radix-cache recompute every prompt" in text
    assert "--enable-lora" not in text


# ---- logging ----
def test_log_lines_go_through_tqdm_to_stderr(monkeypatch, capfd):
    import tqdm
    written = []
    monkeypatch.setattr(tqdm.tqdm, "write", classmethod(lambda cls, line, file=None: written.append((line, file))))
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        setup_logging("info")
        logging.getLogger("specserve").info("hello")
    finally:
        root.handlers[:], root.level = handlers, level
    assert len(written) == 1 and written[0][0].endswith("hello") and written[0][1] is sys.stderr


# ---- stdout carries only the text (a real run of the default model) ----
def test_stdout_holds_only_the_generated_text():
    result = subprocess.run([sys.executable, "-m", "specserve.generate", "--prompt", "The capital of France is",
                             "--max-new-tokens", "4", "--max-total-tokens", "512"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "no --model-path given" in result.stderr and "tokens/s" in result.stderr
    assert "specserve" not in result.stdout and "tokens/s" not in result.stdout
    assert result.stdout.strip()


def test_compare_plain_frees_the_first_engine_before_the_second_loads():
    # an engine's reference cycles held its weights until a collection, so make run's second
    # engine now and then loaded beside the first (a 3.8 GiB peak against 2.5)
    code = ("import gc; from specserve.model.llama import DecoderLayer; from specserve import generate; "
            "from specserve.args import ServerArgs; "
            "args = ServerArgs.from_cli_args(generate.parse_args(['--max-total-tokens', '512', '--log-level', 'warning'])); "
            "generate.run_once(args, 'Hello', False, {'max_new_tokens': 2}); "
            "print(sum(isinstance(o, DecoderLayer) for o in gc.get_objects()))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "0"
