"""The peer benchmark on a CPU: the GGUF -> HF conversion, the argument handling, the table,
and a real run of the specserve engines (a tiny random model behind SmolLM2's tokenizer,
EAGLE-3 with a random head of our trainer's layout) with a peer that has no wheels and an
EAGLE-3 peer without a head, which must be reported and skipped."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest
import torch

from specserve.bench import peers, peers_report
from specserve.bench.gguf_to_hf import DONE_MARKER, convert
from specserve.bench.peers_engines import ENGINES
from specserve.bench.peers_heads import HeadMissing, head_for_engine, vllm_head_view
from tests.fused_fixtures import save_random_eagle_head


@pytest.fixture(scope="module")
def converted_smollm2(smollm2_path, tmp_path_factory):
    return convert(smollm2_path, str(tmp_path_factory.mktemp("hf") / "smollm2"), "bfloat16")


def test_conversion_keeps_weights_tokenizer_and_template(converted_smollm2, smollm2_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    # the reference straight from the GGUF (conftest's smollm2_hf is itself a conversion)
    gguf = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path),
                                                dtype=torch.float32)
    saved = load_file(os.path.join(converted_smollm2, "model.safetensors"))
    reference = {name: t for name, t in gguf.state_dict().items() if name != "lm_head.weight"}  # tied
    assert saved.keys() == reference.keys()
    assert all(saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], reference[name].to(torch.bfloat16))
               for name in saved)
    config = json.load(open(os.path.join(converted_smollm2, "config.json")))
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    ours = AutoTokenizer.from_pretrained(converted_smollm2)
    original = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))
    text = "def add(a, b):\n    return a + b  # émoji 🙂"
    assert ours(text).input_ids == original(text).input_ids
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(messages, tokenize=False)
    before = os.path.getmtime(os.path.join(converted_smollm2, DONE_MARKER))
    assert convert(smollm2_path, converted_smollm2, "bfloat16") == converted_smollm2     # done: not again
    assert os.path.getmtime(os.path.join(converted_smollm2, DONE_MARKER)) == before


def test_quick_mode_measures_one_wave_per_cell():
    ns = peers.parse_args(["run", "--quick", "--engines", "specserve-plain", "vllm-ngram"])
    assert ns.engines == ["specserve-plain", "vllm-ngram"] and ns.bs1_prompts == 2
    assert [peers.prompts_per_cell(ns, c) for c in (1, 8, 32, 64)] == [2, 8, 32, 64]
    full = peers.parse_args(["run"])
    assert [peers.prompts_per_cell(full, c) for c in (1, 8, 32, 64)] == [4, 16, 64, 128]
    with pytest.raises(SystemExit):
        peers.parse_args(["run", "--engines", "tgi-plain"])


def _cell(engine: str, tok_s: float | None, concurrency: int = 8, hashes=("a", "b"), **extra) -> dict:
    return {"kind": "cell", "model": "m", "engine": engine, "engine_family": engine.split("-")[0],
            "workload": "code-types", "turn": 1, "concurrency": concurrency, "tok_s": tok_s,
            "output_hashes": list(hashes), **extra}


def test_table_worst_cell_first_with_failures_and_agreement():
    rows = [_cell("specserve-plain", 100, 1), _cell("specserve-ngram", 300, 1, accept_length=2.5),
            _cell("vllm-plain", 120, 1), _cell("vllm-ngram", 200, 1, hashes=("a", "x")),
            _cell("specserve-plain", 1000), _cell("specserve-ngram", 900, accept_length=1.0), _cell("vllm-plain", 2000),
            _cell("vllm-ngram", None, error="3 requests failed; the first: HTTP 500"),
            {"kind": "engine", "model": "m", "engine": "sglang-plain", "engine_family": "sglang",
             "error": "no wheels for sglang"}]
    text = peers_report.render(rows)
    table = [line for line in text.splitlines() if line.startswith("| m |")]
    assert table[0].endswith("**0.50x** (vs vllm-plain) |")              # 1000 / 2000: worst first
    assert table[1].endswith("**1.50x** (vs vllm-ngram) |")              # 300 / 200
    assert "| failed |" in table[0] and table[0].count("failed") == 2   # vllm-ngram's 500, sglang's missing wheels
    assert "| vllm-ngram | 75% | 2 |" in text                            # 1 of 2, then 2 of 2
    assert "no wheels for sglang" in text and "HTTP 500" in text
    assert "| specserve-ngram | 2 | 1.00 / 2.50 / 2.50 | 1 of 2 |" in text   # one cell kept every step plain


@pytest.fixture(scope="module")
def tiny_hf_root(converted_smollm2, tmp_path_factory):
    """<root>/tiny: a random 2-layer Llama behind SmolLM2's tokenizer, in HF layout."""
    import transformers
    hf_root = tmp_path_factory.mktemp("tiny-hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted_smollm2)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096, tie_word_embeddings=True,
                                      eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf_root / "tiny")
    tokenizer.save_pretrained(hf_root / "tiny")
    return hf_root


