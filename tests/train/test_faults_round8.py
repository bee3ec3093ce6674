"""Faults, round 8: an output_dir that is someone else's directory, an empty assistant turn that
still trained a token, what --dry-run reads, and the probes of a hostile user; one test per
class, in-process on real files."""

import json
import os
from pathlib import Path

import pytest

from tests.train.test_faults_round3 import TINY
from tests.train.fault_probes import cli as _cli, one_line as _one_line

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")
ROOT = Path(__file__).resolve().parents[2]


def test_an_output_dir_that_is_someone_elses_directory_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """``output_dir=/``, ``~``, ``.`` in a source tree, or any non-empty folder with no run in it
    took the lock and wrote checkpoints/ among the user's files (and ``if_exists=overwrite``
    deletes a metrics.jsonl there). Refused; new, empty and run directories still work."""
    from hybridpar.train.run.directory import check_output_dir

    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "train.txt").write_text("text\n")
    cases = [("/", "it is the root directory"), (str(home), "it is your home directory"),
             (str(repo), "it is a source tree (it holds .git)"),
             (str(foreign), "it already holds files of something else (train.txt) and no hybridpar run")]
    for directory, expected in cases:
        with pytest.raises(ValueError) as error:
            check_output_dir(directory)
        assert expected in _one_line(error) and "choose a new or empty directory" in str(error.value)
    before = sorted(os.listdir(foreign))
    code, said = _cli("train", "--config", CONFIG, *TINY, f"output_dir={foreign}", "--dry-run")
    assert code == 2 and "holds files of something else" in said and sorted(os.listdir(foreign)) == before
    monkeypatch.chdir(repo)
    code, said = _cli("train", "--config", CONFIG, *TINY, "output_dir=.", "--dry-run")
    assert code == 2 and "source tree" in said and sorted(os.listdir(repo)) == [".git"]
    empty = tmp_path / "empty"
    empty.mkdir()
    for fine in (tmp_path / "new" / "run", empty, repo / "runs" / "a"):
        check_output_dir(fine)
    for marker in (".hybridpar.lock", "checkpoints", "metrics.jsonl", "run-001"):
        run = tmp_path / f"run-of-{marker.strip('.')}"
        run.mkdir()
        (run / "config.yaml").write_text("x: 1\n")
        (run / marker).mkdir() if marker in ("checkpoints", "run-001") else (run / marker).write_text("")
        check_output_dir(run)


def test_an_empty_assistant_turn_beside_replies_with_text_trains_no_token(tmp_path):
    """[user, assistant "", user, assistant "jumps over"] trained the empty turn's end of turn
    (the model learns to answer with nothing); now only the reply with text is trained, with or
    without {% generation %} tags, and a conversation of empty replies is still skipped."""
    from hybridpar.data.chat import chat_document
    from hybridpar.data.documents import file_documents
    from hybridpar.data.packing import IGNORE_INDEX
    from tests.data.bpe import train_tiny_bpe
    from tests.data.test_chat import TAGGED_TEMPLATE, with_template

    bpe = train_tiny_bpe(tmp_path / "tok")
    for blank in ("", " \n "):
        turns = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": blank},
                 {"role": "user", "content": "the fox"}, {"role": "assistant", "content": "jumps over"}]
        for tokenizer in (bpe, with_template(bpe, TAGGED_TEMPLATE)):
            labels = chat_document(turns, tokenizer)["labels"]
            trained = bpe.decode([t for t in labels if t != IGNORE_INDEX], skip_special_tokens=False)
            assert trained == "jumps over<|eos|>\n", (blank, trained)
    record = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}\n'
    (tmp_path / "chat.jsonl").write_text(record + record.replace('"content": ""}', '"content": "yes"}'))
    with pytest.warns(UserWarning, match="1 of 2 documents .* have no assistant text"):
        assert len(file_documents("chat", tmp_path / "chat.jsonl", bpe)) == 1


