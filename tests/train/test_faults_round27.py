"""Round 27: can ``hybridpar check`` fail? A mutation sweep of its proof.

One realistic fault at a time, injected with a monkeypatch into a parallel mechanism or into what ``check``
compares, at the layout that exercises it (2 real gloo ranks, float64): ``check`` must exit 1 and name what
differed. Every case runs in one 2-rank launch (the module's fixture); docs/reliability.md, Round 27."""

import contextlib
import io
from pathlib import Path

import pytest
import torch

from hybridpar.config import load_config
from tests.distributed.harness import run_ranks

DEFAULT = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")
SMALL = ["model.preset=tiny", "parallel.cp=1", "parallel.sequence_parallel=false", "data.pack_size=64",
         "model.dtype=float64", "data.task_options={min_len: 16, max_len: 32, num_kv_pairs: 2, vocab_size: 32}"]
FSDP = ["parallel.tp=1", "parallel.dp_shard=2", "data.packs_per_step=2"]
TP = ["parallel.tp=2"]


@contextlib.contextmanager
def _patched(owner, name, value):
    old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _norm_without_its_all_reduce():
    """``clip_grad_norm`` summing each rank's shard only (its all-reduce over the shards dropped)."""
    import hybridpar.train.optim as optim

    class Distributed:
        def __getattr__(self, name):
            return getattr(torch.distributed, name)

        def all_reduce(self, *args, **kwargs):
            return None

    class Torch:
        distributed = Distributed()

        def __getattr__(self, name):
            return getattr(torch, name)

    return _patched(optim, "torch", Torch())


def _replica_differs_on_rank_1(by: float = 1.0):
    """A replicated (TP ``Replicate``) gradient that rank 1 holds otherwise than rank 0 (its replicas would drift)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import hybridpar.train.proof.layout as layout

    class Trainer(layout.Trainer):
        def step_gradients(self, step):
            loss = super().step_gradients(step)
            if dist.get_rank() == 1:
                grad = dict(self.model.named_parameters())["backbone.norm_f.weight"].grad
                (grad.to_local() if isinstance(grad, DTensor) else grad).add_(by)
            return loss

    return _patched(layout, "Trainer", Trainer)


def _gathered_otherwise():
    """The layout's canonical gradients come back with a norm weight's as ``[1, D]`` (broadcast against ``[D]`` it
    compared equal), the LM head's with one row too many (a traceback) and a name one process has not."""
    import hybridpar.train.proof.layout as layout

    real, calls = layout.canonical_state_dict, []

    def canonical_state_dict(model, grads=False):
        state = real(model, grads)
        calls.append(grads)
        if grads and calls.count(True) == 1:  # the parallel model's gradients are read first
            state["backbone.norm_f.weight"] = state["backbone.norm_f.weight"][None]
            state["lm_head.weight"] = torch.cat([state["lm_head.weight"], state["lm_head.weight"][:1]])
            state["backbone.extra.weight"] = torch.zeros(2, dtype=torch.float64)
        return state

    return _patched(layout, "canonical_state_dict", canonical_state_dict)


def _final_norm_decayed_under_the_layout():
    """The layout's optimizer decays the final norm's weight (a parameter that lost the name, shape or mark that keeps
    it out of weight decay: FSDP's and TP's new parameters drop marks such as ``_no_weight_decay``)."""
    import hybridpar.train.proof.layout as layout

    class Trainer(layout.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            decay, keep = self.optimizer.param_groups
            norm = dict(self.model.named_parameters())["backbone.norm_f.weight"]
            keep["params"] = [p for p in keep["params"] if p is not norm]
            decay["params"].append(norm)

    return _patched(layout, "Trainer", Trainer)


def _one_run_misses(which: int):
    """``check --packing``'s packed run (``which=0``) or its one-document-per-row run (1) leaves the LM head without a
    gradient (a parameter one of them never reached)."""
    import hybridpar.train.proof.packing as packing

    real, calls = packing._step, []

    def step(model, rows, count):
        loss = real(model, rows, count)
        calls.append(1)
        if len(calls) == which + 1:
            dict(model.named_parameters())["lm_head.weight"].grad = None
        return loss

    return _patched(packing, "_step", step)


FAULTS = {  # case: (overrides, fault, --tolerance); "packing_*": check --packing
    "fsdp": (FSDP, None, None),
    "fsdp_norm": (FSDP, _norm_without_its_all_reduce, None),
    "fsdp_decay": (FSDP, _final_norm_decayed_under_the_layout, None),
    "tp_replica": (TP, _replica_differs_on_rank_1, None),
    "tp_replica_within": (TP, lambda: _replica_differs_on_rank_1(1e-8), 1e-6),
    "tp_shapes": (TP, _gathered_otherwise, None),
    "packing_packed": (["parallel.tp=1"], lambda: _one_run_misses(1), None),
    "packing_alone": (["parallel.tp=1"], lambda: _one_run_misses(0), None),
}


def _checks(rank, world_size):
    import hybridpar.train.proof.layout as layout
    import hybridpar.train.proof.packing as packing

    results = {}
    for name, (overrides, fault, tolerance) in FAULTS.items():
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), (fault() if fault else contextlib.nullcontext()):
                run = packing.run_packing_check if name.startswith("packing") else layout.run_check
                code = run(load_config(DEFAULT, SMALL + overrides), torch.device("cpu"), tolerance)
        except Exception as error:  # noqa: BLE001 (a case that crashes fails its own test, not the others)
            code = f"{type(error).__name__}: {error}"
        results[name] = (code, out.getvalue())
    return results


