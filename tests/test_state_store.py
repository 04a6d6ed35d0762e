"""The EAGLE trainer's store of the target's states: float8 rows come back within e4m3's
rounding, each layer's slice scaled on its own; a run on a float8 store trains like one on
the model's dtype; with room for every batch, the target computes each batch once (the
first epoch) and never again; with room for some, the others are computed each time; the
automatic dtype falls back to float8 where the model's would not hold every batch; the
summary line names the tokens kept and their dtype."""
from __future__ import annotations

import pytest
import torch

from lab import eagle_train_host
from specserve.speculative.heads.fp8_rows import FP8
from specserve.training import eagle_training_run, state_store
from specserve.training.state_store import StateStore, StoredRows, make_state_store, state_bytes
from specserve.training.target_features import TargetFeatureExtractor

E4M3_MANTISSA_BITS = 3
E4M3_SMALLEST_SUBNORMAL = 2.0 ** -9   # in units of the scale: values below 2 ** -6 have fewer mantissa bits
E4M3_MAX = 448.0


def assert_within_e4m3_rounding(got: torch.Tensor, want: torch.Tensor, segments: int) -> None:
    """|got - want| at most half a unit of the last place: 2 ** -4 relative for a normal e4m3
    number, half the smallest subnormal step (times the slice's scale) below; each slice's
    largest magnitude kept exactly (up to float32's own rounding of the scale)."""
    rows = want.shape[0]
    want_slices, got_slices = want.float().view(rows * segments, -1), got.float().view(rows * segments, -1)
    scale = want_slices.abs().amax(1, keepdim=True) / E4M3_MAX
    bound = want_slices.abs() * 2.0 ** -(E4M3_MANTISSA_BITS + 1) + scale * E4M3_SMALLEST_SUBNORMAL / 2
    error = (got_slices - want_slices).abs()
    assert bool((error <= bound * (1 + 1e-5) + 1e-30).all()), float((error - bound).max())
    torch.testing.assert_close(got_slices.abs().amax(1), want_slices.abs().amax(1), rtol=1e-6, atol=0)
    assert float(error.max()) > 0   # it did round: float8, not a copy


def test_float8_rows_come_back_within_e4m3_rounding_each_slice_scaled_alone():
    generator = torch.Generator().manual_seed(0)
    # three layers' states side by side, magnitudes 1e-3, 1 and 1e3 (a row scale shared by the
    # three would leave the first slice in e4m3's subnormals, most of its values zero)
    values = torch.randn(50, 3, 64, generator=generator) * torch.tensor([1e-3, 1.0, 1e3]).view(1, 3, 1)
    values = values.view(50, 192)
    rows = StoredRows(80, 192, FP8, torch.float32, torch.device("cpu"), segments=3)
    rows.write(30, values)
    assert rows.data.dtype == torch.uint8 and rows.scale.shape == (80, 3)
    back = rows.gather(torch.arange(30, 80))
    assert back.dtype == torch.float32 and back.shape == values.shape
    assert_within_e4m3_rounding(back, values, segments=3)
    shuffled = torch.randperm(50, generator=generator)
    torch.testing.assert_close(rows.gather(30 + shuffled), back[shuffled], rtol=0, atol=0)


def test_rows_kept_in_a_float_dtype_come_back_as_they_were():
    values = torch.randn(10, 8, dtype=torch.bfloat16)
    rows = StoredRows(10, 8, torch.bfloat16, torch.float32, torch.device("cpu"))
    rows.write(0, values)
    assert rows.scale is None and torch.equal(rows.gather(torch.arange(10)), values.float())


@pytest.fixture(scope="module")
def conversations():
    return eagle_train_host.synthetic_conversations(24, (20, 120), 0.25, eagle_train_host.TINY_TARGET["vocab_size"],
                                                    seed=1)


def total_tokens(trainer) -> int:
    return sum(len(c.tokens) for c in trainer.conversations)


def trainer_with_store(conversations, dtype: torch.dtype | None, epochs: int = 2):
    """The tiny fp32 trainer of test_eagle_train_host, its store made again as `dtype`."""
    trainer = eagle_train_host.tiny_trainer(conversations, 512, 3, epochs=epochs, autocast=False)
    trainer.store = make_state_store(trainer.builder.extractor, total_tokens(trainer), dtype)
    return trainer


