"""gpu_suite's --configs: 'all', 'default' and configuration labels, parsed both ways."""
import argparse

import pytest

from specserve.bench.gpu_suite import (CONCURRENT_CONFIGS, DEFAULT_CONFIG, SPEC_CONFIGS, config_choice, config_label,
                                       parse_config, suite_configs)


def test_labels_parse_back_to_their_configuration():
    for spec in SPEC_CONFIGS + [(16, False, True), (2, True, False)]:
        assert parse_config(config_label(spec)) == spec


@pytest.mark.parametrize("label", ["ngram-x-one", "ngram-8-wide", "eagle-8-one", "ngram-8-one-fast", "ngram"])
def test_a_malformed_label_is_refused_naming_the_flag(label):
    with pytest.raises(argparse.ArgumentTypeError, match="--configs"):
        config_choice(label)


def test_choices_expand_in_order_without_repeats():
    assert suite_configs(["default"], 1) == [DEFAULT_CONFIG]
    assert suite_configs(["all"], 1) == SPEC_CONFIGS
    assert suite_configs(["all"], 32) == CONCURRENT_CONFIGS
    assert suite_configs(["default", "ngram-16-multi-adaptive", "ngram-16-one-adaptive"], 8) == \
        [DEFAULT_CONFIG, (16, False, True)]   # the default is the 16-node adaptive chain
