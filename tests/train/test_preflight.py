"""Rules between keys and against the model, checked before any process starts; ``plan``
applies exactly the rules ``train`` does."""

import pytest

from hybridpar.config import load_config
from hybridpar.models.hf.checkpoint import save_hf
from hybridpar.plan import print_plan
from hybridpar.train.preflight import validate_layout, validate_run

DEFAULT = "configs/tiny-hybrid.yaml"
NO_ROPE = "model.overrides={rotary_fraction: 0.0}"  # NemotronH attention has no RoPE


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["parallel.cp=3", "parallel.tp=2"], None, r"parallel.cp=3 with parallel.tp=2: module 'backbone.layers.0.mixer'.*divisible by cp=3"),
        (["parallel.tp=4", "parallel.cp=1"], None, r"mamba_n_groups=2 is not divisible by tp=4"),
        (["parallel.cp_attention=ulysses", "parallel.cp=4", "parallel.tp=1", "parallel.cp_mamba=state",
          "model.overrides={num_attention_heads: 6, num_key_value_heads: 2}"], None, r"attention"),
        (["parallel.mixed_precision=bf16", "parallel.cp=1", "model.dtype=float64"], None,
         r"^parallel.mixed_precision='bf16': .*keeps float32 master weights.*float64"),
        (["data.pack_size=250"], None, r"data.pack_size=250 is not a multiple of the document padding 4"),
        (["data.pad_to_multiple_of=6"], None, r"data.pad_to_multiple_of=6 is not a multiple of 2\*cp=4"),
        (["parallel.dp_shard=2", "parallel.cp=1", "data.packs_per_step=3"], None, r"packs_per_step=3 is not divisible"),
        (["parallel.dp_shard=2", "parallel.cp=1", "data.packs_per_step=2", "train.eval_packs=3"], None, "eval_packs=3"),
        (["model.overrides={patern: M-}"], None, r"model.overrides has unknown field\(s\) \['patern'\]"),
        (["model.overrides={mamba_n_groups: 0}"], None, r"model.overrides.mamba_n_groups=0 is invalid: it must be an integer >= 1"),
        (["model.overrides={hidden_size: 1.5}"], None, r"model.overrides.hidden_size=1.5 is invalid: it must be an integer"),
        (["model.overrides={mamba_num_heads: 6, mamba_n_groups: 4}"], None, r"do not make a valid '[a-z]+' model: mamba_num_heads"),
        ([], 4, r"the world size is 4"),
        # parallelize's own rules name the config key they are about
        (["parallel.compile=banana"], None, r"parallel.compile='banana' is invalid: .*'aot_eager'"),
        (["parallel.dp_shard=2", "parallel.tp=1", "parallel.reshard_after_forward=3"], None,
         r"^parallel.reshard_after_forward=3: .*one of \[1, 2, 4\]"),
        (["parallel.tp=3", "parallel.cp=1"], None, r"^parallel.tp=3: .*mamba_num_heads=8 is not divisible by tp=3"),
        (["model.overrides={pattern: ''}"], None, r"model.overrides.pattern='' is invalid: it must be a non-empty"),
        (["model.overrides={pattern: MQ}"], None, r"model.overrides.pattern='MQ' is invalid"),
    ],
)
def test_layouts_that_cannot_run_are_refused_by_plan_and_train_alike(overrides, world_size, message, capsys):
    config = load_config(DEFAULT, overrides)
    with pytest.raises(ValueError, match=message) as train_error:
        validate_layout(config, world_size)
    with pytest.raises(ValueError) as plan_error:
        print_plan(config, world_size)
    assert str(plan_error.value) == str(train_error.value)
    assert capsys.readouterr().out == ""  # no plan of a layout that cannot run


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.task=text", "data.task_options={}"], r"data.path=null names no file"),
        (["data.task_options={vocab_size: 1024}"], r"vocab_size=1024 is larger than the model's vocabulary \(256\)"),
        (["data.task=jsonl"], r"data.task_options \['max_len', 'min_len', 'num_kv_pairs', 'vocab_size'\] do not apply"),
        (["data.task=text", "data.path=configs/tiny-hybrid.yaml", "data.task_options={}",
          "model.overrides={vocab_size: 128}"], r"reads bytes .* vocab_size is 128"),
        (["model.export_hf=OUT/export"], r"needs model.export_architecture"),
        (["model.export_hf=OUT/export", "model.export_architecture=BambaForCausalLM"], r"cannot hold this model"),
        (["model.export_hf=OUT/full", "model.export_architecture=NemotronHForCausalLM", NO_ROPE], "directory that is not empty"),
        (["model.export_hf=OUT/file", "model.export_architecture=NemotronHForCausalLM", NO_ROPE], r"it is a file"),
        (["checkpoint.resume=OUT/missing"], r"checkpoint.resume=.*missing' cannot be loaded: .* does not exist"),
        (["output_dir=OUT/file"], r"output_dir=.*file' cannot hold the run: it is a file"),
        (["output_dir=OUT/file/run"], r"output_dir=.*run' cannot hold the run: .*file is a file"),
        (["data.task_options={bogus: 1}"], r"data.task_options \['bogus'\] do not apply to data.task='mqar'; its "
                                           r"options are \{'vocab_size': 256"),
        (["data.task_options={seed: 5}"], r"\['seed'\] do not apply .* \(the seed is data.seed\)"),
    ],
)
def test_data_export_and_resume_settings_are_refused_before_launch(tmp_path, overrides, message):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "weights.bin").write_text("the user's file")
    (tmp_path / "file").write_text("a file")
    overrides = [o.replace("OUT", str(tmp_path)) for o in overrides]
    run = [] if any(o.startswith("output_dir=") for o in overrides) else [f"output_dir={tmp_path / 'run'}"]
    config = load_config(DEFAULT, [*run, "parallel.cp=1", "parallel.tp=1", *overrides])
    with pytest.raises(ValueError, match=message):
        validate_run(config, "train", 1)
    assert (tmp_path / "full" / "weights.bin").read_text() == "the user's file"


