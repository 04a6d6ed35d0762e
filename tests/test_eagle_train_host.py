"""The EAGLE trainer's host work (lab/eagle_train_host.py) and its training math: a fixed-seed
tiny run gives the losses, accuracies and final weights recorded from the trainer before its
batch building and step were reworked for host time; the per-batch states path trains alike;
a step makes the device wait once (its loss read), and the op counter sees a sync when a
step has one."""
from __future__ import annotations

import pytest
import torch
from torch.utils.weak import WeakTensorKeyDictionary

from lab import eagle_train_host

# recorded from the trainer at commit 052605c (before the rework), fp32 and bf16 autocast:
# 24 synthetic conversations of 20-120 tokens (a quarter multi-reply fixed text), 512-token
# batches, 3 draft steps, 2 epochs (10 optimizer steps)
REFERENCE = {
    False: dict(
        history=[13.961936, 13.92491, 13.909136, 13.930824, 13.879452, 13.865521, 13.852981, 13.843289,
                 13.85109, 13.849697],
        accuracies=[[0.0, 0.0, 0.0], [0.003906, 0.003906, 0.0], [0.004444, 0.0, 0.004444], [0.0, 0.0, 0.0],
                    [0.006873, 0.0, 0.003436], [0.0, 0.0, 0.0], [0.0, 0.003436, 0.003436], [0.0, 0.0, 0.0],
                    [0.004444, 0.004444, 0.004444], [0.0, 0.003906, 0.0]],
        fingerprint={'fc.weight': -1.731969, 'midlayer.input_layernorm.weight': -5.203298,
                     'midlayer.hidden_norm.weight': -6.998911, 'midlayer.self_attn.q_proj.weight': -0.716263,
                     'midlayer.self_attn.k_proj.weight': 2.857312, 'midlayer.self_attn.v_proj.weight': -4.395141,
                     'midlayer.self_attn.o_proj.weight': -0.032382, 'midlayer.post_attention_layernorm.weight': -5.89026,
                     'midlayer.mlp.gate_proj.weight': -1.828945, 'midlayer.mlp.up_proj.weight': 5.717912,
                     'midlayer.mlp.down_proj.weight': 0.164428, 'norm.weight': 3.519919, 'lm_head.weight': 4.584455}),
    True: dict(
        history=[13.962082, 13.924854, 13.909767, 13.932154, 13.879954, 13.865205, 13.852139, 13.842558,
                 13.850397, 13.849007],
        accuracies=None,    # bf16 argmax ties may fall either way on another CPU
        fingerprint={'fc.weight': -1.733708, 'midlayer.input_layernorm.weight': -5.203526,
                     'midlayer.hidden_norm.weight': -6.999026, 'midlayer.self_attn.q_proj.weight': -0.72042,
                     'midlayer.self_attn.k_proj.weight': 2.859927, 'midlayer.self_attn.v_proj.weight': -4.396307,
                     'midlayer.self_attn.o_proj.weight': -0.031416, 'midlayer.post_attention_layernorm.weight': -5.890225,
                     'midlayer.mlp.gate_proj.weight': -1.831874, 'midlayer.mlp.up_proj.weight': 5.720747,
                     'midlayer.mlp.down_proj.weight': 0.163945, 'norm.weight': 3.519921, 'lm_head.weight': 4.585552}),
}


@pytest.fixture(scope="module")
def conversations():
    return eagle_train_host.synthetic_conversations(24, (20, 120), 0.25, eagle_train_host.TINY_TARGET["vocab_size"],
                                                    seed=1)


def fingerprint(head: torch.nn.Module) -> dict[str, float]:
    """Per trained tensor, its dot product with fixed random weights: moves with any change of a value."""
    generator = torch.Generator().manual_seed(0)
    return {name: float((value.double() * torch.randn(value.shape, generator=generator, dtype=torch.float64)).sum())
            for name, value in head.state_dict().items() if value.dtype.is_floating_point and name != "embed_tokens.weight"}


def train(conversations, autocast: bool, stored: bool = True):
    trainer = eagle_train_host.tiny_trainer(conversations, 512, 3, epochs=2, autocast=autocast)
    if not stored:
        trainer.store = None
    accuracies = []
    trainer.train(lambda step, loss, step_accuracies: accuracies.append(step_accuracies))
    return trainer, accuracies


@pytest.mark.parametrize("autocast", [False, True])
def test_a_fixed_seed_run_trains_as_before_the_rework(conversations, autocast):
    trainer, accuracies = train(conversations, autocast)
    want = REFERENCE[autocast]
    tolerance = dict(rtol=2e-3, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(trainer.history), torch.tensor(want["history"]), **tolerance)
    if want["accuracies"] is not None:
        torch.testing.assert_close(torch.tensor(accuracies), torch.tensor(want["accuracies"]), rtol=0, atol=1e-6)
    got = fingerprint(trainer.head)
    assert got.keys() == want["fingerprint"].keys()
    for name, value in want["fingerprint"].items():
        assert got[name] == pytest.approx(value, rel=tolerance["rtol"], abs=tolerance["atol"]), name


def test_batches_whose_states_are_computed_per_step_train_alike(conversations):
    stored, _ = train(conversations, autocast=False)
    live, _ = train(conversations, autocast=False, stored=False)
    torch.testing.assert_close(torch.tensor(live.history), torch.tensor(stored.history), rtol=1e-6, atol=1e-6)
    for name, value in fingerprint(stored.head).items():
        assert fingerprint(live.head)[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name


def test_a_training_step_waits_for_the_device_once(conversations):
    trainer = eagle_train_host.tiny_trainer(conversations, 512, 3, autocast=False)
    counts = eagle_train_host.count_ops(trainer, steps=2)
    assert counts["sync_sites"] == {} and counts["syncs_per_step"] == 1, counts["sync_sites"]
    assert counts["device_ops_per_step"] > 100 and counts["host_ops_per_step"] > 0


def test_the_op_counter_sees_a_sync_on_a_device_tensor_only():
    on_device, on_host = torch.arange(6.0), torch.arange(6.0)
    device_tensors = WeakTensorKeyDictionary()
    device_tensors[on_device] = True
    counter = eagle_train_host.OpCounter(device_tensors)
    with counter:
        on_host[on_host > 2].sum().item()          # host work: no GPU would wait for it
        doubled = on_device * 2                    # a device op: its output lives on the device too
        doubled[doubled > 2].sum()                 # boolean indexing: a sync
        doubled.max().item()                       # a sync
    assert sum(counter.syncs.values()) == 2, counter.syncs
    assert counter.device_ops["mul.Tensor"] == 1 and counter.host_ops["gt.Scalar"] == 1
