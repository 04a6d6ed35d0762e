"""bench_offline's warm-up prompts and several concurrencies in one engine."""
from __future__ import annotations

import json

from specserve.bench import offline
from specserve.bench.offline import main as offline_main


def write_sharegpt(path, count: int) -> None:
    conversations = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"Question {i}: list {i + 3} colours of the rainbow, one per line, please."},
        {"from": "gpt", "value": "Red\nOrange\nYellow\nGreen\nBlue\nIndigo\nViolet " * 3}]} for i in range(count)]
    path.write_text(json.dumps(conversations))


def test_warmup_prompts_are_untimed_and_each_concurrency_gets_a_row(smollm2_path, tmp_path, monkeypatch):
    dataset, rows = tmp_path / "sharegpt.json", tmp_path / "rows.jsonl"
    write_sharegpt(dataset, 12)
    sent = []   # (label, prompts) of every run, warm-ups included
    real_run_turn = offline.run_turn

    def recording_run_turn(engine, prompts, params, concurrency, label):
        sent.append((label, [tuple(p) for p in prompts]))
        return real_run_turn(engine, prompts, params, concurrency, label)

    monkeypatch.setattr(offline, "run_turn", recording_run_turn)
    summaries = offline_main(["--model-path", smollm2_path, "--device", "cpu", "--dtype", "float32",
                              "--dataset-path", str(dataset), "--num-prompts", "3", "--warmup-prompts", "2",
                              "--max-concurrency", "1", "3", "--output-len", "4", "--ignore-eos",
                              "--output-file", str(rows), "--log-level", "warning"])
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [row["concurrency"] for row in written] == [1, 3]
    assert all(row["requests"] == 3 and row["output_tokens"] == 12 and row["tp_size"] == 1 for row in written)
    assert [s["concurrency"] for s in summaries] == [1, 3]
    assert [(label, len(prompts)) for label, prompts in sent] == [
        ("warm-up at 1", 2), ("specserve turn 1", 3), ("warm-up at 3", 2), ("specserve turn 1", 3)]
    every_prompt = [p for _, prompts in sent for p in prompts]
    assert len(set(every_prompt)) == 10, "no prompt is sent twice"
