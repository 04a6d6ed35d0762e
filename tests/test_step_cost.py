"""lab.step_cost on the CPU: a tiny random target and a random EAGLE-3 head written in the
checkpoint layout, the plain / verify / fused-step rows of both engines, and the split of
a fused step's GPU time (from rows as the GPU writes them)."""
from __future__ import annotations

import json

import pytest

from lab import step_cost
from lab.random_head import write_random_eagle3_head
from specserve.bench.random_model import SHAPES
from specserve.speculative.heads.eagle_checkpoint import load_head

TINY = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64, intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
            rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=1024, tie_word_embeddings=False)


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny", TINY)
    return "tiny"


def test_random_head_loads_with_the_shape_of_a_real_one(tmp_path, tiny_shape):
    write_random_eagle3_head(str(tmp_path), tiny_shape, draft_vocab_size=1000)
    head = load_head(str(tmp_path), target_num_layers=TINY["num_hidden_layers"])
    config = head.config
    assert (config.hidden_size, config.draft_vocab_size, config.vocab_size) == (64, 1000, 4096)
    assert config.aux_layers == (0, 1, 3) and head.fc.weight.shape == (64, 3 * 64)
    vocabulary = head.draft_vocab()
    assert vocabulary.unique().numel() == 1000 and int(vocabulary.max()) < 4096
    assert head.d2t.any()   # a vocabulary that is not the first 1000 ids: the map is used
    assert float(head.lm_head.weight.detach().std()) == pytest.approx(0.02, rel=0.1)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        write_random_eagle3_head(str(tmp_path), tiny_shape, draft_vocab_size=5000)


def test_eagle3_rows_on_the_cpu(tmp_path, tiny_shape):
    out = tmp_path / "out"
    rows = step_cost.main(["--shape", tiny_shape, "--algorithm", "EAGLE3", "--num-steps", "3", "--draft-vocab", "1024",
                           "--batch-sizes", "1", "2", "--steps", "3", "--warm-steps", "2", "--prompt-len", "24", "--device", "cpu",
                           "--model-dir", str(tmp_path), "--out", str(out)])
    measured = [(r["engine"], r["hidden_capture"], r["batch_size"], r["step"], r["draft_size"]) for r in rows]
    assert measured == [("NGRAM", False, bs, step, size) for bs in (1, 2) for step, size in (("plain", 1), ("verify", 4))] \
        + [("EAGLE3", True, bs, step, size) for bs in (1, 2) for step, size in (("plain", 1), ("verify", 4), ("fused", 4))]
    for row in rows:
        assert row["kind"] == "step_cost" and row["wall_ms"] > 0 and row["device"] == "cpu"
        assert row["accept_length"] >= 1 and row["vs_plain"] > 0
        assert "graph_gpu_ms" not in row   # no graphs on the CPU, and so no split rows
    assert all(r["fused_share"] == 1.0 for r in rows if r["step"] == "fused")
    with open(out / "step_cost.jsonl") as f:
        assert [json.loads(line) for line in f] == rows


def test_forecast_rows_launch_every_step_from_a_forecast(tmp_path, tiny_shape):
    """With drafting steps launched ahead (a GPU engine's; forced here), a forecast row's steps
    are each launched before the step before is read, from ForecastChainDrafter's table."""
    from specserve.bench.random_model import write_model_config
    from specserve.engine.draft_ahead import DraftAhead
    from specserve.engine.engine import Engine
    path = write_model_config(str(tmp_path / "tiny"), tiny_shape)
    engine = Engine(model_path=path, load_format="dummy", log_level="warning", speculative_algorithm="NGRAM",
                    device="cpu", max_total_tokens=4096, skip_server_warmup=True, speculative_num_draft_tokens=4)
    engine.shutdown()
    engine.core.draft_ahead = DraftAhead(engine.core.scheduler)
    row = step_cost.time_steps(engine, 2, "forecast", 4, 5, prompt_len=16, warm_steps=2)
    assert row["step"] == "forecast" and row["forecast_share"] == 1.0 and row["wall_ms"] > 0