def test_dry_run_reads_small_data_as_training_will_and_says_when_it_does_not(tmp_path, monkeypatch):
    """--dry-run passed a file of empty documents (and a malformed line) that training refused at
    start: it read no record. It reads data up to READ_BYTES as training does (same errors, same
    notices) and says in one line when it reads none."""
    import hybridpar.train.run.dry_read as dry

    run = ["train", "--dry-run", "--config", CONFIG, *TINY, "data.task=jsonl", "data.task_options={}"]
    files = {"empty": '{"text": ""}\n' * 3, "some": '{"text": "hi"}\n{"text": ""}\n{"text": "there"}\n',
             "bad": '{"text": "hi"}\n{"text": oops\n'}
    for name, text in files.items():
        (tmp_path / f"{name}.jsonl").write_text(text)
    code, said = _cli(*run, f"data.path={tmp_path / 'empty.jsonl'}", f"output_dir={tmp_path / 'a'}")
    assert code == 2 and "every one of the 3 documents" in said and len(said.strip().splitlines()) == 1, said
    code, said = _cli(*run, f"data.path={tmp_path / 'bad.jsonl'}", f"output_dir={tmp_path / 'a'}")
    assert code == 2 and "bad.jsonl:2: not valid JSON" in said, said
    with pytest.warns(UserWarning) as caught:
        code, said = _cli(*run, f"data.path={tmp_path / 'some.jsonl'}", f"output_dir={tmp_path / 'a'}")
    notes = [str(w.message) for w in caught]
    assert code == 0 and len(notes) == 1 and "1 of 3 documents (task 'jsonl') have empty text" in notes[0], notes
    monkeypatch.setattr(dry, "READ_BYTES", 8)
    code, said = _cli(*run, f"data.path={tmp_path / 'empty.jsonl'}", f"output_dir={tmp_path / 'a'}")
    assert code == 0 and "were not read (it is 0.0 MiB, above the 0 MiB a dry run reads)" in said, said
    assert not (tmp_path / "a").exists()


def test_optimizer_settings_changed_at_resume_are_applied_and_said():
    """Resuming with train.lr=0.01 (trained with 0.003) ran on at the recorded lr: loading the
    optimizer state restores its param groups (lr, betas, weight_decay) and the scheduler's
    base_lrs, while the preflight said the new lr. Now the config's values are applied after
    loading, with one warning per changed key; unchanged ones give the recorded lr exactly."""
    import torch

    from hybridpar.config import load_config
    from hybridpar.train.optim import apply_settings, build_optimizer, build_scheduler
    from hybridpar.train.run.numerics import numeric_changes

    old = load_config(CONFIG, ["train.lr=0.003", "train.warmup_steps=4"])
    model = torch.nn.Linear(3, 3)
    optimizer = build_optimizer(model, old.train)
    scheduler = build_scheduler(optimizer, old.train)
    for _ in range(2):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    saved, saved_schedule, recorded_lr = optimizer.state_dict(), scheduler.state_dict(), optimizer.param_groups[0]["lr"]
    for overrides, lr, betas, decay in [([], recorded_lr, (0.9, 0.95), 0.01),
                                        (["train.lr=0.01", "train.betas=[0.8,0.9]", "train.weight_decay=0.5"],
                                         0.01 * 3 / 4, (0.8, 0.9), 0.5)]:
        new = load_config(CONFIG, ["train.warmup_steps=4", *overrides])
        fresh = build_scheduler(build_optimizer(model, new.train), new.train)
        fresh.optimizer.load_state_dict(saved)
        fresh.load_state_dict(saved_schedule)
        apply_settings(fresh.optimizer, fresh, new.train)
        groups = fresh.optimizer.param_groups
        assert groups[0]["lr"] == lr and groups[1]["lr"] == lr and fresh.get_last_lr() == [lr, lr]
        assert groups[0]["betas"] == betas and groups[0]["weight_decay"] == decay and groups[1]["weight_decay"] == 0.0
    info = {"config": {"train": {"lr": 0.003, "betas": [0.9, 0.95], "weight_decay": 0.01, "warmup_steps": 4}}}
    notes = numeric_changes("ck", info, load_config(CONFIG, ["train.lr=0.01", "train.warmup_steps=4"]))
    assert notes == ["warning: checkpoint ck was trained with train.lr=0.003; resuming with 0.01 applies 0.01 from the "
                     "next step on, so the losses will not be those of the uninterrupted run"]
    assert numeric_changes("ck", info, load_config(CONFIG, ["train.lr=0.003", "train.warmup_steps=4"])) == []


