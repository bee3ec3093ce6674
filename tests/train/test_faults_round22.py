"""Round 22 of fault hunting (docs/reliability.md, "Round 22"): the library used from one Python process many times (a
notebook, a sweep script, a test harness): runs one after the other, a failed or interrupted run then a good one; and
leftovers of earlier rounds (``export_lora`` of a partial state, ``hp.Document``, the measured step, ``check --packing``)."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import warnings

import pytest
import torch

from tests.train.fault_probes import cli_streams, one_line

TINY = ("model.preset=tiny", "train.log_every=1", "train.eval_every=0", "data.pack_size=64",
        "train.warmup_steps=0", "tensorboard=false")
PACK_NOTICE = "pack_documents(pack_size=64): split"


def _losses(out: str) -> list[str]:
    """The step lines' loss and gradient norm (their speed and memory vary)."""
    return re.findall(r"step +\d+ \| loss \S+ \| grad_norm \S+", out)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Runs on one OpenMP thread: on the shared cores a second one spins waiting and slows every step many times."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what a run sets (init_distributed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # and this process, for the models the tests build
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def svg_backend():
    """matplotlib's backend set to ``svg`` for the test, and put back as it was (not resolved) after it."""
    import matplotlib

    saved = dict.__getitem__(matplotlib.rcParams, "backend")
    dict.__setitem__(matplotlib.rcParams, "backend", "svg")
    yield matplotlib.rcParams
    dict.__setitem__(matplotlib.rcParams, "backend", saved)


def test_a_second_run_in_one_process_runs_as_the_first(tmp_path, monkeypatch, recwarn, svg_backend):
    """Before: ``hybridpar.cli.main`` called twice in one process (a sweep) left the first run's ``MASTER_ADDR`` and
    ``MASTER_PORT`` set, so the second said "MASTER_PORT=... is in use" of a port it never asked for; the packer's
    "split N documents" notice was said by the first run only (``PackStream._warned``); every run wrapped
    ``sys.excepthook`` once more (the caller's later tracebacks read "[rank0]: [rank0]: ..."); TF32 was left set
    through torch's new API, so ``torch.get_float32_matmul_precision()`` raised "mix of the legacy and new APIs"
    afterwards; torch's thread count, its default process-group timeout, a warning filter and the global random
    generator (seeded with ``train.seed``) stayed changed; and the loss curve switched matplotlib's backend to Agg (a
    notebook's plots stopped showing)."""
    from torch.distributed import distributed_c10d

    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    threads, hook, pg_timeout = torch.get_num_threads(), sys.excepthook, distributed_c10d.default_pg_timeout
    generator, redistribute = torch.get_rng_state(), logging.getLogger("torch.distributed.tensor._redistribute").level
    torch.set_num_threads(1)
    try:
        runs = [cli_streams("train", *TINY, "train.steps=1", f"output_dir={tmp_path / f'run{i}'}") for i in range(2)]
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    (code1, out1, err1), (code2, out2, err2) = runs
    assert code1 == code2 == 0, err1 + err2
    assert len(_losses(out1)) == 1 and _losses(out1) == _losses(out2), (out1, out2)
    assert len([w for w in recwarn if PACK_NOTICE in str(w.message)]) == 2, [str(w.message) for w in recwarn]
    assert "MASTER_PORT" not in err2, err2
    assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ
    assert sys.excepthook is hook and distributed_c10d.default_pg_timeout == pg_timeout
    assert torch.equal(torch.get_rng_state(), generator)  # train.seed reseeded the caller's generator
    torch.get_float32_matmul_precision()  # raised "mix of the legacy and new APIs"
    assert not any("FSDP2-wrapped module" in str(getattr(f[1], "pattern", "")) for f in warnings.filters)
    assert logging.getLogger("torch.distributed.tensor._redistribute").level == redistribute  # set to ERROR
    assert (tmp_path / "run1" / "loss_curve.png").is_file() and dict.__getitem__(svg_backend, "backend") == "svg"


