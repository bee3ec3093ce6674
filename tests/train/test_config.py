"""Run configs: YAML 1.2 + dotted overrides, and one clear message for every bad key or value."""

import dataclasses
import typing

import pytest

from hybridpar.config import RULES, ConfigError, RunConfig, load_config

DEFAULT = "configs/tiny-hybrid.yaml"


def test_default_config_loads_and_overrides_apply():
    config = load_config(DEFAULT, ["train.steps=7", "parallel.cp=1", "model.overrides={pattern: M-}", "train.lr=1"])
    assert config.train.steps == 7 and config.parallel.cp == 1 and config.parallel.tp == 1
    assert config.model.overrides == {"pattern": "M-"}
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.stpes=3"], r"unknown config key\(s\) \['train.stpes'\]"),
        (["trian.steps=3"], r"unknown config key\(s\) \['trian'\]"),
        (["train.steps=many"], r"train.steps='many' is invalid: it must be an integer \(got str\)"),
        (["parallel.sequence_parallel=3"], "must be true or false"),
        (["tensorboard=yes"], "tensorboard='yes' is invalid: it must be true or false"),  # YAML 1.2: 'yes' is a string
        (["train.steps"], "is not key=value"),
        (["train=3"], "must be a mapping"),
    ],
)
def test_bad_keys_and_types_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEFAULT, overrides)


@pytest.mark.parametrize(
    "override",
    [
        "train.steps=0", "train.steps=-3", "train.log_every=0", "train.grad_clip=-1", "train.grad_clip=0",
        "checkpoint.keep=0", "checkpoint.every=-2", "data.packs_per_step=0", "data.pack_size=0", "train.lr=-1",
        "train.lr=0", "train.lr=.nan", "train.lr=.inf", "train.min_lr_ratio=1.5", "train.warmup_steps=-1",
        "train.weight_decay=-0.1", "train.betas=[0.9,1.0]", "train.betas=[0.9]", "train.eval_every=-1",
        "train.eval_packs=0", "train.collective_timeout_s=0", "train.max_nonfinite_skips=-1", "data.seed=-1",
        "train.seed=-5", "parallel.cp=0", "parallel.tp=-2", "parallel.dp_shard=0", "parallel.dp_replicate=0",
        "data.pad_to_multiple_of=0",
    ],
)
def test_numbers_out_of_range_name_key_value_rule_and_fix(override):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as error:
        load_config(DEFAULT, [override])
    message = str(error.value)
    assert message.startswith(f"{key}=") and "is invalid: it must be" in message and f"e.g. {key}=" in message
    assert len(message.splitlines()) == 1


@pytest.mark.parametrize(
    "override, choices",
    [
        ("model.dtype=float16", "'float32', 'float64', 'bfloat16'"),
        ("model.preset=huge", "'nemotronh-8b', 'small', 'tiny'"),
        ("model.export_architecture=GPT2LMHeadModel", "'BambaForCausalLM'"),
        ("data.task=parquet", "'mqar', 'selective_copy', 'text', 'jsonl'"),
        ("parallel.cp_attention=zigzag", "'allgather', 'ulysses', 'ring'"),
        ("parallel.cp_mamba=ring", "'a2a', 'state'"),
        ("parallel.mixed_precision=fp16", "'bf16' or null"),
        ("train.on_nonfinite=ignore", "'stop', 'skip'"),
        ("checkpoint.if_exists=append", "'refuse', 'overwrite', 'new_subdir'"),
        ("output_dir=''", "a non-empty path"),
    ],
)
def test_strings_outside_their_choices_list_the_choices(override, choices):
    with pytest.raises(ConfigError, match=f"is invalid: it must be .*{choices}"):
        load_config(DEFAULT, [override])


def test_yaml_1_2_numbers_in_files_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1e-3\n  weight_decay: 5E-2\n  min_lr_ratio: .5\n  steps: 010\n"
                    "  betas: [0.9, 95e-2]\ndata:\n  seed: 0x10\n")
    config = load_config(path, ["train.grad_clip=2e0", "train.warmup_steps=+3"])
    assert (config.train.lr, config.train.weight_decay, config.train.min_lr_ratio) == (1e-3, 5e-2, 0.5)
    assert config.train.steps == 10 and config.data.seed == 16 and config.train.betas == (0.9, 0.95)
    assert config.train.grad_clip == 2.0 and config.train.warmup_steps == 3


def test_yaml_syntax_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  steps: 3\n  lr: [0.1\nmodel:\n  dtype: float32\n")
    with pytest.raises(ConfigError, match=r"broken.yaml' is not valid YAML at line \d+, column \d+"):
        load_config(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(path)


def test_a_key_written_twice_is_an_error_and_an_empty_section_means_its_defaults(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  steps: 3\n  lr: 0.1\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"twice.yaml' is not valid YAML at line 4, column 3: key 'steps' appears "
                                          r"twice \(first at line 2\)"):
        load_config(path)
    with pytest.raises(ConfigError, match="key 'pattern' appears twice"):
        load_config(DEFAULT, ["model.overrides={pattern: M-, pattern: '*-'}"])
    path.write_text("train:\nmodel:\n  dtype: float64\n")
    assert load_config(path).train == RunConfig().train
    assert load_config(path, ["train.steps=3"]).train.steps == 3


@pytest.mark.parametrize("overrides, said", [
    (["train.steps=10", "data.pack_size=64", "train.steps=20"], "overrides give train.steps twice: 10 (in "
                                                                "'train.steps=10'), then 20 (in 'train.steps=20')"),
    (["model.overrides.hidden_size=64", "model.overrides={num_layers: 2}"], "model.overrides.hidden_size twice: 64 "
     "(in 'model.overrides.hidden_size=64'), then nothing (the mapping is replaced) (in 'model.overrides={num_layers: 2}')"),
    (["model.overrides={hidden_size: 64}", "model.overrides.hidden_size=32"], "model.overrides.hidden_size twice: 64"),
])
def test_an_override_that_changes_an_earlier_one_is_said(overrides, said):
    """Before: ``train.steps=10 ... train.steps=20`` trained 20 steps without a word, as did a mapping given after
    one of its keys. The last is still used (a base set of overrides and a change to it), and said once. The same
    value twice, or a key added to an earlier mapping, changes nothing and is not said."""
    import warnings

    with pytest.warns(UserWarning) as caught:
        load_config(None, overrides)
    assert [said in str(w.message) and "the last is used" in str(w.message) for w in caught] == [True], caught
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config(None, ["train.steps=10", "train.steps=10", "model.overrides={hidden_size: 64}",
                                    "model.overrides.num_layers=2", "model.overrides.hidden_size=64"])
    assert config.train.steps == 10 and config.model.overrides == {"hidden_size": 64, "num_layers": 2}


@pytest.mark.parametrize("override", ["train.betas=[0.9,", "model.overrides={pattern: ", "train.lr='1e-3"])
def test_malformed_overrides_are_one_clean_error(override):
    with pytest.raises(ConfigError, match=r"override .* has a malformed value .*write it as a YAML value"):
        load_config(DEFAULT, [override])


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def _keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _keys(hint, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_every_key_has_a_rule_and_every_rule_a_key():
    """A new config key must come with its rule (range or choices) in config.RULES."""
    keys = set(_keys(RunConfig))
    assert keys == set(RULES), (sorted(keys - set(RULES)), sorted(set(RULES) - keys))
    defaults = load_config()  # every default satisfies its own rule
    assert defaults.train.collective_timeout_s > 0 and defaults.checkpoint.if_exists == "refuse"
