"""The text job (configs/text-stdlib.yaml): the python_stdlib corpus and its held-out split, a BPE
trained for the run once and reused, the unigram baseline, the printed sample, and refusals.

The runs use a small fake "standard library" (``data.path``), a 512-id vocabulary and a few steps.
"""

import contextlib
import io
import json
import math
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hybridpar.config import load_config
from hybridpar.data.stdlib import stdlib_corpus, stdlib_root
from hybridpar.train.baseline import unigram_loss
from hybridpar.train.preflight import validate_run
from tests.distributed.harness import run_ranks

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "text-stdlib.yaml")


def fake_stdlib(root: Path, files: int = 40) -> Path:
    """``files`` small modules in a few packages, plus what the corpus must skip."""
    for i in range(files):
        package = root / f"pkg{i % 4}"
        package.mkdir(parents=True, exist_ok=True)
        (package / f"mod{i}.py").write_text(
            f'"""Module {i}."""\n\nimport os\n\n\ndef function_{i}(value, count={i}):\n    """Return value times count."""\n'
            f"    total = 0\n    for step in range(count):\n        total += value * step\n    return total\n\n\n"
            f"class Thing{i}:\n    def __init__(self, name):\n        self.name = name\n\n    def __repr__(self):\n"
            f"        return f'Thing{i}({{self.name!r}})'\n")
    (root / "test").mkdir(exist_ok=True)
    (root / "test" / "test_skipped.py").write_text("def test_x():\n    assert True\n")
    (root / "huge.py").write_text("x = 1\n" * 20_000)  # 120 KB: over max_file_bytes
    (root / "empty.py").write_text("")
    return root


def run_argv(corpus: Path, output: Path, *extra: str) -> list[str]:
    return ["train", "--config", CONFIG, f"data.path={corpus}", f"output_dir={output}",
            "model.overrides={vocab_size: 512, rotary_fraction: 0.0}",  # rotary 0: exportable as NemotronH
            "data.pack_size=128", "data.packs_per_step=2", "train.eval_packs=2", "train.eval_every=2", "train.log_every=1",
            "train.warmup_steps=1", "checkpoint.every=2", "tensorboard=false", "plot=false",
            "train.sample={prompt: 'def ', max_new_tokens: 6}", *extra]


def printed_sample(stdout: str) -> str:
    """The text after ``sample (N tokens, greedy):`` (the run's last output with plot=false)."""
    match = re.search(r"^sample \(\d+ tokens, greedy\):\n(.*)", stdout, re.DOTALL | re.MULTILINE)
    assert match, stdout
    return match[1].strip()