def test_host_phases_of_each_step(tmp_path, tiny_shape):
    """Under lab.suite_host_phases each row has the host's microseconds per step by phase,
    between the core's step events: every step's launch, read and commit."""
    from lab.suite_host_phases import host_phases_timed
    with host_phases_timed():
        rows = step_cost.main(["--shape", tiny_shape, "--algorithm", "EAGLE3", "--num-steps", "2", "--draft-vocab", "1024",
                               "--batch-sizes", "1", "--steps", "3", "--warm-steps", "1", "--prompt-len", "16", "--device", "cpu",
                               "--model-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    for row in rows:
        phases = row["host_us"]
        assert phases["step"] >= phases["host"] > 0 and phases["commit"] > 0
        assert phases["launch"] > 0 and phases["read"] > 0
        assert phases["step"] >= phases["schedule"] + phases["launch"] + phases["read"] + phases["commit"]
    assert {r["step"] for r in rows} >= {"plain", "verify", "fused"}


def test_split_of_a_fused_step_is_the_difference_of_its_references():
    def row(step, capture, wall, gpu):
        return {"kind": "step_cost", "shape": "s", "batch_size": 8, "step": step, "draft_size": 4,
                "hidden_capture": capture, "wall_ms": wall, "graph_gpu_ms": gpu, "host_not_hidden_ms": wall - gpu}
    rows = [row("plain", False, 1.6, 1.4), row("verify", False, 3.0, 2.8), row("plain", True, 1.7, 1.5),
            row("verify", True, 3.2, 3.0), row("fused", True, 5.0, 4.2)]
    [split] = step_cost.step_split(rows)
    assert split["batch_size"] == 8 and split["fused_wall_ms"] == 5.0
    assert split["target_verify_gpu_ms"] == 2.8
    assert split["hidden_capture_gpu_ms"] == pytest.approx(0.2)
    assert split["head_and_verification_gpu_ms"] == pytest.approx(1.2)
    assert split["host_not_hidden_ms"] == pytest.approx(0.8)
    assert step_cost.step_split(rows[2:]) == []   # no verify without capture: no split


def test_bad_num_steps_is_refused(capsys):
    with pytest.raises(SystemExit):
        step_cost.main(["--algorithm", "EAGLE3", "--num-steps", "0"])
    assert "--num-steps" in capsys.readouterr().err


def test_fused_step_ops_are_counted_by_the_line_that_issued_them(tiny_shape, capsys):
    from lab import fused_step_ops
    by_line = fused_step_ops.main(["--shape", tiny_shape, "--device", "cpu", "--draft-vocab", "1024", "--top", "3"])
    lines = list(by_line)
    assert any("model_drafters/fused_step.py" in line and "write_head_table" in line for line in lines)
    assert any("model_drafters/draft_chain.py" in line for line in lines)
    assert "?" not in by_line and all(count > 0 for count in by_line.values())
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"ops per step: {sum(by_line.values()):.0f}" and len(printed) == 4


def test_sampled_rows_run_every_step_sampled_and_fused(tmp_path, tiny_shape):
    """--temperature: every request sampled; the fused step still runs fused (its verification
    by the sampled rule), and the rows say what they sampled at."""
    rows = step_cost.main(["--shape", tiny_shape, "--algorithm", "EAGLE3", "--num-steps", "2", "--draft-vocab", "1024",
                           "--batch-sizes", "2", "--steps", "3", "--warm-steps", "1", "--prompt-len", "16",
                           "--device", "cpu", "--temperature", "0.7", "--top-p", "0.9",
                           "--model-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert [(r["engine"], r["step"]) for r in rows] == [("NGRAM", "plain"), ("NGRAM", "verify"),
                                                         ("EAGLE3", "plain"), ("EAGLE3", "verify"), ("EAGLE3", "fused")]
    assert all((r["temperature"], r["top_p"]) == (0.7, 0.9) for r in rows)
    assert [r["verification"] for r in rows] == ["coupled"] * 4 + ["rejection"]   # the fused chain's sampled drafts
    assert next(r for r in rows if r["step"] == "fused")["fused_share"] == 1.0


def test_fused_tree_rows_on_the_cpu(tmp_path, tiny_shape):
    """--topk 2 --tree-nodes 6: the fused step is EAGLE-2's tree, verified against a verify of
    6 nodes, every timed step fused."""
    rows = step_cost.main(["--shape", tiny_shape, "--algorithm", "EAGLE3", "--num-steps", "3", "--topk", "2",
                           "--tree-nodes", "6", "--draft-vocab", "1024", "--batch-sizes", "2", "--steps", "3",
                           "--warm-steps", "1", "--prompt-len", "16", "--device", "cpu",
                           "--model-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert [(r["engine"], r["step"], r["draft_size"]) for r in rows] == [
        ("NGRAM", "plain", 1), ("NGRAM", "verify", 6), ("EAGLE3", "plain", 1), ("EAGLE3", "verify", 6),
        ("EAGLE3", "fused", 6)]
    assert next(r for r in rows if r["step"] == "fused")["fused_share"] == 1.0
    with pytest.raises(SystemExit):
        step_cost.main(["--shape", tiny_shape, "--algorithm", "EAGLE3", "--topk", "2", "--tree-nodes", "3"])
