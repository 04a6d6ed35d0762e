"""MTP through the Engine: an MTP layer (DeepSeek's NextN layout, a dense Qwen2 layer) drafts
one token per step in the fused chain. Every draft the engine proposes is the argmax of a
reference written with transformers' own decoder layer over the whole sequence (eh_proj on
concat(enorm(embedding of token r + 1), hnorm(target's final state at r)), the layer, the
head norm, the lm_head), so the fused step feeds the layer the right rows, states, tokens and
positions after accepted and rejected drafts; greedy output equals plain decoding; every
target and head slot comes back; the layout is read and written as models ship it.

A head that copies a one-layer target's layer (eh_proj passing the embedding through, the
target's norm and lm_head borrowed) predicts the target well (its context lacks only the
first token), so drafts are accepted and rejected; a random head owning its norm, lm_head
and embedding covers the parts a checkpoint may ship.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from specserve.errors import ArgumentError
from specserve.speculative.heads.mtp_checkpoint import read_mtp_head, save_mtp_head
from tests.fused_fixtures import FusedSpy, fused_args, save_random_mtp_head, wait_until_fused_state_is_free
from tests.spec_fixtures import TINY, plain_greedy_outputs, save_bpe_tokenizer, tiny_engine

PROMPTS = [[5, 6, 7, 8, 9] * 6 + [10, 11], [20, 21, 22, 23] * 5, list(range(30, 72)), [100, 101] * 9, [7, 3]]
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A one-layer Qwen2 target whose embedding rows have RMS 1 (so enorm passes them as they are)."""
    path = tmp_path_factory.mktemp("mtp-target")
    config = transformers.Qwen2Config(**{**TINY, "num_hidden_layers": 1}, vocab_size=256, tie_word_embeddings=False)
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
        embedding = model.model.embed_tokens.weight
        embedding.div_(embedding.pow(2).mean(-1, keepdim=True).sqrt())
    model.save_pretrained(path)
    save_bpe_tokenizer(str(path))
    return path


@pytest.fixture(scope="module")
def copy_head(target_dir, tmp_path_factory) -> str:
    """The target's layer as an MTP layer, written by hand in the NextN layout (model.layers.1.*,
    no shared_head: the target's norm and lm_head)."""
    path = tmp_path_factory.mktemp("mtp-copy")
    with open(target_dir / "config.json") as f:
        config = json.load(f)
    json.dump({**config, "architectures": ["Qwen2ForCausalLMNextN"], "num_nextn_predict_layers": 1},
              open(path / "config.json", "w"))
    target = load_file(str(target_dir / "model.safetensors"))
    hidden = config["hidden_size"]
    tensors = {name.replace("model.layers.0.", "model.layers.1."): tensor for name, tensor in target.items()
               if name.startswith("model.layers.0.")}
    tensors |= {"model.layers.1.enorm.weight": torch.ones(hidden), "model.layers.1.hnorm.weight": torch.ones(hidden),
                "model.layers.1.eh_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)}
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def owned_head(target_dir, tmp_path_factory) -> str:
    """A random layer with its own head norm, lm_head and embedding (our saver's layout)."""
    path = tmp_path_factory.mktemp("mtp-owned")
    save_random_mtp_head(target_dir, path, own_norm=True, own_lm_head=True, own_embedding=True)
    return str(path)


def reference_drafts(target_dir, head_dir: str, tokens: list[int]) -> torch.Tensor:
    """(len(tokens) - 1,): the MTP layer's argmax at row r, its draft for position r + 2,
    computed with transformers' Qwen2 layer from the checkpoint's tensors."""
    target = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    config = target.config
    mtp = {name.removeprefix(f"model.layers.{config.num_hidden_layers}."): tensor
           for name, tensor in load_file(os.path.join(head_dir, "model.safetensors")).items()}
    ids = torch.tensor(tokens)

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)

    with torch.no_grad():
        states = target.model(ids[None]).last_hidden_state[0]                              # final-normed
        embedding = mtp.get("embed_tokens.weight", target.model.embed_tokens.weight)
        x = torch.cat([rms(embedding[ids[1:]], mtp["enorm.weight"]), rms(states[:-1], mtp["hnorm.weight"])], -1)
        x = x @ mtp["eh_proj.weight"].T
        layer = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        layer.load_state_dict({
            **{f"model.layers.0.{name}": t for name, t in mtp.items() if name.split(".")[0] in ("self_attn", "mlp")
               or name.endswith("layernorm.weight")},
            "model.norm.weight": mtp.get("shared_head.norm.weight", target.model.norm.weight),
            "lm_head.weight": mtp.get("shared_head.head.weight", target.lm_head.weight),
            "model.embed_tokens.weight": target.model.embed_tokens.weight})
        return layer(inputs_embeds=x[None]).logits[0].argmax(-1)


