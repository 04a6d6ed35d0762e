"""gpu_suite's --configs: 'all', 'default' and configuration labels, parsed both ways."""
import argparse

import pytest

from specserve.bench.gpu_suite import (CONCURRENT_CONFIGS, DEFAULT_CONFIG, SPEC_CONFIGS, config_choice, config_label,
                                       default_config, parse_config, suite_configs)
from specserve.bench.report import DEFAULT_LABEL, default_label


def test_labels_parse_back_to_their_configuration():
    for spec in SPEC_CONFIGS + [(16, False, True), (2, True, False), (16, True, True, 2), (8, True, "held", 3)]:
        assert parse_config(config_label(spec)) == spec
    assert config_label((16, True, True, 2)) == "ngram-16-one-adaptive-forecast2"


@pytest.mark.parametrize("label", ["ngram-x-one", "ngram-8-wide", "eagle-8-one", "ngram-8-one-fast", "ngram",
                                   "ngram-8-one-forecast0", "ngram-8-one-forecastx", "ngram-8-forecast2"])
def test_a_malformed_label_is_refused_naming_the_flag(label):
    with pytest.raises(argparse.ArgumentTypeError, match="--configs"):
        config_choice(label)


def test_choices_expand_in_order_without_repeats():
    assert suite_configs(["default"], 1) == [DEFAULT_CONFIG]
    assert suite_configs(["all"], 1) == SPEC_CONFIGS
    assert suite_configs(["all"], 32) == CONCURRENT_CONFIGS
    assert suite_configs(["default", "ngram-16-multi-adaptive", "ngram-16-one-adaptive"], 8) == \
        [DEFAULT_CONFIG, (16, False, True)]   # the default is the 16-node adaptive chain


def test_the_default_is_what_default_flags_run_on_the_device():
    """On a GPU the forecast is on by default (--speculative-ngram-forecast unset), so the suite's
    "default" runs it there, and the report finds the default rows by the device row's label."""
    assert suite_configs(["default"], 8, "cuda") == [default_config("cuda")] == [DEFAULT_CONFIG + (2,)]
    assert suite_configs(["all"], 32, "cuda")[0] == default_config("cuda")
    assert suite_configs(["default", "ngram-16-one-adaptive"], 8, "cuda") == [DEFAULT_CONFIG + (2,), DEFAULT_CONFIG]
    assert default_config("cpu") == DEFAULT_CONFIG
    gpu_rows = [{"kind": "device", "default_config": config_label(default_config("cuda"))}]
    assert default_label(gpu_rows) == "ngram-16-one-adaptive-forecast2"
    assert default_label([{"kind": "device"}]) == DEFAULT_LABEL == config_label(DEFAULT_CONFIG)   # older rows
