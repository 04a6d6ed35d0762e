"""`--load-format dummy`: a directory with only config.json and a tokenizer serves with random
weights made on the device (deterministic in --random-seed); the other load formats keep the
normal loader, checked against the path; a bad value names load_format."""
from __future__ import annotations

import math
import os

import pytest
import torch

from specserve.args import ServerArgs
from specserve.bench.random_model import SHAPES, write_model_config, write_random_model
from specserve.errors import ArgumentError, ModelFormatError, NotSupportedError
from specserve.model.loader import check_load_format, default_model_path, read_model_config
from specserve.model.parallel.sharding import ModelShard
from specserve.model.random_weights import RandomWeights
from tests.spec_fixtures import tiny_engine

# real shapes cut down to a CPU's size; the word-level tokenizer's 4038 ids stay below the vocab
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=False)
TINY_QWEN = dict(SHAPES["qwen2.5-7b"], **TINY)            # q/k/v biases
TINY_LLAMA = dict(SHAPES["llama-3.1-8b"], **TINY)         # llama3 rope scaling
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [[5, 17, 300, 42, 7], [1000, 2, 3], [64] * 9]


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory):
    return write_model_config(str(tmp_path_factory.mktemp("qwen-config-only")), TINY_QWEN)


def greedy_ids(engine, prompts=PROMPTS) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


def test_a_config_only_directory_serves_random_weights(config_only_dir):
    assert sorted(os.listdir(config_only_dir)) == ["chat_template.jinja", "config.json", "tokenizer.json",
                                                   "tokenizer_config.json"]   # no weights at all
    with tiny_engine(config_only_dir, load_format="dummy", max_total_tokens=512) as engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        text = engine.generate("w1 w2 w3", {**GREEDY, "max_new_tokens": 4})["text"]
        assert engine.get_server_info()["load_format"] == "dummy"
    for output in outputs:
        assert len(output["output_ids"]) == 12 and all(0 <= t < 4096 for t in output["output_ids"])
        logprobs = [entry[0] for entry in output["meta_info"]["output_token_logprobs"]]
        assert all(math.isfinite(lp) and lp < 0 for lp in logprobs)
    assert isinstance(text, str) and text


def test_the_same_seed_gives_the_same_weights_and_outputs(config_only_dir):
    config = read_model_config(config_only_dir)
    first, again = (RandomWeights(config, torch.float32, "cpu", seed=7) for _ in range(2))
    other_seed = RandomWeights(config, torch.float32, "cpu", seed=8)
    names = list(first)
    assert names == list(config.parameter_shapes())
    for name in reversed(names):    # read in another order: a tensor depends on its name and the seed only
        assert torch.equal(first[name], again[name])
        assert first[name].shape == config.parameter_shapes()[name]
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(first[q_proj], other_seed[q_proj])
    assert not torch.equal(first[q_proj], first["model.layers.0.self_attn.q_proj.weight"])
    assert abs(first["lm_head.weight"].std().item() - 0.02) < 0.001 and abs(first["lm_head.weight"].mean()) < 0.001
    assert all(torch.equal(first[n], torch.ones(first[n].shape)) for n in names if n.endswith("norm.weight"))
    assert RandomWeights(config, torch.bfloat16, "cpu")["model.embed_tokens.weight"].dtype == torch.bfloat16
    with tiny_engine(config_only_dir, load_format="dummy", random_seed=7) as a, \
            tiny_engine(config_only_dir, load_format="dummy", random_seed=7) as b, \
            tiny_engine(config_only_dir, load_format="dummy", random_seed=8) as c:
        assert greedy_ids(a) == greedy_ids(b) != greedy_ids(c)


def test_dummy_weights_are_the_checkpoint_that_write_random_model_writes(tmp_path):
    """The same values from a file (load_format auto and safetensors) and made at start-up (dummy)."""
    path = write_random_model(str(tmp_path / "llama"), TINY_LLAMA, dtype=torch.float32, device="cpu")
    with tiny_engine(path, load_format="dummy") as dummy:
        want = greedy_ids(dummy)
    for load_format in ("auto", "safetensors"):
        with tiny_engine(path, load_format=load_format) as engine:
            assert greedy_ids(engine) == want, load_format


def test_a_rank_cuts_its_part_out_of_the_whole_tensor(config_only_dir):
    config = read_model_config(config_only_dir)
    whole = RandomWeights(config, torch.float32, "cpu", seed=3)
    for rank in (0, 1):
        shard = ModelShard.for_rank(config, rank, 2)
        part = RandomWeights(config, torch.float32, "cpu", seed=3, shard=shard)
        assert part.shapes() == {name: shard.shape(name, shape) for name, shape in config.parameter_shapes().items()}
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
                     "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
            assert torch.equal(part[name], shard.select(name, whole[name]))
    assert whole.num_parameters() == sum(math.prod(s) for s in config.parameter_shapes().values())


def test_a_bad_load_format_names_the_field(config_only_dir, tmp_path):
    with pytest.raises(ArgumentError, match="load_format must be one of auto, safetensors, pt, gguf, dummy; "
                                            "got 'npcache'"):
        ServerArgs(load_format="npcache")
    import argparse
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args(["--load-format", "dummy"])).load_format == "dummy"
    with pytest.raises(SystemExit):
        parser.parse_args(["--load-format", "bitsandbytes"])
    # a format that does not match the path, before any weight is read
    with pytest.raises(ModelFormatError, match="load_format='gguf' needs a .gguf file"):
        tiny_engine(config_only_dir, load_format="gguf")
    with pytest.raises(ModelFormatError, match="load_format='dummy' needs a Hugging Face model directory"):
        tiny_engine(default_model_path(), load_format="dummy")
    check_load_format("gguf", default_model_path())
    for load_format in ("auto", "safetensors", "pt", "dummy"):
        check_load_format(load_format, config_only_dir)
    # the normal loader still wants weights: a config-only directory without dummy says so
    with pytest.raises(Exception, match="has no model.safetensors"):
        tiny_engine(config_only_dir)


def test_a_draft_model_loads_from_its_files_only():
    with pytest.raises(NotSupportedError, match="speculative_draft_load_format='dummy'"):
        ServerArgs(speculative_draft_load_format="dummy")


def test_tensor_parallel_ranks_make_their_part_of_the_same_weights(config_only_dir):
    """Each rank's process makes its shard (the worker's load path): two ranks answer as one."""
    with tiny_engine(config_only_dir, load_format="dummy", random_seed=5) as whole:
        want = greedy_ids(whole)
    with tiny_engine(config_only_dir, load_format="dummy", random_seed=5, tp_size=2) as split:
        assert greedy_ids(split) == want