def test_specserve_engines_run_and_a_peer_without_wheels_is_reported(tiny_hf_root, tmp_path):
    hf_root = tiny_hf_root
    save_random_eagle_head(hf_root / "tiny", tmp_path / "head", draft_vocab=torch.arange(0, 256, 2))
    save_random_eagle_head(hf_root / "tiny", tmp_path / "head2", algorithm="EAGLE", draft_vocab=torch.arange(0, 256, 2))
    out = tmp_path / "out"
    engines = ("specserve-plain", "specserve-ngram", "specserve-eagle3", "specserve-naive-eagle",
               "specserve-standalone", "specserve-eagle")
    table = peers.run(peers.parse_args([
        "run", "--quick", "--models", "tiny", "--hf-root", str(hf_root), "--models-dir", str(tmp_path),
        "--engines", "specserve-plain", "vllm-plain", "specserve-ngram", "sglang-eagle3", "specserve-eagle3",
        "specserve-naive-eagle", "specserve-standalone", "specserve-eagle",
        "--eagle-head", f"tiny={tmp_path / 'head'}", "--eagle2-head", f"tiny={tmp_path / 'head2'}",
        "--draft-model", "tiny=tiny", "--concurrency", "1", "4",
        "--max-new-tokens", "8", "--wheels", str(tmp_path / "no-wheels"), "--envs-root", str(tmp_path / "envs"),
        "--specserve-args", "--device cpu --dtype float32", "--out", str(out)]))
    rows = [json.loads(line) for line in open(out / "peers.jsonl")]
    cells = [r for r in rows if r["kind"] == "cell"]
    by_engine = {e: [c for c in cells if c["engine"] == e] for e in engines}
    # 4 workloads, sharegpt-repeat twice (first turns, then the repeat), at 2 concurrencies
    assert all(len(engine_cells) == 10 and all(c["tok_s"] > 0 and c["output_tokens"] == c["prompts"] * 8
                                               for c in engine_cells) for engine_cells in by_engine.values())
    assert {c["prompts"] for c in cells} == {2, 8}
    assert all(len(c["ttft_ms"]) == c["prompts"] and min(c["ttft_ms"]) > 0 for c in cells)   # who waited
    # a speculative server's counts: each cell's decode steps and the tokens a step committed, which
    # together make every token but the first of each answer (its prefill made that one), or every
    # token of an answer whose prompt had all but its last token cached when it was scheduled (a
    # prefix-cache hit or a chunk's end: the scheduler decodes a prompt with one token left; timing
    # decides it, CI under load counted 57 of a multi-turn cell's 64); a plain server counts none
    assert not any("accept_length" in c for c in by_engine["specserve-plain"])
    for name in engines[1:]:
        assert all(c["decode_steps"] >= c["prompts"] and c["accept_length"] >= 1
                   and c["prompts"] * 7 <= round(c["decode_steps"] * c["accept_length"]) <= c["prompts"] * 8
                   for c in by_engine[name]), name
    started = {r["engine"]: r for r in rows if r["kind"] == "engine" and "error" not in r}
    assert started["specserve-ngram"]["settings"]["chunked_prefill_size"] == 2048   # what the server reports
    assert all(row["kv_tokens"] > 0 for row in started.values())   # the KV capacity each server reports
    assert started["specserve-ngram"]["settings"]["speculative_num_draft_tokens"] >= 2
    assert f"--speculative-draft-model-path {tmp_path / 'head'}" in started["specserve-eagle3"]["command"]
    assert started["specserve-eagle3"]["settings"]["speculative_num_draft_tokens"] == 4
    assert f"--speculative-draft-model-path {hf_root / 'tiny'}" in started["specserve-standalone"]["command"]
    assert (f"--speculative-algorithm EAGLE --speculative-draft-model-path {tmp_path / 'head2'}"
            in started["specserve-eagle"]["command"])
    vllm = [r for r in rows if r.get("engine") == "vllm-plain"]
    assert len(vllm) == 1 and vllm[0]["kind"] == "engine" and "no wheels for vllm" in vllm[0]["error"]
    sglang = [r for r in rows if r.get("engine") == "sglang-eagle3"]   # it has the head, not the wheels
    assert len(sglang) == 1 and "no wheels for sglang" in sglang[0]["error"]
    text = open(table).read()
    for name in engines[1:]:     # fp32 greedy: speculation changes no token
        assert f"| {name} | 100% | 10 |" in text
    speeds, engines_measured = text.split("## Greedy agreement")[0], text.split("## Engines measured")[1]
    assert speeds.count("| tiny |") == 10 and "no wheels for vllm" in text
    assert all(f"| tiny | {name} | specserve " in engines_measured for name in engines)
    assert os.path.exists(out / "logs" / "tiny-specserve-ngram.log")


