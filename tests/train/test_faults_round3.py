"""Faults, round 3 (issue 24), one test per class, on real files and real processes: every
checkpoint byte verified, data edits noticed on resume, every path written checked first,
non-finite or truncated weights refused before step 1, and one bounded line for every bad
input (generate, plan, config, YAML, MASTER_PORT, pack sizes, JSONL records)."""

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridpar.config import RULES, ConfigError, load_config
from tests.distributed.harness import run_ranks
from tests.train.fault_probes import SHORT, cli_in_child, one_process_cli

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "configs" / "tiny-hybrid.yaml")
TINY = ["parallel.cp=1", "parallel.tp=1", "data.pack_size=128", "train.eval_every=0", "plot=false", "tensorboard=false",
        "model.preset=tiny"]


def hybridpar(*args: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridpar", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def one_line_error(result: subprocess.CompletedProcess, code: int = 2) -> str:
    """The single ``hybridpar: error:`` line of a run that failed on bad input (no traceback)."""
    assert result.returncode == code, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("hybridpar: error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors[0]) < SHORT
    return errors[0]


def tiny_hf(path: Path, nan_in: str | None = None) -> Path:
    from hybridpar.models.hf.checkpoint import save_hf
    from hybridpar.models.hybrid import HybridConfig, HybridLM

    model = HybridLM(HybridConfig.from_preset("tiny", rotary_fraction=0.0))
    if nan_in:
        with torch.no_grad():
            dict(model.named_parameters())[nan_in].view(-1)[5] = float("nan")
    save_hf(model, path, architecture="NemotronHForCausalLM")
    return path


# -- 1, 2, resumed weights: every checkpoint byte verified; data content compared on resume ----------


def test_every_checkpoint_file_is_hashed_whatever_its_size_and_an_altered_one_is_never_loaded(tmp_path):
    """A 65 MiB shard (over the old 64 MiB limit) with 64 KiB overwritten in place, size unchanged."""
    from hybridpar.train.run.checkpoint import (MANIFEST, _VERIFIED, _write_manifest, checkpoint_path,
                                                incomplete_reason, latest_checkpoint)

    directory = tmp_path / "checkpoints"
    for step in (1, 2):
        path = checkpoint_path(directory, step)
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(os.urandom(65 * 2**20))
        (path / ".metadata").write_bytes(b"metadata")
        _write_manifest(path)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format"] == 2 and set(manifest["sha256"]) == set(manifest["files"]) == {"__0_0.distcp", ".metadata"}
    with open(path / "__0_0.distcp", "r+b") as handle:
        handle.seek(40 * 2**20)
        handle.write(bytes(64 * 1024))
    _VERIFIED.clear()  # a new process: nothing remembered
    assert "__0_0.distcp does not match the sha256" in incomplete_reason(path)
    assert incomplete_reason(path, verify=False) is None  # listing and pruning check sizes only
    assert latest_checkpoint(directory) == checkpoint_path(directory, 1)  # auto: falls back to the intact one


def _resume_cases(rank, world_size, root):
    """Real one-rank trainers: an altered shard, a NaN weight under a valid manifest, a data file
    edited in place (same size)."""
    from hybridpar.train.run.checkpoint import CheckpointError, save_checkpoint
    from hybridpar.train.trainer import Trainer

    root = Path(root)
    docs = root / "docs.txt"
    docs.write_text("\n\n".join(f"alpha beta {i} gamma delta alpha" for i in range(30)))

    def trainer(directory, *overrides):
        return Trainer(load_config(DEFAULT, TINY + ["data.task=text", f"data.path={docs}", "data.task_options={}",
                                                    "data.packs_per_step=1", f"output_dir={directory}", *overrides]),
                       torch.device("cpu"))

    def refused(directory, *overrides) -> str:
        t = trainer(directory, *overrides)
        try:
            t.resume()
        except CheckpointError as error:
            return str(error)
        finally:
            t._lock and t._lock.release()
        return "resumed"

    out = {}
    first = trainer(root / "run", "train.steps=1")
    first.fit()
    step = root / "run" / "checkpoints" / "step_00000001"
    manifest = json.loads((step / "manifest.json").read_text())
    out["all_hashed"] = manifest["format"] == 2 and set(manifest["sha256"]) == set(manifest["files"])
    out["sources"] = json.loads((step / "run.json").read_text())["data"]["sources"]["data.path"]
    # The data file edited in place, same size: refused by default, a notice under data.on_change=warn.
    docs.write_text(docs.read_text().replace("alpha", "ALPHA"))
    out["data_refused"] = refused(root / "run", "train.steps=2")
    warned = trainer(root / "run", "train.steps=2", "data.on_change=warn")
    warned.resume()
    warned._lock.release()
    out["data_warned"] = warned.start_step
    # A shard altered in place (size unchanged), asked for by path: refused naming the file.
    shard = next(step.glob("__0_*.distcp"))
    original = shard.read_bytes()
    shard.write_bytes(original[:100] + bytes(64) + original[164:])
    out["altered"] = refused(root / "run", "train.steps=2", "data.on_change=warn", f"checkpoint.resume={step}")
    # A NaN weight in a checkpoint whose manifest matches it (written without the finite check).
    t = trainer(root / "nan", "train.steps=1", "data.on_change=warn")
    t.resume()
    with torch.no_grad():
        dict(t.model.named_parameters())["backbone.layers.0.mixer.D"].view(-1)[0] = float("nan")
    save_checkpoint(root / "nan" / "checkpoints", 1, t.model, t.optimizer, t.scheduler, run_info={"run_id": t.run_id})
    t._lock.release()
    out["nan"] = refused(root / "nan", "train.steps=2", "data.on_change=warn")
    return out


def test_resume_verifies_every_file_the_data_content_and_finite_weights(tmp_path):
    out = run_ranks(1, _resume_cases, str(tmp_path), timeout_s=300)[0]
    assert out["all_hashed"] and len(out["sources"]["sha256"]) == 64
    assert "the data changed since checkpoint" in out["data_refused"] and "docs.txt" in out["data_refused"]
    assert "data.on_change=warn" in out["data_refused"] and "checkpoint.resume=null" in out["data_refused"]
    assert out["data_warned"] == 1  # resumed at step 1 on the new content
    assert "__0_0.distcp does not match the sha256" in out["altered"]
    assert "non-finite value in model.backbone.layers.0.mixer.D" in out["nan"], out["nan"]


# -- 4: every path the run writes, checked before the first step -------------------------------------


@pytest.mark.parametrize("setup, overrides, key", [
    (lambda t: (t / "file").write_text("x"), ["output_dir={t}/file/run"], "output_dir="),
    (lambda t: (t / "file").write_text("x"), ["model.export_hf={t}/file/export"], "model.export_hf"),
    (lambda t: (t / "run" / "checkpoints").parent.mkdir() or (t / "run" / "checkpoints").write_text("x"), [],
     "checkpoints/"),
    (lambda t: (t / "run" / "metrics.jsonl").mkdir(parents=True), [], "metrics.jsonl"),
    (lambda t: (t / "run").mkdir() or (t / "run" / "tensorboard").write_text("x"), ["tensorboard=true"], "tensorboard"),
    (lambda t: (t / "run" / "loss_curve.png").mkdir(parents=True), ["plot=true"], "loss_curve.png"),
])
def test_every_path_a_run_writes_is_checked_before_training(tmp_path, setup, overrides, key):
    from hybridpar.train.run.directory import check_run_paths

    setup(tmp_path)
    config = load_config(DEFAULT, TINY + [f"output_dir={tmp_path}/run"] + [o.format(t=tmp_path) for o in overrides])
    with pytest.raises(ConfigError, match="cannot") as error:
        check_run_paths(config)
    assert key in str(error.value) and len(str(error.value)) < SHORT


def test_an_export_under_a_regular_file_is_refused_before_any_step(tmp_path, capsys):
    from hybridpar.cli import main

    (tmp_path / "file").write_text("x")
    code = main(["train", "--config", DEFAULT, *TINY, f"output_dir={tmp_path}/run", "train.steps=1",
                 f"model.export_hf={tmp_path}/file/export", "model.export_architecture=NemotronHForCausalLM",
                 "model.overrides={rotary_fraction: 0.0}"])
    out = capsys.readouterr()
    assert code == 2 and out.err.startswith("hybridpar: error: model.export_hf") and out.err.count("\n") == 1
    assert "is a file, not a directory" in out.err and "step " not in out.out
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- 3, 5: Hugging Face weights: finite, and whole ----------------------------------------------------


def test_non_finite_hf_weights_are_refused_at_load_naming_the_tensor(tmp_path):
    from hybridpar.models.hf.causal_lm import load_causal_lm

    path = tiny_hf(tmp_path / "nan", nan_in="backbone.embeddings.weight")
    for backend, name in (("hybrid", "backbone.embeddings.weight"), ("transformers", "model.embeddings.weight")):
        with pytest.raises(ValueError, match=rf"holds non-finite weights: {name} \(1 NaN, 0 inf"):
            load_causal_lm(path, backend)
    result = cli_in_child("train", "--config", DEFAULT, *TINY, f"output_dir={tmp_path}/run", f"model.hf_path={path}",
                          "data.task=mqar", "data.task_options={vocab_size: 16, min_len: 16, max_len: 48, num_kv_pairs: 2}")
    assert "backbone.embeddings.weight" in one_line_error(result) and "step 1" not in result.stdout
    assert "lr" not in result.stderr.split("error:")[1]  # the weights are named, not the learning rate


@pytest.mark.parametrize("damage", ["half", "eight_bytes", "header_only", "appended", "not_json"])
def test_a_truncated_or_damaged_safetensors_file_is_one_line(tmp_path, damage):
    from hybridpar.models.hf.causal_lm import load_causal_lm

    path = tiny_hf(tmp_path / "hf")
    file = path / "model.safetensors"
    data = file.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    file.write_bytes({"half": data[:len(data) // 2], "eight_bytes": data[:8], "header_only": data[:header],
                      "appended": data + b"extra", "not_json": data[:8] + b"x" * (len(data) - 8)}[damage])
    for backend in ("hybrid", "transformers"):
        with pytest.raises(ValueError, match="model.safetensors cannot be read: ") as error:
            load_causal_lm(path, backend)
        assert "\n" not in str(error.value) and len(str(error.value)) < SHORT


def test_damaged_tokenizer_files_are_one_line_naming_the_directory(tmp_path):
    from hybridpar.data.tokenizers import load_pretrained_tokenizer
    from tests.data.bpe import train_tiny_bpe

    train_tiny_bpe(tmp_path / "tok")
    file = tmp_path / "tok" / "tokenizer.json"
    text = file.read_text()
    for damaged in (text[:len(text) // 2], '{"model": {"type": "BPE"}}'):
        file.write_text(damaged)
        with pytest.raises(ValueError, match=r"the tokenizer in '.*tok' cannot be loaded .*copy them again") as error:
            load_pretrained_tokenizer(tmp_path / "tok")
        assert "\n" not in str(error.value) and len(str(error.value)) < SHORT


# -- 6: generate: a tiny temperature is greedy; every bad option one line ------------------------------


def test_generate_tiny_temperature_is_greedy_and_bad_options_are_one_line(tmp_path, capsys):
    from argparse import Namespace

    from hybridpar.generate import check_generate_arguments
    from hybridpar.models.generation import sample_next

    logits = torch.tensor([[0.0, 3.0, 2.9, -1e4], [1e30, 0.0, -1e30, 5.0]])
    for temperature in (1e-300, 5e-324, 1e-6, 1e-4):
        assert sample_next(logits, temperature).tolist() == [1, 0]
    args = dict(max_new_tokens=4, temperature=0.0, top_p=1.0, seed=None, hf_path="x", checkpoint=None,
                tokenizer="auto", backend="auto", dtype=None, prompt="hi")
    for bad, flag in ((dict(temperature=math.inf), "--temperature inf"), (dict(temperature=math.nan), "--temperature nan"),
                      (dict(top_p=math.nan), "--top-p nan"), (dict(seed=2**64), "--seed 18446744073709551616"),
                      (dict(seed=-1), "--seed -1"), (dict(max_new_tokens=10**20), "--max-new-tokens 1000"),
                      (dict(hf_path="x" * 5000), "--hf-path 'xxx"), (dict(tokenizer="y" * 300), "--tokenizer 'yyy"),
                      (dict(backend="z" * 5000), "--backend 'zzz"), (dict(dtype="w" * 5000), "--dtype 'www")):
        with pytest.raises(ValueError) as error:
            check_generate_arguments(Namespace(**{**args, **bad}))
        assert str(error.value).startswith(flag) and len(str(error.value)) < 400, str(error.value)
    from hybridpar.cli import main

    path = tiny_hf(tmp_path / "hf")
    common = ["generate", "--hf-path", str(path), "--prompt", "hello", "--max-new-tokens", "3", "--json"]
    assert main(common) == 0
    greedy = json.loads(capsys.readouterr().out)
    assert main([*common, "--temperature", "1e-300", "--seed", "1"]) == 0  # was: probability tensor contains nan
    assert json.loads(capsys.readouterr().out)["new_ids"] == greedy["new_ids"]
    assert main([*common, "--temperature", "inf"]) == 2
    assert capsys.readouterr().err == ("hybridpar: error: --temperature inf must be a finite number >= 0 (0 is greedy, "
                                       "as is anything below 1e-05).\n")


# -- 7: a busy MASTER_PORT in a one-process run --------------------------------------------------------


def test_a_busy_master_port_in_a_one_process_run_is_replaced_and_a_bad_one_exits_2(tmp_path):
    """One real run: MASTER_PORT held by a listening socket (and documents longer than a pack)."""
    from hybridpar.train.preflight import one_process_rendezvous

    (tmp_path / "long.txt").write_text(("word " * 100 + "\n\n") * 20)  # paragraphs longer than a pack: split
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cli_in_child("train", "--config", DEFAULT, *TINY, f"output_dir={tmp_path}/run", "train.steps=1",
                              "checkpoint.every=-1", "data.task=text", f"data.path={tmp_path}/long.txt",
                              "data.task_options={}", env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"hybridpar: warning: MASTER_PORT={port} is in use" in result.stderr and "Traceback" not in result.stderr
    # 12: the packer's split notice is one notice line, not a raw UserWarning
    assert re.search(r"^hybridpar: warning: pack_documents\(pack_size=128\): split \d+ documents", result.stderr, re.M)
    assert "UserWarning" not in result.stderr and "warnings.warn" not in result.stderr
    for bad in ("abc", "0", "70000", "99999999999999999999"):
        os.environ["MASTER_PORT"] = bad
        try:
            with pytest.raises(ConfigError, match=r"MASTER_PORT=.* is not a port number: .* \[1, 65535\]"):
                one_process_rendezvous()
        finally:
            del os.environ["MASTER_PORT"]


# -- 8: a pack larger than int32 cu_seqlens or than memory ---------------------------------------------


def test_a_pack_beyond_int32_or_memory_is_refused_at_once(tmp_path, capsys):
    from hybridpar.train.preflight import check_pack_memory, model_config

    with pytest.raises(ConfigError, match=r"data.pack_size=2147483648 is invalid: it must be an integer >= 1 and <= 2\*\*31-1"):
        load_config(DEFAULT, TINY + ["data.pack_size=2147483648"])
    config = load_config(DEFAULT, TINY + ["data.pack_size=2147483646"])
    with pytest.raises(ConfigError, match=r"data.pack_size=2147483646 .* needs at least [\d,.]+ GiB per rank"):
        check_pack_memory(config, model_config(config), 1)
    check_pack_memory(load_config(DEFAULT, TINY), model_config(config), 1)  # the tiny job fits
    for many in (["train.eval_every=1", "train.eval_packs=16777216"], ["data.packs_per_step=16777216"],
                 ["data.task_options={max_len: 99999999999}"]):  # evaluation packs, packs per step, documents
        with pytest.raises(ConfigError, match=r"needs at least [\d,.]+ GiB per rank"):
            check_pack_memory(load_config(DEFAULT, TINY + many), model_config(config), 1)
    from hybridpar.train.batches import DataError, make_task

    with pytest.raises(DataError, match=r"data.task_options.num_kv_pairs=\[2, 1099511627776\] is invalid: its integers "
                                        r"must be in \[0, 2\*\*31-1\]"):
        make_task(load_config(DEFAULT, TINY + ["data.task_options={num_kv_pairs: [2, 1099511627776]}"]).data, 256)
    from hybridpar.cli import main

    (tmp_path / "docs.txt").write_text("some text\n\nmore text\n")
    code = main(["train", "--config", DEFAULT, *TINY, "data.task=text", f"data.path={tmp_path}/docs.txt",
                 "data.task_options={}", "data.pack_size=1073741824", f"output_dir={tmp_path}/run"])
    err = capsys.readouterr().err  # was: memory grew, then an allocation traceback
    assert code == 2 and err.startswith("hybridpar: error: data.pack_size=1073741824") and err.count("\n") == 1


# -- 9, 10: YAML aliases bounded, values in messages cut, every integer key with its range -------------


def test_an_alias_bomb_is_refused_in_a_short_message_and_quoted_values_are_bounded(tmp_path):
    from hybridpar.train.preflight import model_config

    bomb = 'train:\n  steps:\n    - &a ["x","x","x","x","x","x","x","x","x"]\n'
    for name, previous in zip("bcdefgh", "abcdefg"):
        bomb += f"    - &{name} [{','.join(['*' + previous] * 9)}]\n"
    (tmp_path / "bomb.yaml").write_text(bomb)
    (tmp_path / "loop.yaml").write_text("train: &t {steps: 3, again: *t}\n")
    for file in ("bomb.yaml", "loop.yaml"):
        with pytest.raises(ConfigError) as error:
            load_config(tmp_path / file)
        assert len(str(error.value)) < SHORT and ("alias bomb" in str(error.value) or "recursive" in str(error.value))
    huge = "[" + ",".join(["1"] * 10_000) + "]"  # 20,001 characters, 10x SHORT (YAML parses a long list slowly)
    for override in (f"output_dir={huge}", f"train.betas={huge}", f"data.task={'q' * 100_000}",
                     f"{'k' * 20_000}=1", f"train.steps={'9' * 5000}", f"model.overrides={{pattern: {'Q' * 100_000}}}",
                     f"model.overrides={{{'u' * 100_000}: 1}}"):
        with pytest.raises(ConfigError) as error:
            model_config(load_config(DEFAULT, TINY + [override]))
        assert len(str(error.value)) < SHORT and "\n" not in str(error.value)


INT_KEYS = sorted(key for key, rule in RULES.items() if "integer" in str(rule.text) and key != "train.sample")


@pytest.mark.parametrize("key", INT_KEYS)
def test_every_integer_key_names_its_range(key):
    with pytest.raises(ConfigError, match=rf"^{key}=99999999999999999999999 is invalid: it must be .*integer .*<= 2\*\*"):
        load_config(DEFAULT, [f"{key}=99999999999999999999999"])


def test_seeds_take_what_torch_takes():
    assert load_config(DEFAULT, [f"train.seed={2**64 - 1}"]).train.seed == 2**64 - 1
    torch.manual_seed(2**64 - 1)
    with pytest.raises(ConfigError, match=r"train.seed=18446744073709551616 .* an integer >= 0 and <= 2\*\*64-1"):
        load_config(DEFAULT, [f"train.seed={2**64}"])
    with pytest.raises(ConfigError, match=r"train.sample=.* is invalid: .*seed \(an integer in \[0, 2\*\*64-1\]"):
        load_config(DEFAULT, [f"train.sample={{prompt: a, seed: {2**64}}}"])


# -- 11: every device figure of plan finite and positive -----------------------------------------------


@pytest.mark.parametrize("flag", ["--device-tflops", "--device-efficiency", "--hbm-tbps", "--link-gbps",
                                  "--network-gbps", "--fit"])
def test_plan_device_figures_must_be_finite_and_positive(flag, capsys):
    from hybridpar.cli import main

    for value in ("inf", "nan", "0", "-1"):
        assert main(["plan", "--config", DEFAULT, *TINY, flag, value]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hybridpar: error: {flag} ") and err.count("\n") == 1, err


# -- 12: a directory as the config, the packer's notice, a JSONL text that is not a string ----------------


def test_smaller_cases_say_what_is_wrong_precisely(tmp_path):
    from hybridpar.data.sources import jsonl_documents

    with pytest.raises(ConfigError, match=r"is a directory, not a YAML file"):
        load_config(tmp_path)
    for value, kind in (("5", "a JSON number (5)"), ("null", "null (None)"), ('["a"]', "a JSON array (['a'])"),
                        ("true", "a JSON boolean (True)")):
        (tmp_path / "records.jsonl").write_text('{"text": "fine"}\n{"text": ' + value + "}\n")
        with pytest.raises(ValueError) as error:
            jsonl_documents(tmp_path / "records.jsonl")
        assert f"records.jsonl:2 has no string field 'text': its value is {kind}, not a string" in str(error.value)
    (tmp_path / "records.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"has no string field 'text' \(keys: \['body'\]\)"):
        jsonl_documents(tmp_path / "records.jsonl")


def test_resuming_a_run_already_at_train_steps_says_nothing_is_left(tmp_path):
    """A checkpoint at step 2 and train.steps=1: no step runs, and a notice says why (it was silent).
    Both runs are one-process command lines, one after the other in one harness child."""
    run = ["train", "--config", DEFAULT, *TINY, "data.task_options={}", f"output_dir={tmp_path}"]
    first, again = run_ranks(1, one_process_cli, [[*run, "train.steps=2"], [*run, "train.steps=1"]], timeout_s=240)[0]
    assert first[0] == 0 and "step     2 |" in first[1], first[1][-2000:] + first[2][-2000:]
    assert again[0] == 0 and "step     1 |" not in again[1], again[1][-2000:]
    assert "the checkpoint is at step 2, and train.steps=1: nothing is left to train" in again[2], again[2][-2000:]