@pytest.fixture(scope="module")
def checks():
    """{case: [(exit code, stdout) of rank 0, of rank 1]}"""
    ranks = run_ranks(2, _checks, timeout_s=300)
    return {name: [ranks[0][name], ranks[1][name]] for name in FAULTS}


def _failed(report: str) -> list[str]:
    return [line.strip() for line in report.splitlines() if line.endswith("FAIL")]


def test_check_compares_the_gradient_norm_the_run_clips_by(checks):
    """``clip_grad_norm`` reduces the squares of every shard over its own groups (not through FSDP or DTensor): with
    that all-reduce dropped at ``dp_shard=2`` every gradient was exact, so ``check`` said "exact", while training
    clipped and logged a norm of half the shards. The norm is now a row of its own."""
    (code, report), _ = checks["fsdp"]
    assert code == 0 and "check exact" in report and "grad norm (train.grad_clip clips by it)" in report, report
    (code, report), (code_1, _) = checks["fsdp_norm"]
    assert code == code_1 == 1 and "check FAILED: " in report, report
    failed = [line.split(" max|diff|")[0].strip() for line in _failed(report)]
    assert failed[0] == "grad norm (train.grad_clip clips by it)", report  # and the updates it clipped (below)
    assert all(line.startswith("AdamW update of ") for line in failed[1:]), report


def test_check_compares_the_weight_decay_group_of_every_parameter(checks):
    """AdamW's groups are decided on the parallelized model's parameters (their names, shapes and marks), which the
    layout makes anew: a final norm decayed under ``dp_shard=2`` only changed no gradient, and ``check`` said "exact".
    Each parameter's group is now compared by its canonical name."""
    (code, report), _ = checks["fsdp"]
    assert "weight decay groups (" in report and "check exact" in report, report
    (code, report), (code_1, _) = checks["fsdp_decay"]
    assert code == code_1 == 1 and "check FAILED: 2 of" in report, report
    assert [line.split(" max|diff|")[0].strip() for line in _failed(report)] == [
        "AdamW update of backbone.norm_f.weight",  # the decay moved it (the first update, compared since)
        "weight decay of backbone.norm_f.weight (on under the layout, off on one process)"], report


def test_check_fails_on_every_rank_when_the_ranks_copies_of_a_gradient_differ(checks):
    """Each rank compares its own copy of a replicated gradient, and only rank 0 printed: a copy that differed on
    rank 1 only was "check exact" on rank 0 (exit 0 there, 1 on rank 1), and one 1e-8 apart under ``--tolerance 1e-6``
    was called exact. The failures and the exactness of every rank now make the one verdict, naming the rank."""
    (code, report), (code_1, _) = checks["tp_replica"]
    assert code == code_1 == 1 and "check FAILED" in report, report
    failed = _failed(report)
    assert any(line.startswith("grad backbone.norm_f.weight [rank 1 only") for line in failed), report
    (code, report), (code_1, _) = checks["tp_replica_within"]  # 1e-8 apart on rank 1, within --tolerance 1e-6
    assert code == code_1 == 0 and "check passed" in report and "check exact" not in report, report


def test_check_fails_a_gradient_of_another_shape_or_one_only_the_layout_has(checks):
    """A ``[1, D]`` gradient against ``[D]`` broadcast and compared equal ("exact"), ``[V+1, D]`` against ``[V, D]``
    was a RuntimeError traceback, and a name only the layout had was not looked at: each is now a failed row naming
    both shapes, or the name."""
    (code, report), (code_1, _) = checks["tp_shapes"]
    assert code == code_1 == 1 and "check FAILED: 3 of" in report, report
    failed = "\n".join(_failed(report))
    assert "grad backbone.norm_f.weight (shape (1, 64) under the layout, (64,) on one process)" in failed, report
    assert "grad lm_head.weight (shape (" in failed and "backbone.extra.weight (only under the layout" in failed, report


def test_check_packing_fails_a_gradient_only_one_of_its_runs_has(checks):
    """``check --packing`` compared the parameters with a gradient after the one-document-per-row run: one only the
    packed run reached was never looked at ("exact"), one only the one-per-row run reached stopped it with
    "KeyError: 'lm_head.weight'". Each is a failed row naming which run had it."""
    for case, only in (("packing_packed", "packed"), ("packing_alone", "one per row")):
        (code, report), (code_1, _) = checks[case]
        assert code == code_1 == 1 and "check --packing FAILED: 1 of" in report, report
        assert _failed(report)[0].startswith(f"grad lm_head.weight (only {only})"), report