def test_each_engine_gets_a_share_of_the_time_left_weighted_by_its_start_up():
    plain = [peers.ENGINES["specserve-plain"]] * 6              # alike: an even split
    assert peers.engine_budget_end(0.0, 540.0, plain, 240.0) == 90.0        # 6 engines in 9 minutes
    assert peers.engine_budget_end(300.0, 540.0, plain[:2], 240.0) == 420.0  # early finishers leave their rest
    assert peers.engine_budget_end(0.0, 540.0, plain[:1], 240.0) == 240.0   # --engine-budget-s caps it
    assert peers.engine_budget_end(530.0, 540.0, plain[:3], 240.0) < 540.0
    # session 13's call: vLLM's EAGLE-3 first of four got 137 s of 550 and did not start in them
    eagle = [peers.ENGINES[name] for name in
             ("vllm-eagle3", "specserve-eagle3", "specserve-eagle3-tree", "specserve-naive-eagle")]
    vllm_end = peers.engine_budget_end(0.0, 550.0, eagle, 300.0)
    assert vllm_end > eagle[0].startup_s + peers.MEASURE_S - 30 and vllm_end > 550.0 / 4 + 60
    assert peers.engine_budget_end(0.0, 550.0, eagle[1:], 300.0) < vllm_end


def test_a_server_that_started_late_still_measures():
    # a 7B's first start: 133 s of a 139-s share; it measures MEASURE_S more, within the run's limit
    assert peers.measuring_end(139.0, 133.0, 560.0) == 133.0 + peers.MEASURE_S
    assert peers.measuring_end(139.0, 133.0, 150.0) == 150.0     # never past the engine's latest end
    assert peers.measuring_end(300.0, 40.0, 560.0) == 300.0      # a quick start keeps its share


def test_an_unreadable_wheel_archive_is_the_engines_row_not_a_crash(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "vllm.tar").write_bytes(b"not a tar archive")
    ns = peers.parse_args(["run", "--wheels", str(wheels), "--envs-root", str(tmp_path / "envs"),
                           "--out", str(tmp_path / "out")])
    rows = []
    peers.run_engine(peers.ENGINES["vllm-plain"], "m", str(tmp_path), {}, ns, rows.append, 0.0)
    assert len(rows) == 1 and rows[0]["engine"] == "vllm-plain"
    assert rows[0]["error"].startswith("installing its wheels: ReadError")