def test_a_launched_run_leaves_no_variable_or_handler_behind(tmp_path, monkeypatch):
    """Before: ``main(["train", "--nproc-per-node", "2", ...])`` left ``OMP_NUM_THREADS=1`` (a later one-process run
    here ran on one thread), ``HYBRIDPAR_CONTROL_DIR`` (a removed folder) and ``HYBRIDPAR_LAUNCHER_PID`` in the
    environment of the process and of everything it started later, and added another NullHandler to torchrun's loggers
    (and stopped their propagation) at every launch. torchrun's agent is stood in for here."""
    import torch.distributed.run as torchrun

    for key in ("OMP_NUM_THREADS", "HYBRIDPAR_CONTROL_DIR", "HYBRIDPAR_LAUNCHER_PID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    elastic = logging.getLogger("torch.distributed.elastic")
    before = (list(elastic.handlers), elastic.propagate)
    seen = []
    monkeypatch.setattr(torchrun, "run", lambda args: seen.append(dict(os.environ)))
    for i in range(2):
        code, out, err = cli_streams("train", "--nproc-per-node", "2", "parallel.dp_shard=2", *TINY, "train.steps=2",
                                     f"output_dir={tmp_path / f'run{i}'}")
        assert code == 0, err
    assert len(seen) == 2 and seen[0]["OMP_NUM_THREADS"] and seen[0]["HYBRIDPAR_CONTROL_DIR"]  # the launcher ran
    assert not {"OMP_NUM_THREADS", "HYBRIDPAR_CONTROL_DIR", "HYBRIDPAR_LAUNCHER_PID"} & set(os.environ)
    assert (list(elastic.handlers), elastic.propagate) == before


def test_an_interrupted_run_then_a_good_one(tmp_path, monkeypatch, recwarn):
    """Before: Ctrl-C before the first step drew an empty loss curve and printed matplotlib's raw "UserWarning: No
    artists with labels found to put in legend" above the "interrupted" line. The next run in the process is a fresh
    one (the same losses, on the output_dir the interrupted run released)."""
    from hybridpar.train.trainer import Trainer

    def interrupted(self, step):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", interrupted)
        code, out, err = cli_streams("train", *TINY, "train.steps=1", f"output_dir={tmp_path / 'run'}")
    assert code == 130 and err.strip().endswith("hybridpar: interrupted (SIGINT).") and "Warning" not in err, err
    assert not [w for w in recwarn if "legend" in str(w.message)], [str(w.message) for w in recwarn]
    code, out, err = cli_streams("train", *TINY, "train.steps=1", f"output_dir={tmp_path / 'run'}",
                                 "checkpoint.if_exists=overwrite")
    fresh = cli_streams("train", *TINY, "train.steps=1", f"output_dir={tmp_path / 'fresh'}")
    assert code == 0 and _losses(out) == _losses(fresh[1]) and len(_losses(out)) == 1, err


def test_an_empty_measured_step_moves_the_measurement_and_is_said_as_a_notice(tmp_path, monkeypatch):
    """Before: the step whose live-tensor peak is measured (the second) reported ``tensors 0.0xx GiB`` (the weights
    alone) when it held no labelled token (nothing ran), and the skip was printed by ``NonFiniteGuard.empty`` itself,
    not through the run's notice. Now the next step that trains is measured."""
    import hybridpar.train.trainer as trainer

    gradients, said = trainer.Trainer.step_gradients, []
    monkeypatch.setattr(trainer.Trainer, "step_gradients",
                        lambda self, step: None if step == 1 else gradients(self, step))  # step 2 holds no label
    monkeypatch.setattr(trainer, "notice", said.append)
    code, out, err = cli_streams("train", *TINY, "train.steps=3", "plot=false", f"output_dir={tmp_path}")
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "tensor_peak_gib" in r] == [3], records
    assert records[1]["empty_steps"] == 1 and "tensors" not in out.splitlines()[-3], out
    assert [s for s in said if s.startswith("step 2 holds no labelled token")], said