class CountingExtractor:
    """Counts the target's forwards (TargetFeatureExtractor calls) while it is patched in."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = TargetFeatureExtractor.__call__

        def counting(extractor, *args, **kwargs):
            self.calls += 1
            return original(extractor, *args, **kwargs)
        monkeypatch.setattr(TargetFeatureExtractor, "__call__", counting)


def test_the_target_states_kept_as_float8_are_the_computed_ones_within_e4m3_rounding(conversations):
    trainer = trainer_with_store(conversations, FP8)
    store, extractor = trainer.store, trainer.builder.extractor
    store.fill(extractor, [c.tokens for c in trainer.conversations], trainer.plan)
    assert store.used == total_tokens(trainer) and store.covers(range(len(conversations)))
    for index in (0, 5, len(conversations) - 1):
        alone = extractor([conversations[index].tokens])
        rows = torch.arange(store.starts[index], store.starts[index] + len(conversations[index].tokens))
        assert_within_e4m3_rounding(store.layers.gather(rows), alone.layers, segments=len(extractor.aux_layers))
        assert_within_e4m3_rounding(store.final.gather(rows), alone.final, segments=1)
    assert store.nbytes == state_bytes(extractor, total_tokens(trainer), FP8)
    assert store.nbytes < 0.3 * state_bytes(extractor, total_tokens(trainer), torch.float32)


def test_with_room_for_every_batch_the_target_computes_each_once(conversations, monkeypatch):
    counter = CountingExtractor(monkeypatch)
    trainer = trainer_with_store(conversations, FP8, epochs=3)
    epoch = len(trainer.plan) // 3
    steps = []
    trainer.train(lambda step, loss, accuracies: steps.append(counter.calls))
    assert steps[epoch - 1] == epoch and steps[-1] == epoch and trainer.target_forwards == epoch
    assert trainer.store.covers(range(len(conversations)))


def test_a_float8_store_trains_like_one_of_the_model_dtype(conversations):
    """The first epoch trains on the states as computed (alike); the second on float8 ones,
    whose rounding (at most 1/16 of an element, zero-mean, independent across the elements of
    a row and the ~2,000 rows a loss averages) moves the losses by 3e-5 of their value here.
    The bound, 5e-4, is a sixteenth of what the ten steps of training move the loss (0.8%):
    a store that changed training more than that would fail it."""
    exact = trainer_with_store(conversations, torch.float32)
    exact.train()
    rounded = trainer_with_store(conversations, FP8)
    rounded.train()
    epoch = len(exact.plan) // 2
    exact_losses, rounded_losses = torch.tensor(exact.history), torch.tensor(rounded.history)
    torch.testing.assert_close(rounded_losses[:epoch], exact_losses[:epoch], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rounded_losses[epoch:], exact_losses[epoch:], rtol=5e-4, atol=0)
    assert not torch.equal(rounded_losses[epoch:], exact_losses[epoch:])   # the second epoch read float8


def test_a_store_too_small_for_every_batch_still_trains_computing_the_rest(conversations, monkeypatch):
    total = sum(len(c.tokens) for c in conversations)
    monkeypatch.setattr(state_store, "device_token_budget", lambda extractor, dtype, share: total // 3)
    counter = CountingExtractor(monkeypatch)
    trainer = eagle_train_host.tiny_trainer(conversations, 512, 3, epochs=2, autocast=False)
    assert trainer.store.dtype == FP8 and trainer.store.capacity == total // 3   # auto: float32 would not hold all
    trainer.train()
    epoch = len(trainer.plan) // 2
    kept = [group for group in trainer.plan[:epoch] if trainer.store.covers(group)]
    assert 0 < len(kept) < epoch and trainer.store.used <= total // 3
    assert counter.calls == trainer.target_forwards == 2 * epoch - len(kept)
    assert len(trainer.history) == 2 * epoch and all(loss == loss for loss in trainer.history)


def test_auto_keeps_the_model_dtype_where_every_batch_fits_else_float8(conversations, monkeypatch):
    trainer = eagle_train_host.tiny_trainer(conversations, 512, 3, autocast=False)
    extractor, total = trainer.builder.extractor, total_tokens(trainer)
    assert trainer.store.dtype == torch.float32 and trainer.store.capacity == total   # a CPU: no bound
    room = state_bytes(extractor, total, FP8)   # bytes for every token as float8, not as float32
    monkeypatch.setattr(state_store, "device_token_budget",
                        lambda extractor, dtype, share: room // state_bytes(extractor, 1, dtype))
    store = make_state_store(extractor, total)
    assert store.dtype == FP8 and store.capacity == total
    assert make_state_store(extractor, total, torch.float32).capacity < total // 3
    monkeypatch.setattr(state_store, "device_token_budget", lambda extractor, dtype, share: 0)
    assert make_state_store(extractor, total) is None
    with pytest.raises(ValueError, match="share"):
        make_state_store(extractor, total, share=1.5)


def test_the_summary_line_says_what_is_kept_and_in_which_dtype(conversations, capsys):
    trainer = trainer_with_store(conversations, FP8)
    trainer.train()
    eagle_training_run._report_state_store(trainer, "kept")
    line = capsys.readouterr().out
    assert f"target states: {total_tokens(trainer)} of {total_tokens(trainer)} tokens kept as float8 e4m3" in line
    assert f"{len(trainer.plan) // 2} batches' states computed by the target" in line


def test_train_eagle_refuses_a_state_share_outside_0_1():
    from specserve.train_eagle import parse_args
    assert parse_args(["--output-dir", "x", "--state-dtype", "float8"]).state_dtype == "float8"
    with pytest.raises(SystemExit):
        parse_args(["--output-dir", "x", "--state-memory-share", "0"])


def test_a_store_keeps_nothing_it_has_no_room_for(conversations):
    trainer = eagle_train_host.tiny_trainer(conversations, 512, 3, autocast=False)
    extractor = trainer.builder.extractor
    store = StateStore(extractor, 10, FP8)
    states = extractor([conversations[0].tokens])
    assert not store.keep([0], [len(conversations[0].tokens)], states) and store.used == 0 and not store.covers([0])