def test_peer_servers_get_the_flags_that_keep_flashinfer_out_of_the_way(tmp_path):
    """vLLM 0.26 imports flashinfer for its sampler unless VLLM_USE_FLASHINFER_SAMPLER=0 (it is
    not carried); SGLang imports it whatever the flags, so it is carried but none of its
    kernels may run (they JIT-compile)."""
    from specserve.bench.peers_engines import ENGINES
    from specserve.bench.peers_install import server_env
    for name in ("vllm-plain", "vllm-ngram", "vllm-suffix"):
        config = ENGINES[name]
        env = server_env(str(tmp_path), "/repo", config.env)
        assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and env["PYTHONPATH"].startswith(f"{tmp_path}:/repo")
        command = config.command("/hf/m", "m", 8000)
        assert command[command.index("--attention-backend") + 1] == "FLASH_ATTN"
    for name in ("sglang-plain", "sglang-ngram"):
        command = " ".join(ENGINES[name].command("/hf/m", "m", 8000))
        assert "--attention-backend fa3 --sampling-backend pytorch --disable-flashinfer-autotune" in command
        assert "--cuda-graph-max-bs-decode 64" in command
    wheels = open(os.path.join(os.path.dirname(peers.__file__), "peers_wheels", "sglang.txt")).read().split()
    assert "flashinfer-python==0.6.15.post1" in wheels and "sglang==0.5.17" in wheels
    assert not [w for w in open(os.path.join(os.path.dirname(peers.__file__), "peers_wheels", "vllm.txt"))
                if w.startswith("flashinfer")]


def test_specserve_version_comes_from_the_environment_where_git_may_be_stale(monkeypatch):
    from specserve.bench.peers_install import engine_version
    monkeypatch.setenv("SPECSERVE_COMMIT", "abc1234")
    assert engine_version("specserve", None, ".") == "specserve abc1234"
    monkeypatch.delenv("SPECSERVE_COMMIT")
    assert engine_version("specserve", None, ".").startswith("specserve ")