def test_export_onto_the_checkpoint_being_fine_tuned_is_refused(tmp_path):
    from hybridpar.models.hybrid import HybridConfig, HybridLM

    save_hf(HybridLM(HybridConfig(rotary_fraction=0.0)), tmp_path / "original", architecture="NemotronHForCausalLM")
    before = (tmp_path / "original" / "model.safetensors").read_bytes()
    for target in (tmp_path / "original", tmp_path / "original" / "." / ""):
        config = load_config(DEFAULT, [f"model.hf_path={tmp_path / 'original'}", f"model.export_hf={target}",
                                       "parallel.cp=1", "parallel.tp=1", f"output_dir={tmp_path / 'run'}"])
        with pytest.raises(ValueError, match="it is model.hf_path, the checkpoint being fine-tuned"):
            validate_run(config, "train", 1)
    assert (tmp_path / "original" / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("task, pack_size, options, share", [
    ("mqar", 8192, {"min_len": 4000, "max_len": 10000}, "30%"), ("selective_copy", 4160, {"min_len": 100, "max_len": 5000}, "17%"),
    ("mqar", 8192, {"min_len": 4000, "max_len": 8192}, None), ("mqar", 64, {"min_len": 64, "max_len": 64}, None),
])
def test_a_dry_run_foretells_a_split_of_synthetic_documents_in_packs_too_large_to_build(tmp_path, task, pack_size, options, share,
                                                                                       capsys):
    """A synthetic task's packs above 4,096 tokens are not built by ``--dry-run`` (their building would say a
    document was split); its ``max_len`` above ``data.pack_size`` is said instead, with the share of documents split."""
    config = load_config(None, ["model.preset=tiny", f"data.task={task}", f"data.pack_size={pack_size}",
                                f"data.task_options={options}", f"output_dir={tmp_path}"])
    validate_run(config, "train", 1, dry_run=True)
    said = capsys.readouterr().err
    if share is None:
        assert "split" not in said, said
    else:
        assert (f"documents of {options['min_len']}-{options['max_len']} tokens (data.task_options min_len, max_len), so "
                f"{share} of them are longer than data.pack_size={pack_size}") in said and \
            f"use data.pack_size >= {options['max_len']} or data.task_options.max_len <= {pack_size}" in said, said


def test_a_dry_run_compares_a_transformers_checkpoints_shapes_with_its_config(tmp_path):
    """Before: a transformers checkpoint whose config.json disagrees with its weights (intermediate_size edited)
    passed ``--dry-run`` ("config and layout valid") and was refused only once the model was built and loaded."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)).save_pretrained(tmp_path / "m")
    overrides = [f"model.hf_path={tmp_path / 'm'}", f"output_dir={tmp_path / 'run'}", "data.pack_size=64"]
    validate_run(load_config(None, overrides), "train", dry_run=True)  # as saved: no word
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(ValueError, match=r"3 tensors disagree with config.json: model.layers.0.mlp.gate_proj.weight "
                                         r"\(checkpoint \[32, 16\], config \[48, 16\]\)"):
        validate_run(load_config(None, overrides), "train", dry_run=True)


def test_the_dry_runs_shape_check_reads_names_as_transformers_loads_them(tmp_path):
    """Before: transformers saves a Nemotron-H under ``backbone.`` and loads it as ``model.``, so the dry run compared
    none of its tensors: a conv_kernel edited in config.json passed ``--dry-run`` and failed once the model was built.
    Now the plain renamings transformers holds for the model's type are applied first (stacked experts, which a
    converter merges on load, are left to the load)."""
    import json

    from tests.models.hf.hybrid_models import build_hybrid

    build_hybrid("nemotron_h_moe").save_pretrained(tmp_path / "m")
    overrides = [f"model.hf_path={tmp_path / 'm'}", f"output_dir={tmp_path / 'run'}", "data.pack_size=64"]
    validate_run(load_config(None, overrides), "train", dry_run=True)  # as saved: no word
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "conv_kernel": config["conv_kernel"] + 1}))
    with pytest.raises(ValueError, match=r"1 tensors disagree with config.json: model.layers.0.mixer.conv1d.weight "
                                         r"\(checkpoint \[96, 1, 4\], config \[96, 1, 5\]\)"):
        validate_run(load_config(None, overrides), "train", dry_run=True)


@pytest.mark.parametrize("task", ["mqar", "selective_copy"])
def test_the_built_in_defaults_split_no_synthetic_document(tmp_path, task, monkeypatch):
    """Before: the built-in ``data.pack_size=256`` was below the synthetic tasks' default ``max_len=512``, so every run
    on the defaults split documents across rows (a key in one row, its query in the next): 35 in a dry run."""
    import warnings

    from hybridpar.train.batches import PackStream

    monkeypatch.setattr(PackStream, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_run(load_config(None, [f"output_dir={tmp_path}", f"data.task={task}"]), "train", dry_run=True)
    assert not [w for w in caught if "split" in str(w.message)], [str(w.message) for w in caught]