def test_dry_run_checks_the_weight_files_of_model_hf_path(tmp_path):
    """--dry-run with model.hf_path passed when model.safetensors was missing or truncated, or its
    shapes disagreed with config.json: the launcher read config.json only, and training failed
    after starting its processes. The headers are checked before (cheap: no tensor is read)."""
    from tests.train.test_faults_round3 import tiny_hf

    model = tiny_hf(tmp_path / "hf")
    run = ["train", "--dry-run", "--config", CONFIG, *TINY, f"model.hf_path={model}", f"output_dir={tmp_path / 'o'}"]
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    code, said = _cli(*run)
    assert code == 2 and f"model.hf_path='{model}': {weights} cannot be read: tensor" in said and "(truncated)" in said
    weights.unlink()
    code, said = _cli(*run)
    assert code == 2 and "model.safetensors not found (nor a sharded model.safetensors.index.json)" in said, said
    assert len(said.strip().splitlines()) == 1
    weights.write_bytes(data)
    assert _cli(*run)[0] == 0
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    code, said = _cli(*run)  # the stored shapes against config.json, from the headers (hybrid backend)
    assert code == 2 and "has shape (256, 64) but config.json implies (256, 128); the config and weights" in said, said


def test_a_tokenizer_without_an_eos_token_is_said_for_text_tasks(tmp_path):
    """A tokenizer directory missing tokenizer_config.json loads with no BOS/EOS: every text
    document was trained without an end token (the model never learns to stop), silently."""
    import shutil

    from tests.data.bpe import train_tiny_bpe

    full = train_tiny_bpe(tmp_path / "tok").source_dir
    bare = tmp_path / "bare"
    shutil.copytree(full, bare)
    (bare / "tokenizer_config.json").unlink()
    (tmp_path / "t.txt").write_text("hello world\n\nsecond one\n\nthird\n")
    run = ["train", "--dry-run", "--config", CONFIG, *TINY, "data.task=text", "data.task_options={}",
           f"data.path={tmp_path / 't.txt'}", "model.overrides.vocab_size=512", f"output_dir={tmp_path / 'o'}"]
    code, said = _cli(*run, f"data.tokenizer={bare}")
    assert code == 0 and f"tokenizer {bare} defines no EOS token (is its tokenizer_config.json missing" in said, said
    code, said = _cli(*run, f"data.tokenizer={full}")
    assert code == 0 and "EOS" not in said, said


@pytest.mark.parametrize("variable, said", [("TORCH_LOGS=bogus", "Invalid log settings: bogus"),
                                            ("LOGLEVEL=debug", "Unknown level: 'debug'")])
def test_a_variable_torch_refuses_as_it_loads_is_one_line(variable, said):
    """TORCH_LOGS=bogus, LOGLEVEL=debug (logging wants DEBUG) or TORCH_DISTRIBUTED_DEBUG= were a
    traceback from inside ``import torch`` (torch is already imported here: a subprocess)."""
    import subprocess
    import sys

    key, value = variable.split("=")
    env = {**os.environ, key: value, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, "-m", "hybridpar", "plan", "--config", CONFIG], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.startswith("hybridpar: error: importing torch failed (ValueError: ") and said in result.stderr
    assert f"torch reads {key}='{value}' as it loads: fix or unset it." in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_path_where_nothing_can_be_created_is_refused_though_access_allows_it(tmp_path):
    """As root, access() calls every directory writable: output_dir=/sys/x or model.export_hf=/proc/x
    passed the preflight and failed at rank 0 (the export: after training) with a raw errno line.
    A folder is now made (and removed) where the run will create one."""
    from hybridpar.train.run.directory import _write_problem, check_output_dir

    for root in ("/proc", "/sys"):
        if Path(root).is_dir():
            with pytest.raises(ValueError) as error:
                check_output_dir(f"{root}/hybridpar-x")
            assert f"{root} does not let a folder be created in it (" in _one_line(error)
    assert _write_problem(tmp_path / "new" / "run", "dir") is None and sorted(os.listdir(tmp_path)) == []
    export = ["train", "--dry-run", "--config", CONFIG, *TINY, "model.export_architecture=NemotronHForCausalLM",
              "model.overrides.rotary_fraction=0.0", f"output_dir={tmp_path / 'o'}"]
    if Path("/proc").is_dir():
        code, said = _cli(*export, "model.export_hf=/proc/hybridpar-export")
        assert code == 2 and "model.export_hf: '/proc/hybridpar-export' cannot be written: /proc does not" in said
    assert _cli(*export, f"model.export_hf={tmp_path / 'export'}")[0] == 0 and sorted(os.listdir(tmp_path)) == []