class DraftSpy:
    """Every draft the drafter proposes, with the request's tokens at the time."""

    def __init__(self, drafter):
        self.drafts: list[tuple[tuple[int, ...], int, int]] = []   # (prompt, tokens so far, draft)
        propose = drafter.propose

        def spy(reqs, max_nodes):
            proposal, num_nodes = propose(reqs, max_nodes)
            for row, (req, count) in enumerate(zip(reqs, num_nodes)):
                if count == 2:
                    self.drafts.append((tuple(req.prompt_ids), req.num_tokens, int(proposal.tokens[row, 1])))
            return proposal, num_nodes
        drafter.propose = spy


@pytest.mark.parametrize("head", ["copy_head", "owned_head"])
@pytest.mark.parametrize("max_running", [1, 4])
def test_drafts_are_the_reference_layers_argmax(target_dir, request, head, max_running):
    head_dir = request.getfixturevalue(head)
    expected = plain_greedy_outputs(target_dir, PROMPTS, GREEDY)
    with tiny_engine(target_dir, max_running_requests=max_running, **fused_args("MTP", head_dir)) as engine:
        fused, drafts = FusedSpy(engine.core.drafter), DraftSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == expected
        wait_until_fused_state_is_free(engine)
    assert fused.engine == 0 and fused.fused == sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
    references = {tuple(p): reference_drafts(target_dir, head_dir, p + e) for p, e in zip(PROMPTS, expected)}
    assert len(drafts.drafts) >= fused.fused - len(PROMPTS)     # a request's last step may have room for its root only
    wrong = [(length, draft) for prompt, length, draft in drafts.drafts if references[prompt][length - 2] != draft]
    assert not wrong, f"{len(wrong)} of {len(drafts.drafts)} drafts differ from the reference"
    histogram = Counter()
    for output in outputs:
        histogram.update(output["meta_info"]["spec_accept_histogram"])
    if head == "copy_head":
        assert histogram[2] > histogram[1] > 0, histogram     # accepted and rejected drafts both


def test_steps_chained_on_the_device_keep_greedy_output(target_dir, copy_head):
    """With the steps launched ahead of a GPU engine (forced on here), each MTP step is
    queued before the one it follows is read, its draft taken from that step's outcome on
    the device (engine/draft_ahead.py): plain decoding's output, every step fused, all freed."""
    from tests.test_draft_ahead import ahead_on

    expected = plain_greedy_outputs(target_dir, PROMPTS, GREEDY)
    with tiny_engine(target_dir, max_running_requests=4, **fused_args("MTP", copy_head)) as engine:
        ahead_on(engine)
        fused = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == expected
        wait_until_fused_state_is_free(engine)
    assert fused.engine == 0 and fused.fused == sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
    assert fused.chained > 0