def test_eagle3_engines_draft_a_chain_of_3_with_the_head():
    for name in ("specserve-eagle3", "sglang-eagle3"):
        command = " ".join(ENGINES[name].command("/hf/m", "m", 8000, "/heads/m"))
        assert ("--speculative-algorithm EAGLE3 --speculative-draft-model-path /heads/m --speculative-num-steps 3 "
                "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4") in command
    command = ENGINES["vllm-eagle3"].command("/hf/m", "m", 8000, "/heads/m-vllm")
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": "/heads/m-vllm", "num_speculative_tokens": 3}
    assert ENGINES["vllm-eagle3"].env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    with pytest.raises(ValueError, match="eagle_head"):
        ENGINES["sglang-eagle3"].command("/hf/m", "m", 8000)
    assert [name for name, config in ENGINES.items() if config.needs_eagle_head] == [
        "specserve-eagle3", "specserve-eagle3-tree", "specserve-naive-eagle", "vllm-eagle3", "sglang-eagle3",
        "sglang-eagle3-tree"]
    for name in ("specserve-eagle3-tree", "sglang-eagle3-tree"):   # EAGLE-2's dynamic tree, same head
        command = " ".join(ENGINES[name].command("/hf/m", "m", 8000, "/heads/m"))
        assert ("--speculative-algorithm EAGLE3 --speculative-draft-model-path /heads/m --speculative-num-steps 3 "
                "--speculative-eagle-topk 4 --speculative-num-draft-tokens 8") in command
    command = " ".join(ENGINES["specserve-naive-eagle"].command("/hf/m", "m", 8000, "/heads/m"))
    assert "--speculative-algorithm NAIVE_EAGLE --speculative-draft-model-path /heads/m" in command
    command = " ".join(ENGINES["specserve-eagle"].command("/hf/m", "m", 8000, eagle2_head="/heads/m2"))
    assert ("--speculative-algorithm EAGLE --speculative-draft-model-path /heads/m2 --speculative-num-steps 3 "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4") in command
    with pytest.raises(ValueError, match="eagle2_head"):          # an EAGLE-3 head is not the one it reads
        ENGINES["specserve-eagle"].command("/hf/m", "m", 8000, "/heads/m")
    assert [name for name, config in ENGINES.items() if config.needs_eagle2_head] == ["specserve-eagle"]
    command = " ".join(ENGINES["specserve-standalone"].command("/hf/m", "m", 8000, draft_model="/hf/small"))
    assert "--speculative-algorithm STANDALONE --speculative-draft-model-path /hf/small --speculative-num-steps 3" \
        in command
    with pytest.raises(ValueError, match="draft_model"):
        ENGINES["specserve-standalone"].command("/hf/m", "m", 8000, "/heads/m")
    assert ENGINES["vllm-ngram"].command("/hf/m", "m", 8000, "/heads/m") == ENGINES["vllm-ngram"].command(
        "/hf/m", "m", 8000)


def test_eagle_head_arguments():
    ns = peers.parse_args(["run", "--eagle-head", "qwen2.5-coder-1.5b-instruct=/root/eagle3-1.5b", "tiny=/h/t"])
    assert ns.eagle_heads == {"qwen2.5-coder-1.5b-instruct": "/root/eagle3-1.5b", "tiny": "/h/t"}
    assert peers.parse_args(["run"]).eagle_heads == {}
    for bad in (["/root/eagle3-1.5b"], ["m="], ["=/h"], ["m=/a", "m=/b"], ['m=/a"b']):
        with pytest.raises(SystemExit):
            peers.parse_args(["run", "--eagle-head", *bad])


def test_an_eagle3_engine_without_a_head_is_an_error_row_before_any_install(tmp_path):
    (tmp_path / "empty-head").mkdir()
    ns = peers.parse_args(["run", "--wheels", str(tmp_path / "no-wheels"), "--envs-root", str(tmp_path / "envs"),
                           "--eagle-head", "other=/h/o", f"headless={tmp_path / 'empty-head'}",
                           "--out", str(tmp_path / "out")])
    rows = []
    for model in ("m", "headless"):
        peers.run_engine(ENGINES["vllm-eagle3"], model, str(tmp_path), {}, ns, rows.append, 0.0)
    assert [(r["kind"], r["engine"], r["model"]) for r in rows] == [("engine", "vllm-eagle3", "m"),
                                                                    ("engine", "vllm-eagle3", "headless")]
    assert rows[0]["error"].startswith("no EAGLE-3 head for m: pass --eagle-head m=DIR")
    assert "heads given for: headless, other" in rows[0]["error"]
    assert rows[1]["error"] == f"no EAGLE-3 head for headless: {tmp_path / 'empty-head'} has no config.json"
    assert not (tmp_path / "envs").exists()     # the wheels were never looked at
    rows.clear()
    peers.run_engine(ENGINES["specserve-standalone"], "m", str(tmp_path), {}, ns, rows.append, 0.0)
    assert rows[0]["error"] == "no draft model for m: pass --draft-model m=DRAFT (a model of --models-dir)"
    rows.clear()
    peers.run_engine(ENGINES["specserve-eagle"], "m", str(tmp_path), {}, ns, rows.append, 0.0)
    assert rows[0]["error"].startswith("no EAGLE-2 head for m: pass --eagle2-head m=DIR")
    with pytest.raises(SystemExit):
        peers.parse_args(["run", "--draft-model", "m"])


def test_vllm_reads_a_view_of_the_head_with_its_layer_numbers(tiny_hf_root, tmp_path):
    """SGLang (and we) capture the output of layer id; vLLM's V1 runner captures after id
    layers: its view says id + 1 at the top level, which both of vLLM's runners read first."""
    from specserve.speculative.heads.eagle_checkpoint import load_head
    head = tmp_path / "head"
    save_random_eagle_head(tiny_hf_root / "tiny", head, draft_vocab=torch.arange(0, 512, 2))
    saved = json.load(open(head / "config.json"))
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"]       # the name vLLM and SGLang register
    layers = saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert "eagle_aux_hidden_state_layer_ids" not in saved
    heads = {"m": str(head)}
    assert head_for_engine(ENGINES["sglang-eagle3"], "m", heads, str(tmp_path / "views")) == str(head)
    assert head_for_engine(ENGINES["specserve-eagle3"], "m", heads, str(tmp_path / "views")) == str(head)
    assert head_for_engine(ENGINES["vllm-plain"], "m", heads, str(tmp_path / "views")) is None
    view = head_for_engine(ENGINES["vllm-eagle3"], "m", heads, str(tmp_path / "views"))
    assert view == str(tmp_path / "views" / "m-vllm")
    config = json.load(open(os.path.join(view, "config.json")))
    assert config["eagle_aux_hidden_state_layer_ids"] == [layer + 1 for layer in layers]
    assert {k: v for k, v in config.items() if k != "eagle_aux_hidden_state_layer_ids"} == saved
    assert os.path.realpath(os.path.join(view, "model.safetensors")) == str(head / "model.safetensors")
    original, through_view = load_head(str(head)), load_head(view)   # the same head, whichever is read
    assert original.config == through_view.config
    assert all(torch.equal(a, b) for a, b in zip(original.state_dict().values(), through_view.state_dict().values()))
    assert vllm_head_view(str(head), view) == view      # again, over the links of the first view
    with pytest.raises(HeadMissing, match="no EAGLE-3 head for n"):
        head_for_engine(ENGINES["vllm-eagle3"], "n", heads, str(tmp_path / "views"))


def test_a_head_without_aux_layers_goes_to_vllm_as_it_is(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eagle_config": {"use_aux_hidden_state": False}}))
    assert vllm_head_view(str(tmp_path), str(tmp_path / "view")) == str(tmp_path)
    assert not (tmp_path / "view").exists()


def test_peer_servers_find_the_images_cuda_libraries(tmp_path, monkeypatch):
    """sgl-deep-gemm's prebuilt _C.so links libnvrtc.so.13 by name: the dynamic linker must see
    the `nvidia/<package>/lib` folders of torch's wheels, ahead of what LD_LIBRARY_PATH held."""
    from specserve.bench.peers_install import server_env
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/lib")
    paths = server_env(None, "/repo", {})["LD_LIBRARY_PATH"].split(os.pathsep)
    assert paths[0] == str(lib) and paths[-1] == "/opt/lib"


def test_a_merged_table_says_which_build_ran_when(tmp_path):
    """Rows of several days merge into one table: each engine row takes its file's date."""
    def write(name, date, engine, version):
        rows = [{"kind": "device", "name": "H100", "date": date},
                {"kind": "engine", "model": "m", "engine": engine, "engine_family": engine.split("-")[0],
                 "version": version, "startup_s": 30.0}, _cell(engine, 100)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)
    rows = peers_report.load_rows([write("a.jsonl", "2026-11-24", "vllm-plain", "vllm 0.26.0"),
                                   write("b.jsonl", "2026-11-25", "specserve-plain", "specserve abc1234")])
    text = peers_report.render(rows)
    assert "| m | vllm-plain | vllm 0.26.0 | 2026-11-24 | 30.0 |" in text
    assert "| m | specserve-plain | specserve abc1234 | 2026-11-25 | 30.0 |" in text


def test_a_failed_start_up_that_a_merged_rerun_got_past_is_not_listed():
    failed = {"kind": "engine", "model": "m", "engine": "vllm-eagle3", "engine_family": "vllm", "error": "no head"}
    other = {"kind": "engine", "model": "m", "engine": "sglang-eagle3", "engine_family": "sglang", "error": "no wheels"}
    rows = [failed, other, _cell("specserve-plain", 100), _cell("vllm-eagle3", 150)]
    text = peers_report.render(rows)
    assert "no head" not in text and "no wheels" in text
    assert "no head" in peers_report.render([failed, other, _cell("specserve-plain", 100)])


def test_specserve_without_its_server_packages_is_an_error_row_before_start_up(tmp_path, monkeypatch):
    ns = peers.parse_args(["run", "--wheels", str(tmp_path / "no-wheels"), "--envs-root", str(tmp_path / "envs"),
                           "--out", str(tmp_path / "out")])
    real_find_spec = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real_find_spec(name, *a))
    started = []
    monkeypatch.setattr(peers, "ServerProcess", lambda *a, **k: started.append(a))
    rows = []
    peers.run_engine(ENGINES["specserve-plain"], "m", str(tmp_path), {}, ns, rows.append, 0.0)
    assert not started
    [row] = rows
    assert row["kind"] == "engine" and row["engine"] == "specserve-plain"
    assert row["error"].startswith("specserve's server needs uvicorn, which neither")
    assert "carry .peers_wheels/specserve" in row["error"]


def test_vllm_acceptance_comes_from_its_prometheus_counters():
    """vLLM logs no acceptance in a short run; its /metrics counters (one line per engine and
    model) give the cell's steps and tokens: each verify step commits its accepted drafts + 1."""
    from specserve.bench.peers_engines import accept_between, vllm_spec_counts
    page = ('# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n'
            '# TYPE vllm:spec_decode_num_drafts_total counter\n'
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0\n'
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 20.0\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 360.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 150.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 30.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 80.0\n')
    assert vllm_spec_counts(page) == (120, 300)
    assert vllm_spec_counts("vllm:num_requests_running 3.0\n") is None
    before = vllm_spec_counts(page.replace("100.0", "40.0").replace("150.0", "60.0"))
    assert accept_between(before, vllm_spec_counts(page)) == {"decode_steps": 60, "accept_length": 2.5}


class StubServer:
    base_url = "http://nowhere"

    def alive(self) -> bool:
        return True


def measured_without_a_server(monkeypatch, run_prompts, summary: dict) -> None:
    """measure_engine's requests go to `run_prompts`; each cell's summary is `summary`."""
    monkeypatch.setattr(peers, "_run_prompts", run_prompts)
    monkeypatch.setattr(peers, "spec_counters", lambda base_url: None)
    monkeypatch.setattr(peers, "cell_summary", lambda results, duration, server: summary)


def test_each_suite_cell_is_warmed_on_other_prompts_of_its_shape_first(monkeypatch):
    """Before a cell is timed, a wave of the workload's warm-up prompts at the cell's concurrency
    and output length (an adaptive engine then meets the cell with its policy warm for that batch
    size); a size workload's cells are timed after the first warm-up alone."""
    calls = []

    async def run_prompts(session, base_url, model, prompts, concurrency, max_tokens, sampling):
        assert sampling == {}   # greedy unless --temperature
        calls.append((prompts[0][0], len(prompts), concurrency, max_tokens))
        return [], 1.0

    measured_without_a_server(monkeypatch, run_prompts, {})
    monkeypatch.setattr(peers, "size_cell", lambda size, concurrency, summary, results: summary)
    ns = peers.parse_args(["run", "--quick", "--concurrency", "1", "8", "--max-new-tokens", "16",
                           "--workloads", "code-types", "prefill-2k"])
    ns.sizes = {"prefill-2k": peers.parse_size_workload("prefill-2k", 16, 32768)}
    timed, warm = [[1, 1]] * 64, [[2, 2]] * 64     # the first id tells the lists apart
    workloads = {"code-types": (timed, warm), "prefill-2k": ([[3, 3]] * 4, [[4, 4]] * 4)}
    rows = []
    asyncio.run(peers.measure_engine(StubServer(), "m", workloads, ns, time.monotonic() + 60, rows.append))
    first = [(2, 16, 16), (4, 4, 16)]   # every workload's warm-up prompts once, at concurrency 16
    assert [call[:3] for call in calls[:2]] == first
    size_out = ns.sizes["prefill-2k"].output_len
    assert calls[2:] == [(2, 2, 1, 16), (1, 2, 1, 16), (3, 2, 1, size_out), (2, 8, 8, 16), (1, 8, 8, 16)]
    assert [(r["workload"], r["concurrency"]) for r in rows] == [("code-types", 1), ("prefill-2k", 1),
                                                                  ("code-types", 8)]


def test_temperature_samples_every_request_of_every_engine(monkeypatch):
    """--temperature 0.7 --top-p 0.9: every warm-up and timed request is sent with them (the
    OpenAI fields every engine reads), each cell row carries them, and the report compares no
    outputs across engines there (each samples its own)."""
    sent = []

    async def run_prompts(session, base_url, model, prompts, concurrency, max_tokens, sampling):
        sent.append(sampling)
        return [], 1.0

    measured_without_a_server(monkeypatch, run_prompts, {"output_hashes": ["a"]})
    ns = peers.parse_args(["run", "--quick", "--concurrency", "1", "--max-new-tokens", "16",
                           "--workloads", "code-types", "--temperature", "0.7", "--top-p", "0.9"])
    rows = []
    asyncio.run(peers.measure_engine(StubServer(), "m", {"code-types": ([[1, 1]] * 8, [[2, 2]] * 8)}, ns,
                                     time.monotonic() + 60, rows.append))
    assert len(sent) == 3 and all(s == {"temperature": 0.7, "top_p": 0.9} for s in sent)
    assert [(r["temperature"], r["top_p"]) for r in rows] == [(0.7, 0.9)]
    from specserve.bench.peers_report import agreement
    assert agreement(rows[0], {"output_hashes": ["a"]}) is None and agreement({"output_hashes": ["a"]},
                                                                             {"output_hashes": ["a"]}) == 1.0