def test_export_lora_of_a_partial_adapter_state_is_refused(tmp_path):
    """Before: a state holding some but not all of the model's adapter tensors exported without a word: ``merge=False``
    wrote the adapters it held (the rest of the model untrained in the adapter), ``merge=True`` merged them alone, and
    a ``lora_A`` without its ``lora_B`` was "KeyError: '...lora_B.weight'". Names are the canonical ones, whether the
    Mamba ``in_proj`` is split per component or not."""
    import hybridpar as hp
    from hybridpar.parallel.tensor.hf_plans.moe_hybrid import split_hf_mixers
    from tests.models.hf.hybrid_models import build_hybrid

    model = build_hybrid("granite")
    hp.add_lora(model, r=2, targets=["q_proj", "v_proj", "in_proj"], seed=0)
    split_hf_mixers(model)  # as the trainer lays it out: in_proj.lora_B.weight_z ... weight_dt
    state = hp.canonical_state_dict(model)
    lost = "model.layers.2.mamba.in_proj.lora_B.weight"
    for partial, said in [({k: v for k, v in state.items() if not k.startswith(lost[:-13])}, "lacks 2 of them"),
                          ({k: v for k, v in state.items() if k != lost}, f"lacks 1 of them (['{lost}'])"),
                          ({**state, "model.layers.9.x.lora_A.weight": state[lost]}, "holds 1 the model has not")]:
        for merge in (False, True):
            with pytest.raises(ValueError) as error:
                hp.export_lora(model, tmp_path / "out", partial, merge=merge)
            assert said in one_line(error) and "canonical_state_dict(model)" in str(error.value), str(error.value)
    assert not (tmp_path / "out").exists()
    hp.export_lora(model, tmp_path / "adapter", state)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_document_is_a_type_and_builds_a_document():
    """Before: ``hp.Document`` was a ``typing.Union`` alias: ``hp.Document([1, 2, 3])`` was Python's "Cannot instantiate
    typing.Union" and ``isinstance(doc, hp.Document)`` "Subscripted generics cannot be used with class and instance
    checks"."""
    import hybridpar as hp

    doc = hp.Document([5, 6, 7])
    assert doc["input_ids"].tolist() == [5, 6, 7] and doc["labels"].tolist() == [6, 7, -100]
    assert hp.Document(torch.tensor([5, 6]), labels=[-100, 9])["labels"].tolist() == [-100, 9]
    assert all(isinstance(d, hp.Document) for d in (doc, [1, 2], torch.tensor([1]), (1, 2)))
    assert not any(isinstance(d, hp.Document) for d in ("ab", b"ab", 3, None))
    [pack] = hp.pack_documents([doc, hp.Document([1, 2])], 8)
    assert pack["seq_lens"].tolist() == [3, 2]
    for bad, said in [(("abc",), "not text"), (([1, 2], [1]), "labels have 1 entries but input_ids 2"),
                      (([1.5],), "not integers")]:
        with pytest.raises(ValueError) as error:
            hp.Document(*bad)
        assert said in one_line(error)


def test_check_packing_takes_any_process_count_for_the_layout_it_does_not_use(tmp_path, monkeypatch):
    """Before: ``hybridpar check --packing parallel.cp=2`` (one process) was refused: "one process (no
    --nproc-per-node) does not fit the layout ... = 2", for a layout the comparison does not use (its header says so),
    and so was a torchrun worker of a one-process job ("WORLD_SIZE=1 (set by torchrun) does not fit the layout")."""
    code, out, err = cli_streams("check", "--packing", "--dry-run", "model.preset=tiny", "parallel.cp=2", "parallel.tp=2")
    assert code == 0 and "config and layout valid for 1 process" in out, err
    packing = ("check", "--packing", "model.preset=tiny", "parallel.cp=2", "data.pack_size=64", "data.packs_per_step=1")
    code, out, err = cli_streams(*packing)
    assert code == 0 and "layout: parallel.cp=2 not used here" in out and "check --packing passed" in out, out + err
    code, out, err = cli_streams("check", "--dry-run", "model.preset=tiny", "parallel.cp=2")  # the layout proof uses it
    assert code == 2 and "does not fit the layout" in err, err
    from hybridpar.launch import free_port

    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)  # a worker torchrun started (the worker path keeps what torchrun set)
    from torch.distributed import distributed_c10d

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # what the worker path sets, given back to this process
    monkeypatch.setattr(distributed_c10d, "default_pg_timeout", distributed_c10d.default_pg_timeout)
    threads = torch.get_num_threads()
    try:
        code, out, err = cli_streams(*packing)
    finally:
        torch.set_num_threads(threads)
    assert code == 0 and "check --packing passed" in out, out + err