def test_a_pack_past_a_learned_position_table_is_refused_by_the_preflight(tmp_path):
    """data.pack_size=128 on a GPT-2 of 64 positions passed --dry-run (and the launcher): the
    check ran only on the loaded model, inside the worker. The meta model is checked too, and
    so is train.sample's prompt plus max_new_tokens."""
    import transformers as hf

    from hybridpar.config import load_config
    from hybridpar.train.preflight import validate_layout

    hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=260, n_positions=64, bos_token_id=1,
                                     eos_token_id=2)).save_pretrained(tmp_path / "gpt2")
    config = load_config(CONFIG, [*TINY, f"model.hf_path={tmp_path / 'gpt2'}", "data.pack_size=128"])
    with pytest.raises(ValueError) as error:
        validate_layout(config, 1)
    assert _one_line(error).startswith("data.pack_size=128 is longer than the 64 positions GPT2LMHeadModel learned")
    validate_layout(load_config(CONFIG, [*TINY, f"model.hf_path={tmp_path / 'gpt2'}", "data.pack_size=64"]), 1)
    # train.sample past the table trained the whole run, then failed at the sample
    from hybridpar.train.sample import check_sample_prompt

    (tmp_path / "t.txt").write_text("hello world\n\nmore\n")
    text = [*TINY, f"model.hf_path={tmp_path / 'gpt2'}", "data.pack_size=64", "data.task=text", "data.task_options={}",
            f"data.path={tmp_path / 't.txt'}", "data.tokenizer=bytes"]
    config = load_config(CONFIG, [*text, "train.sample={prompt: hello, max_new_tokens: 100}"])
    with pytest.raises(ValueError) as error:
        check_sample_prompt(config, config.data, 260)
    assert "needs 105 positions, but the model learned 64 (transformer.wpe); ask for at most 59 new" in _one_line(error)
    config = load_config(CONFIG, [*text, "train.sample={prompt: hello, max_new_tokens: 59}"])
    check_sample_prompt(config, config.data, 260)


def test_yaml_nested_too_deep_is_one_line_not_a_recursion_error(tmp_path):
    """model.overrides=[[[...]]] 2000 deep (on the command line or in a config file) was PyYAML's
    RecursionError traceback; JSON had this bound already (round 5)."""
    from hybridpar.config import load_config

    deep = "[" * 2000 + "]" * 2000
    (tmp_path / "deep.yaml").write_text(f"model:\n  overrides: {deep}\n")
    for config, overrides in [(str(tmp_path / "deep.yaml"), []), (None, [f"model.overrides={deep}"]),
                              (None, ["model.overrides=" + "{a: " * 500 + "1" + "}" * 500])]:
        with pytest.raises(ValueError) as error:
            load_config(config, overrides)
        assert "values nested more than 64 levels deep" in _one_line(error)
    assert load_config(None, ["model.overrides={}", "train.betas=[0.9,0.95]"]).train.betas in ([0.9, 0.95], (0.9, 0.95))


