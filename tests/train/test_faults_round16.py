"""Round 16 of fault hunting (docs/reliability.md, "Round 16"): the CLI and the Python API as a user
would hit them, every case in this process (dry runs, one-process runs and the API)."""

from __future__ import annotations

import pytest

from tests.train.fault_probes import cli, one_line

TINY = ["model.preset=tiny", "parallel.cp=1", "parallel.tp=1", "data.pack_size=64", "train.warmup_steps=0",
        "plot=false", "tensorboard=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny text run of 2 steps (bytes tokenizer), a checkpoint after each."""
    folder = tmp_path_factory.mktemp("round16")
    (folder / "t.txt").write_text("hello world, some text.\n\nanother paragraph of text.\n\n" * 40)
    code, output = cli("train", *TINY, "data.task=text", f"data.path={folder / 't.txt'}", "train.steps=2",
                       "checkpoint.every=1", f"output_dir={folder / 'run'}")
    assert code == 0, output
    return folder / "run"


def test_too_few_held_out_documents_are_refused_before_step_1(tmp_path):
    """Before: a file of one paragraph trained every step (and saved checkpoints) and was refused only at the
    first evaluation, at the end of the run; the dry run refused it at once."""
    (tmp_path / "t.txt").write_text("one paragraph of text, with no blank line in it.\n" * 50)
    code, output = cli("train", *TINY, "data.task=text", f"data.path={tmp_path / 't.txt'}", "train.steps=3",
                       "train.eval_every=3", "checkpoint.every=1", f"output_dir={tmp_path / 'run'}")
    assert code == 2 and "evaluation holds out the last 10% and needs at least 2" in output, output
    assert "step     1" not in output and not (tmp_path / "run" / "checkpoints").exists(), output


def test_generate_tokenizer_bpe_of_a_run_not_trained_with_bpe_is_named(run):
    """Before: ``--tokenizer bpe`` on a bytes run said "checkpoint ... was trained with data.tokenizer=bpe", which it
    was not, and listed the same folder twice."""
    code, output = cli("generate", "--checkpoint", str(run), "--prompt", "hi", "--max-new-tokens", "2",
                       "--tokenizer", "bpe")
    assert code == 2 and "was trained with data.tokenizer='auto'; leave --tokenizer out" in output, output
    from hybridpar.train.run.tokenizer import find_run_tokenizer

    with pytest.raises(ValueError) as error:
        find_run_tokenizer(run / "checkpoints" / "step_00000002", str(run))
    assert one_line(error).count(str(run / "tokenizer")) == 1, error.value


@pytest.mark.parametrize("pattern", [5, None, ["M", "*"], ("M", "-"), ""])
def test_a_hybrid_config_pattern_that_is_not_a_string_is_one_value_error(pattern):
    """Before: ``HybridConfig(pattern=5)`` or ``None`` was a ``TypeError`` ("not iterable"), a list or tuple of
    characters built a model (the CLI refuses one), and ``''`` was said to have "unknown characters []"."""
    import hybridpar as hp

    with pytest.raises(ValueError) as error:
        hp.HybridConfig(pattern=pattern)
    assert f"layer pattern {pattern!r} must be a non-empty string of 'M' (Mamba2)" in one_line(error)


@pytest.mark.parametrize("change, said", [
    (lambda run: setattr(run.model, "dtype", "fp16"), "model.dtype='fp16' is invalid"),
    (lambda run: setattr(run.data, "pack_size", -64), "data.pack_size=-64 is invalid"),
    (lambda run: setattr(run.data, "pack_size", 64.5), "data.pack_size=64.5 is invalid: it must be an integer"),
    (lambda run: setattr(run, "train", 5), "section 'train' must be a mapping, got 5"),
])
def test_make_plan_checks_a_run_config_changed_by_hand(change, said):
    """Before: ``make_plan`` of a ``RunConfig`` changed after ``load_config`` (or built directly) was an
    ``AttributeError`` (``module 'torch' has no attribute 'fp16'``), or a message that took the bad value as a
    bound ("docs_per_pack=1 must be an integer in [1, data.pack_size=-64]", "use data.pack_size=66.0")."""
    import hybridpar as hp

    run = hp.load_config(None, [])
    change(run)
    with pytest.raises(ValueError) as error:
        hp.make_plan(run)
    assert said in one_line(error), error.value


def test_a_dataset_rows_error_counts_rows_from_1(tmp_path):
    """Before: an ``hf_dataset`` record of the wrong type was named by its 0-based index ("m.jsonl row 0" for the
    first line, "row 1" for a CSV's second data row) while the same task's notices count documents from 1."""
    pytest.importorskip("datasets")
    from hybridpar.data.documents import file_documents

    (tmp_path / "m.jsonl").write_text('{"text": 5}\n{"text": "a"}\n')
    with pytest.raises(ValueError) as error:
        file_documents("hf_dataset", tmp_path / "m.jsonl", None)
    assert "m.jsonl row 1 of 2 (counted from 1; a CSV header is no row): column 'text' holds int" in one_line(error)


def test_a_resume_that_spells_the_bytes_tokenizer_out_is_not_refused(run):
    """Before: a run trained with data.tokenizer=auto (bytes, without model.hf_path) resumed with data.tokenizer=bytes
    was refused: "would change the training batches (data.tokenizer "auto" -> "bytes")", though both read bytes."""
    data = ["data.task=text", f"data.path={run.parent / 't.txt'}", f"output_dir={run}", "train.steps=3"]
    code, output = cli("train", *TINY, *data, "data.tokenizer=bytes", "--dry-run")
    assert code == 0 and "would change the training batches" not in output, output
    tiny = [item for item in TINY if not item.startswith("data.pack_size=")]
    code, output = cli("train", *tiny, *data, "data.pack_size=128", "--dry-run")  # a real change is still refused
    assert code == 2 and "would change the training batches (data.pack_size 64 -> 128" in output, output


@pytest.mark.parametrize("flags, said", [
    (["--checkpoint", "{tmp}/gone"], "--checkpoint {tmp}/gone does not exist"),
    (["--hf-path", "{tmp}/gone"], "--hf-path '{tmp}/gone' is not a directory"),
    (["--checkpoint", "{run}", "--tokenizer", "{tmp}/gone"],
     "--tokenizer '{tmp}/gone' is neither 'auto', 'bytes', 'bpe'"),
    (["--checkpoint", "{run}", "--base", "{tmp}/gone"], "--base '{tmp}/gone' is not a directory"),
])
def test_a_generate_dry_run_checks_the_paths(run, tmp_path, flags, said):
    """Before: ``generate --dry-run`` said "generate arguments valid" of a --checkpoint, --hf-path, --tokenizer or
    --base that does not exist; the real call refused each at once."""
    fill = {"tmp": tmp_path, "run": run}
    code, output = cli("generate", *[flag.format(**fill) for flag in flags], "--prompt", "hi", "--max-new-tokens", "2",
                       "--dry-run")
    assert code == 2 and said.format(**fill) in output and "Traceback" not in output, output
    code, output = cli("generate", "--checkpoint", str(run), "--prompt", "hi", "--max-new-tokens", "2", "--dry-run")
    assert code == 0 and "generate arguments valid" in output, output


@pytest.mark.parametrize("key", ["peft.target_modules", "peft.target_parameters"])
def test_a_list_key_given_one_name_says_to_write_brackets(key):
    """Before: ``peft.target_modules=in_proj`` said "must be a list of strings (got str); e.g.
    peft.target_modules=null (the default)", which leaves the user's one name out."""
    from hybridpar.config import ConfigError, load_config

    with pytest.raises(ConfigError) as error:
        load_config(None, ["peft.method=lora", f"{key}=in_proj"])
    assert f"a list is written in brackets, even of one name: {key}=[in_proj]." in one_line(error)


@pytest.mark.parametrize("task", ["mqar", "selective_copy"])
def test_a_synthetic_tasks_min_len_above_max_len_is_told_to_lower_it(task):
    """Before: ``min_len=100, max_len=50`` was told "raise min_len or lower num_kv_pairs" (num_tokens), which
    cannot help: the lengths are drawn from [min_len, max_len]."""
    code, output = cli("train", "model.preset=tiny", f"data.task={task}",
                       "data.task_options={min_len: 100, max_len: 50}", "--dry-run")
    assert code == 2 and "min_len=100 is above max_len=50" in output and "raise max_len to 100." in output, output


def test_a_dry_run_says_a_synthetic_document_would_be_split(monkeypatch):
    """Before: ``mqar`` documents longer than ``data.pack_size`` were split (a key and its value in different rows) with
    the packer's notice in training, while the dry run built no synthetic packs and said nothing."""
    import warnings

    from hybridpar.train.batches import PackStream

    monkeypatch.setattr(PackStream, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, output = cli("train", "model.preset=tiny", "data.pack_size=64",
                           "data.task_options={min_len: 100, max_len: 100}", "--dry-run")
    said = [str(w.message) for w in caught if "pack_documents(pack_size=64): split" in str(w.message)]
    assert code == 0 and len(said) == 1, (said, output)


@pytest.mark.parametrize("override, said", [
    ("output_dir=~", "override 'output_dir=~': a lone ~ is null in YAML, not the home directory; write a path"),
    ("data.path=~", "a lone ~ is null in YAML, not the home directory; write a path (~/NAME or the home directory's "
                    "full path) (data.path=null for none)."),
    ("data.path=", "data.path=null names no file; data.task='text' needs an existing local file."),
])
def test_a_path_override_of_a_lone_tilde_or_nothing_is_named(tmp_path, override, said):
    """Before: ``output_dir=~`` said "output_dir=null is invalid: it must be a string" (YAML reads a lone ~ as null) and
    ``data.path=~`` or ``data.path=`` said "data.path=None is not a file"."""
    code, output = cli("train", "model.preset=tiny", "data.task=text", f"output_dir={tmp_path / 'run'}", override,
                       "--dry-run")
    assert code == 2 and said in output and "None" not in output, output


@pytest.mark.parametrize("override, meant", [("TRAIN.steps=3", "train"), ("train.STEPS=3", "train.steps"),
                                             ("model.overrides={Hidden_Size: 32}", "hidden_size")])
def test_a_key_in_other_case_names_the_key(override, meant):
    """Before: ``TRAIN.steps=3`` said "unknown config key(s) ['TRAIN']" and listed the sections without a guess (the
    spelling match is case-sensitive, and 'TRAIN' is far from 'train')."""
    code, output = cli("train", "model.preset=tiny", override, "--dry-run")
    assert code == 2 and f"did you mean {meant}?" in output, output


def test_pack_documents_holds_pack_size_to_int32_and_export_takes_a_model_only(tmp_path):
    """Before: ``pack_documents(docs, 2**40)`` was torch's allocation failure (a pack past 2**31-1 tokens, where the
    int32 ``cu_seqlens`` overflow, was not refused as the CLI's ``data.pack_size`` is), and ``export_causal_lm("x",
    dir)`` or ``save_hf("x", dir)`` an ``AttributeError`` ("'str' object has no attribute 'save_pretrained'")."""
    import hybridpar as hp

    with pytest.raises(ValueError) as error:
        hp.pack_documents([[1, 2]], 2**40)
    assert "pack_size must be an int in [1, 2**31-1] (cu_seqlens are int32), got 1099511627776." in one_line(error)
    with pytest.raises(ValueError) as error:
        hp.export_causal_lm("x", tmp_path / "out")
    assert "model='x' (type str) is not a model export_causal_lm can write" in one_line(error)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError) as error:
        hp.save_hf("x", tmp_path / "out", architecture="NemotronHForCausalLM")
    assert "save_hf writes a HybridLM, got 'x' (type str)" in one_line(error)


def test_a_train_sample_larger_than_memory_is_refused_before_training(run):
    """Before: ``train.sample={max_new_tokens: 2000000000}`` trained every step and saved the checkpoint, then the
    sample was refused for memory ("needs about 2.41e+03 GiB"): the generation estimate ran after training only."""
    code, output = cli("train", *TINY, "data.task=text", f"data.path={run.parent / 't.txt'}", "train.steps=1",
                       f"output_dir={run.parent / 'sampled'}", "train.sample={prompt: hi, max_new_tokens: 2000000000}",
                       "--dry-run")
    assert code == 2 and "train.sample: generating 2000000000 tokens after a" in output, output
    assert "(checked now, not after training)." in output, output


def test_a_resume_that_changes_the_seed_of_the_dropout_masks_says_so():
    """Before: resuming a LoRA run with adapter dropout (or a transformers model, whose dropout is keyed by the seed)
    with another ``train.seed`` drew other dropout masks without a word; the other settings a step reads were said."""
    import json

    from hybridpar.config import load_config, to_dict
    from hybridpar.train.run.numerics import numeric_changes

    def notes(*overrides):
        recorded = load_config(None, ["peft.method=lora", "peft.dropout=0.1", "train.seed=0"])
        info = {"config": json.loads(json.dumps(to_dict(recorded)))}  # as run.json holds it
        return numeric_changes("ckpt", info, load_config(None, list(overrides)))

    [said] = notes("peft.method=lora", "peft.dropout=0.1", "train.seed=5")
    assert "trained with train.seed=0; resuming with 5 draws other dropout masks from the next step on" in said
    assert notes("peft.method=lora", "peft.dropout=0.1", "train.seed=0") == []
    assert notes("peft.method=lora", "peft.dropout=0.0", "train.seed=5") == [notes("peft.method=lora",
                                                                                    "peft.dropout=0.0")[0]]


def test_check_says_the_keys_it_does_not_read(run):
    """Before: ``hybridpar check`` with ``model.export_hf``, ``train.sample`` or a ``checkpoint.resume`` path ran without
    a word, though it exports, samples and loads nothing (a user checking a trained checkpoint's layout checked fresh
    weights)."""
    data = ["data.task=text", f"data.path={run.parent / 't.txt'}", "model.dtype=float64"]
    code, output = cli("check", *TINY, *data, f"model.export_hf={run.parent / 'x'}", "train.sample={prompt: hi}",
                       f"checkpoint.resume={run / 'checkpoints' / 'step_00000002'}", "--dry-run")
    assert code == 0 and "model.export_hf, train.sample, checkpoint.resume are not used by check" in output, output
    code, output = cli("check", *TINY, *data, "--dry-run")
    assert code == 0 and "not used by check" not in output, output


def test_digits_grouped_by_underscores_are_told_to_lose_them():
    """Before: ``train.steps: 1_000`` (a YAML 1.1 integer; YAML 1.2 reads text) said "must be an integer (got str);
    e.g. train.steps=60 (the default)", not why the number was text."""
    from hybridpar.config import ConfigError, load_config

    with pytest.raises(ConfigError) as error:
        load_config(None, ["train.steps=1_000"])
    assert "YAML 1.2 reads digits grouped by '_' as text: write train.steps=1000." in one_line(error)
    with pytest.raises(ConfigError) as error:
        load_config(None, ["train.steps=a_b"])
    assert "grouped" not in one_line(error)


@pytest.mark.parametrize("verb, meant", [("TRAIN", "train"), ("trian", "train"), ("Generate", "generate"),
                                         ("export", "train, whose model.export_hf=DIR writes the export")])
def test_a_verb_that_is_not_one_names_the_verb_it_most_likely_is(capsys, verb, meant):
    """Before: ``hybridpar TRAIN`` or ``hybridpar export`` listed the verbs without a guess (a config key in other case
    or misspelt is named; an export is train's model.export_hf)."""
    from hybridpar.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([verb])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"did you mean {meant}?" in err and err.count("\n") == 1, err


def test_version_is_a_flag(capsys):
    """Before: ``hybridpar --version`` said "the following arguments are required: VERB"."""
    import hybridpar
    from hybridpar.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"hybridpar {hybridpar.__version__}\n"