def hybridpar(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridpar", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


# -- the corpus ----------------------------------------------------------------------------------


def test_held_out_split_is_by_file_deterministic_and_disjoint(tmp_path):
    root = fake_stdlib(tmp_path)
    corpus = stdlib_corpus(root, eval_fraction=0.25)
    train, held = {f.path for f in corpus.train}, {f.path for f in corpus.held_out}
    assert not train & held and len(train | held) == 40  # test/, huge.py and empty.py are skipped
    assert 0 < len(held) < 20
    again = stdlib_corpus(root, eval_fraction=0.25)
    assert again.train == corpus.train and again.held_out == corpus.held_out and again.fingerprint() == corpus.fingerprint()
    capped = stdlib_corpus(root, eval_fraction=0.25, max_bytes=3000)  # a cap changes which files, not their side
    assert 0 < len(capped.train) + len(capped.held_out) < 40
    assert {f.path for f in capped.held_out} <= held and {f.path for f in capped.train} <= train
    assert sum(len(f.text.encode()) for f in capped.train + capped.held_out) <= 3000


def test_the_default_corpus_is_this_pythons_standard_library():
    root = stdlib_root(None)
    assert root == Path(sysconfig.get_paths()["stdlib"])
    corpus = stdlib_corpus(max_bytes=300_000)
    assert len(corpus.train) > 10 and corpus.held_out
    assert not any(part in ("test", "site-packages") for f in corpus.train for part in f.path.split("/")[:-1])


# -- the unigram baseline ------------------------------------------------------------------------


def test_unigram_baseline_on_a_hand_example():
    train = [{"labels": [0, 0, 1, -100]}, {"labels": [-100, 3]}]  # counts [2, 1, 0, 1], N = 4
    held_out = [{"labels": [0, 2, -100]}]
    # add-one over V = 4 ids: p(0) = 3/8, p(2) = 1/8
    expected = -(math.log(3 / 8) + math.log(1 / 8)) / 2
    assert unigram_loss(train, held_out, vocab_size=4) == pytest.approx(expected, rel=1e-12)
    assert math.isnan(unigram_loss(train, [{"labels": [-100]}], vocab_size=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        unigram_loss([{"labels": [4]}], held_out, vocab_size=4)


# -- one command: tokenizer once, baseline, sample; resume reuses the tokenizer ------------------


def _train(rank, world_size, argv):
    """``hybridpar <argv>`` in a harness rank: ``(exit status, what it printed)``."""
    from hybridpar.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def test_bpe_is_trained_once_by_the_launcher_reused_on_resume_and_the_sample_matches_generate(tmp_path):
    corpus, output = fake_stdlib(tmp_path / "lib"), tmp_path / "run"
    export = tmp_path / "export"
    first = hybridpar(*run_argv(corpus, output, "train.steps=2", f"model.export_hf={export}",
                                "model.export_architecture=NemotronHForCausalLM"), "--nproc-per-node", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count("trained a byte-level BPE tokenizer (vocab 391 of the model's 512") == 1  # by the launcher, once
    tokenizer = output / "tokenizer"
    stamp = json.loads((tokenizer / "hybridpar_bpe.json").read_text())
    assert stamp["vocab_size"] == 512 and stamp["train_files"] == len(stdlib_corpus(corpus).train)
    trained = (tokenizer / "tokenizer.json").read_bytes(), (tokenizer / "tokenizer.json").stat().st_mtime_ns
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["unigram_loss"] > 0 and "(unigram " in first.stdout
    assert printed_sample(first.stdout).startswith("def ")
    assert (export / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()  # export carries it

    # resumed (here on one process, one step more): the tokenizer is reused, never retrained
    [(code, printed)] = run_ranks(1, _train, run_argv(corpus, output, "train.steps=3", "parallel.dp_shard=1"),
                                  timeout_s=300)
    assert code == 0 and "trained a byte-level BPE" not in printed and "at step 2" in printed, printed
    assert ((tokenizer / "tokenizer.json").read_bytes(), (tokenizer / "tokenizer.json").stat().st_mtime_ns) == trained

    from hybridpar.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the run's tokenizer, found from the checkpoint
        assert main(["generate", "--checkpoint", str(output), "--prompt", "def ", "--max-new-tokens", "6"]) == 0
    assert out.getvalue().strip() == printed_sample(printed)


def test_without_the_launcher_rank_0_trains_the_tokenizer_for_every_rank(tmp_path):
    corpus, output = fake_stdlib(tmp_path / "lib"), tmp_path / "run"
    argv = run_argv(corpus, output, "train.steps=1", "parallel.dp_shard=1", "parallel.cp=2", "train.sample=null")
    results = run_ranks(2, _train, argv, timeout_s=300)
    assert [code for code, _ in results] == [0, 0]
    assert results[0][1].count("trained a byte-level BPE tokenizer") == 1 and "trained" not in results[1][1]
    assert (output / "tokenizer" / "hybridpar_bpe.json").is_file()
    assert not list(output.glob(".tokenizer.tmp-*"))


# -- refusals -------------------------------------------------------------------------------------


def _preflight(tmp_path, *overrides):
    config = load_config(CONFIG, [f"output_dir={tmp_path / 'run'}", *overrides])
    return validate_run(config, "train", config.parallel.dp_shard)


@pytest.mark.parametrize("overrides, message", [
    (["data.task=mqar", "train.sample=null"], "data.tokenizer=bpe trains a tokenizer on the training documents"),
    (["model.overrides={vocab_size: 300}"], "less than 512"),
    (["data.task=mqar", "data.tokenizer=auto"], "train.sample continues a text prompt"),
    (["data.task_options={max_lines: 3}"], "do not apply to data.task='python_stdlib'"),
    (["data.task_options={eval_fraction: 1.5}"], "eval_fraction=1.5 is invalid"),
    (["data.path=/nonexistent/lib"], "is not a directory"),
])
def test_bad_combinations_are_refused_before_anything_runs(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _preflight(tmp_path, *overrides)
    assert not (tmp_path / "run" / "tokenizer").exists()


def test_bad_sample_settings_are_config_errors():
    for bad in ("{prompt: x, max_new_tokens: 0}", "{prompt: x, length: 3}", "{max_new_tokens: 3}"):
        with pytest.raises(ValueError, match=r"train.sample=.* is invalid: it must be null or a mapping with prompt "
                                             r"\(text, required\), max_new_tokens \(an integer >= 1"):
            load_config(CONFIG, [f"train.sample={bad}"])
    with pytest.raises(ValueError, match=r"train.sample=\['def'\] is invalid: it must be a mapping"):
        load_config(CONFIG, ["train.sample=[def]"])
    from hybridpar.config_rules import sample_problem

    assert sample_problem({"prompt": "x", "length": 3}) == "unknown key(s) ['length']"
    assert sample_problem({"prompt": "x", "top_p": 0}) == "top_p must be in (0, 1]"


def test_a_tokenizer_trained_for_other_settings_is_never_replaced(tmp_path):
    corpus = fake_stdlib(tmp_path / "lib")
    _preflight(tmp_path, f"data.path={corpus}", "model.overrides={vocab_size: 512}")
    stamp = (tmp_path / "run" / "tokenizer" / "hybridpar_bpe.json").read_text()
    with pytest.raises(ValueError, match=r"trained for other settings \(vocab_size 512 -> 600"):
        _preflight(tmp_path, f"data.path={corpus}", "model.overrides={vocab_size: 600}")
    (corpus / stdlib_corpus(corpus).train[0].path).write_text("def changed():\n    return 1\n")  # the corpus changed
    with pytest.raises(ValueError, match="the corpus changed"):
        _preflight(tmp_path, f"data.path={corpus}", "model.overrides={vocab_size: 512}")
    assert (tmp_path / "run" / "tokenizer" / "hybridpar_bpe.json").read_text() == stamp


def test_file_documents_gives_every_file_training_files_first(tmp_path):
    from hybridpar.data.documents import file_documents

    root = fake_stdlib(tmp_path)
    corpus = stdlib_corpus(root)
    documents = file_documents("python_stdlib", root, None)  # bytes
    assert documents == [list(f.text.encode()) + [3] for f in corpus.train + corpus.held_out]