def test_blank_rows_of_a_dataset_are_counted_like_every_other_empty_document(tmp_path):
    """hf_dataset dropped blank text rows without a word (jsonl, chat and prompt_completion say
    how many they skip), so a dataset of blank rows said "holds no document"; and an empty CSV
    cell was "holds NoneType, not a string" with no fix."""
    datasets = pytest.importorskip("datasets")
    from hybridpar.data.documents import file_documents

    datasets.Dataset.from_dict({"text": ["hello world", "  ", "", "more text"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.warns(UserWarning, match=r"2 of 4 documents \(task 'hf_dataset'\) have no text .* document 2\)"):
        assert len(file_documents("hf_dataset", tmp_path / "ds", None)) == 2
    datasets.Dataset.from_dict({"text": ["", " "]}).save_to_disk(str(tmp_path / "blank"))
    with pytest.raises(ValueError) as error:
        file_documents("hf_dataset", tmp_path / "blank", None)
    assert _one_line(error).startswith("every one of the 2 documents of data.path=")
    (tmp_path / "rows.csv").write_text('text\nhello\n""\n')
    with pytest.raises(ValueError) as error:
        file_documents("hf_dataset", tmp_path / "rows.csv", None)
    assert ("row 2 of 2 (counted from 1; a CSV header is no row): column 'text' holds nothing (null: an empty "
            "cell?), not a string; fill it or remove") in _one_line(error)


def test_an_export_target_that_is_a_link_to_an_empty_folder_receives_the_export(tmp_path):
    """model.export_hf=<a symbolic link to an empty folder> passed every check, trained, then failed
    at the rename ("Not a directory") and advised freeing space. The link is followed."""
    from hybridpar.train.run.export import write_export

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    write_export(tmp_path / "link", lambda staging: (staging.mkdir(), (staging / "config.json").write_text("{}")), None)
    assert (tmp_path / "link").is_symlink() and sorted(os.listdir(tmp_path / "real")) == ["config.json"]
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]  # no staging folder left behind


def test_a_lock_file_or_run_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    """output_dir/.hybridpar.lock as a symbolic link to a user's file: the lock truncated that file
    and wrote a pid into it (a directory there was "[Errno 21] Is a directory"); metrics.jsonl or
    loss_curve.png as a link would be written through the same way. Refused before any write."""
    from hybridpar.config import load_config
    from hybridpar.train.run.directory import OutputDirLock, check_run_paths

    precious = tmp_path / "precious.txt"
    precious.write_text("precious\n")
    cases = [(".hybridpar.lock", "symlink", "which is a symbolic link (to "),
             (".hybridpar.lock", "dir", "which is not a regular file (a directory, pipe or device)"),
             ("metrics.jsonl", "symlink", "it is a symbolic link (to "),
             ("loss_curve.png", "symlink", "it is a symbolic link (to ")]
    for index, (name, kind, expected) in enumerate(cases):
        out = tmp_path / f"run{index}"
        out.mkdir()
        (out / name).symlink_to(precious) if kind == "symlink" else (out / name).mkdir()
        if name == "loss_curve.png":
            (out / ".hybridpar.lock").write_text("")  # an earlier run's directory
        with pytest.raises(ValueError) as error:
            check_run_paths(load_config(CONFIG, [*TINY, f"output_dir={out}", "plot=true"]))
        assert expected in _one_line(error), name
        if name == ".hybridpar.lock":
            with pytest.raises(ValueError):
                OutputDirLock(out).acquire()
    assert precious.read_text() == "precious\n"


def test_retention_removes_a_linked_checkpoint_s_link_not_what_it_points_to(tmp_path):
    """checkpoints/step_00000001 as a symbolic link to a checkpoint kept elsewhere: retention
    deleted the manifest and files through the link, leaving a damaged checkpoint outside the
    run's folder (and the dangling link). Only the link goes."""
    from hybridpar.train.run.checkpoint import prune
    from tests.train.run.test_directory import fake_checkpoint

    kept = fake_checkpoint(tmp_path / "elsewhere", 1)
    directory = tmp_path / "run" / "checkpoints"
    directory.mkdir(parents=True)
    (directory / kept.name).symlink_to(kept)
    fake_checkpoint(directory, 2)
    assert [p.name for p in prune(directory, "run-a", keep=1)] == ["step_00000001"]
    assert sorted(os.listdir(directory)) == ["step_00000002"]
    assert sorted(os.listdir(kept)) == sorted(os.listdir(directory / "step_00000002"))  # intact, manifest included


def test_a_config_file_of_megabytes_is_refused_before_it_is_parsed(tmp_path):
    """--config pointed at a data file of gigabytes was read whole and parsed by PyYAML for minutes
    (it looked like a hang) before its error; a config is a few KB."""
    from hybridpar.config import MAX_CONFIG_BYTES, load_config

    big = tmp_path / "data.jsonl"
    with open(big, "w") as handle:
        handle.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(ValueError) as error:
        load_config(str(big), [])
    assert f"has {MAX_CONFIG_BYTES + 1:,} bytes, more than the" in _one_line(error) and "is it a data file?" in str(error.value)


def test_generate_checkpoint_that_does_not_exist_or_is_a_file_says_so(tmp_path):
    """--checkpoint /nonexistent (or a file) said it "holds no complete training checkpoint"."""
    from hybridpar.generate import checkpoint_to_load

    (tmp_path / "file.txt").write_text("x")
    for path, said in [(tmp_path / "missing", "does not exist"), (tmp_path / "file.txt", "is a file, not a folder")]:
        with pytest.raises(ValueError) as error:
            checkpoint_to_load(path)
        assert _one_line(error).startswith(f"--checkpoint {path} {said}; pass a training checkpoint")
    with pytest.raises(ValueError, match="holds no complete training checkpoint"):
        checkpoint_to_load(tmp_path)