def test_generate_from_an_adapter_leaves_no_merged_copy_behind(tmp_path):
    """Before: ``generate --hf-path ADAPTER`` merged the adapter onto a copy of its base in a temporary folder that was
    removed only when the process exited, so every call from a notebook or a sweep left a full copy of the base model
    on disk (here two calls, two folders)."""
    import glob
    import tempfile

    import transformers

    import hybridpar as hp
    from tests.models.hf import hybrid_models

    torch.manual_seed(0)
    config = transformers.GraniteMoeHybridConfig(num_local_experts=0, position_embedding_type="nope",
                                                 **{**hybrid_models._GRANITE, "vocab_size": 260})  # bytes fit
    model = transformers.GraniteMoeHybridForCausalLM(config)
    model.save_pretrained(tmp_path / "base")
    hp.add_lora(model, r=2, targets=["q_proj", "v_proj"], seed=0)
    hp.export_lora(model, tmp_path / "adapter", hp.canonical_state_dict(model), base_path=tmp_path / "base")
    before = set(glob.glob(f"{tempfile.gettempdir()}/hybridpar-lora-*"))
    argv = ("generate", "--hf-path", str(tmp_path / "adapter"), "--prompt", "ab", "--max-new-tokens", "3",
            "--tokenizer", "bytes", "--json")
    runs = [cli_streams(*argv) for _ in range(2)]
    assert runs[0][0] == 0 and runs[0][1] == runs[1][1], runs
    assert set(glob.glob(f"{tempfile.gettempdir()}/hybridpar-lora-*")) == before


def test_a_position_buffer_refilled_in_place_is_read_again():
    """Before: the longest document a transformers model's chunked attention is checked against (Llama 4's
    ``attention_chunk_size``) was cached by the position tensor's identity, so a loop that refills one
    ``position_ids`` buffer in place (``copy_``) was checked against the first batch's positions ever after."""
    from hybridpar.parallel.context.hf_types import _longest_position

    positions = torch.arange(4)[None]
    assert _longest_position(positions) == 4
    positions.copy_(torch.arange(8, 12)[None])
    assert _longest_position(positions) == 12


def test_a_callers_float64_default_dtype_changes_no_weight_and_no_loss(tmp_path):
    """Before: after ``torch.set_default_dtype(torch.float64)`` in the calling process (a notebook checking numerics),
    ``hp.HybridLM`` drew its float32 (or float64) weights in float64 from the same seed, so they differed from a fresh
    process's, and ``hybridpar train`` from Python logged other losses (step 1: 5.6890 where the CLI logs 5.4445)."""
    import hybridpar as hp

    def weights(**fields):
        torch.manual_seed(0)
        return hp.HybridLM(hp.HybridConfig.from_preset("tiny", **fields)).state_dict()

    def losses(name):
        code, out, err = cli_streams("train", *TINY, "train.steps=1", "plot=false", "checkpoint.every=-1",
                                     f"output_dir={tmp_path / name}")
        assert code == 0, err
        return _losses(out)

    expected, expected64, fresh = weights(), weights(dtype=torch.float64), losses("fresh")
    torch.set_default_dtype(torch.float64)
    try:
        got, got64, caller = weights(), weights(dtype=torch.float64), losses("float64")
        assert torch.get_default_dtype() == torch.float64  # the caller's, given back
    finally:
        torch.set_default_dtype(torch.float32)
    assert all(torch.equal(expected[k], got[k]) and torch.equal(expected64[k], got64[k]) for k in expected)
    assert len(fresh) == 1 and caller == fresh, (caller, fresh)
