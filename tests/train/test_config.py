"""Run configs: YAML + dotted overrides, and clear errors for keys that do not exist."""

import pytest

from hybridpar.config import ConfigError, load_config

DEFAULT = "configs/tiny-hybrid.yaml"


def test_default_config_loads_and_overrides_apply():
    config = load_config(DEFAULT, ["train.steps=7", "parallel.cp=1", "model.overrides={pattern: M-}", "train.lr=1"])
    assert config.train.steps == 7 and config.parallel.cp == 1 and config.parallel.tp == 2
    assert config.model.overrides == {"pattern": "M-"}
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.stpes=3"], r"unknown config key\(s\) \['train.stpes'\]"),
        (["trian.steps=3"], r"unknown config key\(s\) \['trian'\]"),
        (["train.steps=many"], "train.steps='many' has type str; expected int"),
        (["parallel.sequence_parallel=3"], "expected bool"),
        (["train.steps"], "is not key=value"),
        (["train=3"], "must be a mapping"),
    ],
)
def test_bad_keys_and_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEFAULT, overrides)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
