"""Heads kept in the repository: float8 rows (one scale per row) round-trip within e4m3's
rounding and leave vectors and vocabulary maps exact; a head saved that way loads, drafts
as the fp32 head does, and converts back to plain bf16 safetensors; `train_eagle` trains a
head of its own MLP width and goes on training a saved head (--init-from) from where it ended; every
head kept under heads/ loads whole."""
from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch

from specserve.speculative.heads.eagle_checkpoint import convert_head, load_head, read_weights, save_head
from specserve.speculative.heads.fp8_rows import FP8, SCALE_SUFFIX, dequantize_rows, quantize_rows
from tests.spec_fixtures import make_tiny_directory
from tests.test_eagle_head import draft_logits, random_head, tiny_config


def test_rows_round_trip_within_e4m3_rounding():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 40, generator=generator) * torch.logspace(-3, 2, 16).unsqueeze(1)  # rows of every scale
    state = {"w": weight, "norm": torch.rand(40), "ids": torch.arange(5)}
    stored = quantize_rows(state)
    assert stored["w"].dtype == FP8 and stored["w" + SCALE_SUFFIX].shape == (16, 1)
    assert stored["norm"] is state["norm"] and stored["ids"] is state["ids"]
    back = dequantize_rows(stored)
    assert set(back) == set(state)
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself, or of the row's largest / 2^9 near zero
    bound = weight.abs() / 16 + weight.abs().amax(dim=1, keepdim=True) / 2 ** 9
    assert bool(((back["w"] - weight).abs() <= bound).all())
    assert torch.equal(back["norm"], state["norm"]) and torch.equal(back["ids"], state["ids"])


def test_a_float8_weight_without_its_scale_is_refused():
    stored = quantize_rows({"w": torch.randn(4, 4)})
    del stored["w" + SCALE_SUFFIX]
    with pytest.raises(ValueError, match="w_scale"):
        dequantize_rows(stored)


def test_a_float8_head_loads_drafts_alike_and_converts_to_bf16(tmp_path):
    head = random_head(tiny_config())
    save_head(head, str(tmp_path / "kept"), fp8=True)
    config = json.loads((tmp_path / "kept" / "config.json").read_text())
    assert config["weight_format"] == "float8_e4m3 rows" and config["torch_dtype"] == "bfloat16"
    loaded = load_head(str(tmp_path / "kept"))
    loaded.share_embedding(head.embed_tokens.weight)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    states = torch.randn(8, head.config.feature_size, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, head.config.vocab_size, (8,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = draft_logits(head, states, tokens), draft_logits(loaded, states, tokens)
    assert not torch.equal(got, want)                       # the weights were rounded ...
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # ... by little

    convert_head(str(tmp_path / "kept"), str(tmp_path / "plain"))
    plain = read_weights(str(tmp_path / "plain"))
    assert not any(name.endswith(SCALE_SUFFIX) for name in plain)
    assert {tensor.dtype for name, tensor in plain.items() if name not in ("d2t", "t2d")} == {torch.bfloat16}
    assert "weight_format" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def _accept_lengths(printed: str) -> tuple[float, float]:
    before = float(re.search(r"accept length before training: ([\d.]+)", printed).group(1))
    after = float(re.search(r"held-out accept length: ([\d.]+)", printed).group(1))
    return before, after


def test_train_eagle_trains_a_narrow_head_and_goes_on_from_a_saved_one(tmp_path, capsys):
    from specserve.train_eagle import main
    target = tmp_path / "target"
    make_tiny_directory(target, vocab_size=320, weight_std=None, logit_scale=100.0)   # the BPE tokenizer's ids fit
    common = ["--model-path", str(target), "--device", "cpu", "--num-prompts", "12", "--held-out", "4",
              "--max-prompt-len", "48", "--max-new-tokens", "12", "--epochs", "1", "--ttt-steps", "2",
              "--batch-tokens", "256", "--checkpoint-every", "0"]
    main(common + ["--output-dir", str(tmp_path / "first"), "--draft-vocab-size", "64", "--intermediate-size", "24"])
    _, first_after = _accept_lengths(capsys.readouterr().out)
    config = json.loads((tmp_path / "first" / "config.json").read_text())
    assert config["intermediate_size"] == 24 and config["draft_vocab_size"] == 64

    main(common + ["--output-dir", str(tmp_path / "second"), "--init-from", str(tmp_path / "first")])
    second_before, _ = _accept_lengths(capsys.readouterr().out)
    assert second_before == first_after       # the same held-out chats, scored by the saved head
    config = json.loads((tmp_path / "second" / "config.json").read_text())
    assert config["intermediate_size"] == 24 and config["draft_vocab_size"] == 64
    first, second = load_head(str(tmp_path / "first")), load_head(str(tmp_path / "second"))
    assert torch.equal(first.d2t, second.d2t)
    assert not torch.equal(first.fc.weight, second.fc.weight)   # and trained on


def test_init_from_and_resume_are_refused_together(tmp_path):
    from specserve.train_eagle import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--output-dir", str(tmp_path), "--init-from", str(tmp_path), "--resume"])


def test_a_resumed_run_trains_for_its_own_seconds(tmp_path):
    from specserve.train_eagle import main
    target = tmp_path / "target"
    make_tiny_directory(target, vocab_size=320, weight_std=None, logit_scale=100.0)
    argv = ["--model-path", str(target), "--device", "cpu", "--num-prompts", "12", "--held-out", "4",
            "--max-prompt-len", "48", "--max-new-tokens", "12", "--epochs", "4", "--ttt-steps", "2",
            "--batch-tokens", "128", "--draft-vocab-size", "64", "--checkpoint-every", "0",
            "--max-train-seconds", "1e-6", "--output-dir", str(tmp_path / "head")]
    state_file = tmp_path / "head" / "trainer_state.pt"
    main(argv)                       # out of time after its first step
    first = torch.load(state_file, weights_only=True)
    main(argv + ["--resume"])        # its own 1e-6 s: one step more, not none (the first run's seconds are spent)
    second = torch.load(state_file, weights_only=True)
    assert first["step"] == 1 and second["step"] == 2 and second["plan_size"] > 2


KEPT = sorted((pathlib.Path(__file__).parent.parent / "heads").glob("*/config.json"))


@pytest.mark.parametrize("config_path", KEPT, ids=[p.parent.name for p in KEPT])
def test_every_kept_head_loads_whole(config_path):
    """Each head under heads/ is complete: float8 rows with their scales, every weight its
    config's shape (load_head refuses any other), a draft vocabulary of distinct target ids."""
    head = load_head(str(config_path.parent))
    assert json.loads(config_path.read_text())["weight_format"] == "float8_e4m3 rows"
    vocab = head.draft_vocab()
    assert vocab.numel() == head.config.draft_vocab_size and bool((vocab[1:] > vocab[:-1]).all())
    assert all(bool(torch.isfinite(p).all()) for p in head.parameters())
    assert (config_path.parent / "README.md").is_file()


def test_heads_are_kept():
    assert KEPT, "heads/ holds no head"