def test_preemption_abort_and_sampling_free_everything(target_dir, copy_head):
    prompts, seeded = PROMPTS[:4], {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
    seeded_params = [{**seeded, "seed": 7 + i} for i in range(len(prompts))]
    expected = plain_greedy_outputs(target_dir, prompts, GREEDY)
    expected_seeded = plain_greedy_outputs(target_dir, prompts, seeded_params)
    with tiny_engine(target_dir, max_total_tokens=140, **fused_args("MTP", copy_head)) as engine:
        outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == expected
        assert sum(o["meta_info"]["preemptions"] for o in outputs) > 0
        stream = engine.generate(input_ids=prompts[1], sampling_params={**GREEDY, "max_new_tokens": 60}, stream=True)
        next(iter(stream))
        stream.close()     # aborts it
        assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=seeded_params)] \
            == expected_seeded
        sampled = engine.generate(input_ids=prompts, sampling_params={**seeded, "top_p": 0.9})
        assert [len(o["output_ids"]) for o in sampled] == [16] * len(prompts)
        wait_until_fused_state_is_free(engine)


# ---- the checkpoint layout ----
def test_saved_and_read_in_the_nextn_layout(target_dir, owned_head, tmp_path):
    head = read_mtp_head(owned_head)
    with open(os.path.join(owned_head, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen2ForCausalLMNextN"] and config["num_hidden_layers"] == 1
    names = set(load_file(os.path.join(owned_head, "model.safetensors")))
    assert {"model.layers.1.eh_proj.weight", "model.layers.1.enorm.weight", "model.layers.1.shared_head.head.weight",
            "model.layers.1.self_attn.q_proj.bias", "model.layers.1.mlp.gate_proj.weight",
            "model.layers.1.embed_tokens.weight"} <= names
    save_mtp_head(head, str(tmp_path / "again"))
    again = read_mtp_head(str(tmp_path / "again"))
    assert head.state_dict().keys() == again.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))


def test_the_layer_is_read_from_a_sharded_target_directory(target_dir, copy_head, tmp_path):
    """A target that ships its MTP layer: only model.layers.{N}.* of the shards is read."""
    target = load_file(str(target_dir / "model.safetensors"))
    layer = load_file(os.path.join(copy_head, "model.safetensors"))
    save_file(target, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(layer, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {name: "model-00001-of-00002.safetensors" for name in target} | \
            {name: "model-00002-of-00002.safetensors" for name in layer}
    json.dump({"weight_map": index}, open(tmp_path / "model.safetensors.index.json", "w"))
    with open(target_dir / "config.json") as f:
        json.dump(json.load(f), open(tmp_path / "config.json", "w"))     # the target's own architectures
    head, reference = read_mtp_head(str(tmp_path)), read_mtp_head(copy_head)
    assert head.norm is None and head.lm_head is None and head.embed_tokens is None     # the target's, later
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), reference.state_dict().values()))


def test_unsupported_layouts_are_named(target_dir, copy_head, tmp_path):
    config = json.load(open(target_dir / "config.json"))
    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    json.dump({**config, "architectures": ["DeepseekV3ForCausalLMNextN"], "model_type": "deepseek_v3"},
              open(deepseek / "config.json", "w"))
    with pytest.raises(ArgumentError, match="speculative_draft_model_path.*dense"):
        tiny_engine(target_dir, **fused_args("MTP", deepseek))
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    json.dump({**config, "architectures": ["Qwen2ForCausalLMNextN"]}, open(incomplete / "config.json", "w"))
    tensors = load_file(os.path.join(copy_head, "model.safetensors"))
    del tensors["model.layers.1.hnorm.weight"]
    save_file(tensors, str(incomplete / "model.safetensors"))
    with pytest.raises(ArgumentError, match="hnorm.weight"):
        tiny_engine(target_dir, **fused_args("MTP", incomplete))
    with pytest.raises(ArgumentError, match="speculative_eagle_topk"):
        tiny_engine(target_dir, **fused_args("MTP", copy_head, speculative_eagle_topk=4))
