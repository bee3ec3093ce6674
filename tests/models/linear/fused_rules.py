"""The tests every fused linear-attention rule passes (gated DeltaNet, Kimi Delta Attention), once.

A rule family's test module (``test_gdn_fused.py``, ``test_kda_fused.py``) describes its family as a
``RuleFamily``, returns it from a ``family`` fixture and imports the shared tests below by name, so
pytest collects them there. In float64, FLA's contract written out token by token stands in for the
kernel; the fused path must equal the pure-PyTorch core to 1e-10 (outputs, final states, every input's
gradient) on packed rows, with initial states entering and final states leaving every document,
compiled without a graph break, and pass ``torch.library.opcheck``. The backward op's direct route (FLA's
backward alone, ``delta_backward.py``) runs in float64 through a stand-in registered with a backward of
its own (``rule_backward_by_autograd``), bit for bit as autograd of the rule's forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hybridpar.models.linear import delta_backward
from hybridpar.models.mamba import fla_backward
from hybridpar.models.mamba import fused
from hybridpar.models.mamba.core import row_documents
from hybridpar.models.mamba.fused import use_mamba_kernel, use_stand_in
from hybridpar.models.mamba.fused_op import autograd_on

__all__ = ["F64", "RuleFamily", "close", "grads", "unit", "rule_backward_by_autograd",
           "test_fused_core_equals_the_pure_core_on_packed_rows",
           "test_a_rule_with_a_backward_of_its_own_runs_it_alone",
           "test_an_fla_core_whose_internals_differ_keeps_autograd_of_its_forward",
           "test_fused_rule_takes_initial_states_and_returns_final_states_per_document",
           "test_fused_rule_keeps_only_its_inputs_for_backward", "test_fused_op_passes_torch_library_opcheck",
           "test_fused_core_compiles_without_graph_breaks", "test_the_kernel_that_runs_is_logged_once_with_its_reason",
           "test_kernel_rules_on_cuda"]

F64 = torch.float64
TOL = 1e-10


@dataclass(frozen=True)
class RuleFamily:
    """One fused rule as its tests see it: the module, its core and rules, and input makers.

    ``core_inputs(seed, **case) -> (inputs, sizes)`` builds the core's float64 leaf tensors and size
    keywords (one call per entry of ``core_cases``); ``rule_inputs(seed, tokens, docs, k_heads=1)`` the
    rule's ``q, k, v, g, beta, initial_state`` on one stream of ``docs`` documents."""

    name: str  # "gdn" | "kda": the stand-in family and the log's first word
    module: ModuleType  # models/linear/<name>_fused.py
    core: Callable
    fused_rule: Callable
    pure_rule: Callable
    choose_kernel: Callable
    fla_status: Callable
    contract: Callable
    op: str  # the registered op, torch.ops.hybridpar.<op>
    fla_entry: str  # FLA's function the kernel note names
    register: Callable  # register_rule(name, rule, backward=None) of the module
    core_inputs: Callable
    rule_inputs: Callable
    core_cases: tuple[dict, ...] = field(default=({},))
    state_k_heads: int = 1  # key heads of the state test (KDA's pure rule takes as many as value heads)


def close(got, want, what, tol=TOL):
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert err < tol, (what, err)


def grads(outputs, inputs):
    """Gradients of a fixed random projection of ``outputs`` with respect to ``inputs``' values."""
    gen = torch.Generator().manual_seed(9)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outputs)
    return torch.autograd.grad(loss, list(inputs.values()))


def unit(gen, *shape):
    """float64 normal vectors along the last dim, as the rules' q and k are (FLA normalises them)."""
    return torch.nn.functional.normalize(torch.randn(*shape, generator=gen, dtype=F64), dim=-1)


def rule_backward_by_autograd(rule: Callable) -> Callable:
    """``rule``'s backward in ``delta_backward.gdn_backward``'s convention, ``(q, k, v, g, beta, do, dht, *,
    scale, initial_state, cu_seqlens) -> (dq, dk, dv, dg, dbeta, dh0)``, by autograd of ``rule``."""

    def backward(q, k, v, g, beta, do, dht, *, scale, initial_state, cu_seqlens):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, g, beta, initial_state) if t is not None]
        with autograd_on():
            o, ht = rule(*leaves[:5], scale=scale, initial_state=leaves[5] if len(leaves) > 5 else None,
                         output_final_state=dht is not None, cu_seqlens=cu_seqlens)
            outputs = [(o, do)] + ([(ht, dht)] if dht is not None else [])
            found = torch.autograd.grad([t for t, _ in outputs], leaves, [d for _, d in outputs], allow_unused=True)
        return (*found[:5], found[5] if len(leaves) > 5 else None)

    return backward


def _close_all(got, want, inputs, got_outputs, want_outputs, what):
    close(got, want, what)
    for name, g, g_ref in zip(inputs, grads(got_outputs, inputs), grads(want_outputs, inputs)):
        close(g, g_ref, f"{what}: grad {name}")


def test_fused_core_equals_the_pure_core_on_packed_rows(family):
    """Two rows of packed documents (a one-token document, boundaries inside and on chunk edges),
    rows laid end to end as FLA's ``cu_seqlens``: the output and every input's gradient."""
    for seed, case in enumerate(family.core_cases, start=1):
        inputs, sizes = family.core_inputs(seed, **case)
        cu_docs = row_documents(torch.tensor([0, 7, 8, 16, 24]), 2, 24, "cpu")
        want = family.core(*inputs.values(), **sizes, cu_docs=cu_docs)
        with use_stand_in("contract", family=family.name):
            got = family.core(*inputs.values(), **sizes, cu_docs=cu_docs)
        _close_all(got, want, inputs, [got], [want], f"o {case}")


@pytest.mark.parametrize("rule", ["contract", "contract_direct"])
def test_fused_rule_takes_initial_states_and_returns_final_states_per_document(family, rule):
    """What the ``state`` CP strategy asks: a state entering and one leaving every sequence of
    ``cu_seqlens``, against the pure rule run one document at a time; gradients through both (by either
    route of the backward)."""
    cu = [0, 9, 10, 27]
    inputs = family.rule_inputs(4, cu[-1], len(cu) - 1, k_heads=family.state_k_heads)
    rule_args, h0 = list(inputs.values())[:5], inputs["initial_state"]
    o, final = family.fused_rule(*rule_args, cu_seqlens=torch.tensor(cu), initial_state=h0,
                                 output_final_state=True, rule=rule)
    parts = [family.pure_rule(*(t[:, s:e] for t in rule_args), chunk_size=8, output_final_state=True,
                              initial_state=h0[n:n + 1]) for n, (s, e) in enumerate(zip(cu[:-1], cu[1:]))]
    o_ref, final_ref = torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts])
    close(final, final_ref, "final states")
    _close_all(o, o_ref, inputs, [o, final], [o_ref, final_ref], "o")


@pytest.mark.parametrize("want_final", [True, False])
def test_a_rule_with_a_backward_of_its_own_runs_it_alone(family, want_final):
    """The backward op's direct route (FLA's: ``delta_backward.py``) against autograd of the rule's forward:
    every gradient the same bits, the rule's forward run in the backward only inside its own backward, once."""
    cu = [0, 9, 10, 27]
    inputs = family.rule_inputs(12, cu[-1], len(cu) - 1, k_heads=family.state_k_heads)
    calls = []
    backward = rule_backward_by_autograd(family.contract)
    family.register("counted_direct", lambda *a, **kw: calls.append("rule") or family.contract(*a, **kw),
                    backward=lambda *a, **kw: calls.append("backward") or backward(*a, **kw))
    found = {}
    for rule in ("contract", "counted_direct"):
        o, final = family.fused_rule(*list(inputs.values())[:5], cu_seqlens=torch.tensor(cu), rule=rule,
                                     initial_state=inputs["initial_state"], output_final_state=want_final)
        calls.clear()
        found[rule] = grads([o, final] if want_final else [o], inputs)
    assert calls == ["backward"], calls
    for name, a, b in zip(inputs, found["contract"], found["counted_direct"]):
        assert torch.equal(a, b), name


def test_an_fla_core_whose_internals_differ_keeps_autograd_of_its_forward(family, monkeypatch, caplog):
    """Where fla-core's internals are not the ones checked (here it does not import), FLA's rule keeps
    autograd of its forward: no backward of its own, logged once at INFO with why."""
    monkeypatch.setattr(fla_backward, "_RESOLVED", {})
    resolve = getattr(delta_backward, f"{family.name}_backward")
    with caplog.at_level(logging.INFO, logger=delta_backward.__name__):
        assert resolve() is None and resolve() is None
    lines = [r.getMessage() for r in caplog.records if r.name == delta_backward.__name__]
    assert lines == [f"{family.name} rule backward: autograd through FLA's forward (fla-core's internals could not "
                     "be checked (ModuleNotFoundError: No module named 'fla'))"], lines


def test_fused_rule_keeps_only_its_inputs_for_backward(family):
    inputs = family.rule_inputs(5, 20, 1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        family.fused_rule(*list(inputs.values())[:5], cu_seqlens=torch.tensor([0, 20]), rule="contract")
    assert {id(t) for t in saved} <= {id(t) for t in inputs.values()} | {id(t) for t in saved if t.dim() == 1}


def test_fused_op_passes_torch_library_opcheck(family):
    """Schema, fake kernel (float64, and bf16 q, k, v as under mixed precision), autograd registration
    and AOT dispatch of the registered op against its real kernel."""
    op = getattr(torch.ops.hybridpar, family.op).default
    for dtype in (F64, torch.bfloat16):
        inputs = family.rule_inputs(6, 12, 2)
        args = [t.detach().to(dtype if name in "qkv" else F64).requires_grad_() for name, t in inputs.items()]
        torch.library.opcheck(op, (*args, torch.tensor([0, 5, 12]), True, "contract"),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                          "test_aot_dispatch_dynamic"))


def test_fused_core_compiles_without_graph_breaks(family):
    """``torch.compile(fullgraph=True)`` (a graph break raises) through the core with the fused rule:
    equal to the eager pure core, output and gradients."""
    inputs, sizes = family.core_inputs(7, **family.core_cases[-1])
    cu_docs = row_documents(torch.tensor([0, 5, 24]), 2, 24, "cpu")

    def core(*tensors):
        return family.core(*tensors, **sizes, cu_docs=cu_docs)

    torch._dynamo.reset()
    with use_stand_in("contract", family=family.name):
        got = torch.compile(core, backend="aot_eager", fullgraph=True)(*inputs.values())
    want = core(*inputs.values())
    _close_all(got, want, inputs, [got], [want], "compiled o")


def test_the_kernel_that_runs_is_logged_once_with_its_reason(family, caplog, monkeypatch):
    monkeypatch.setattr(fused, "_LOGGED", set())
    inputs, sizes = family.core_inputs(8, **family.core_cases[-1])
    logger = family.module.__name__
    with caplog.at_level(logging.INFO, logger=logger):
        for _ in range(2):
            family.core(*(t.detach() for t in inputs.values()), **sizes)
    lines = [r.getMessage() for r in caplog.records if r.name == logger]
    assert lines == [f"{family.name} kernel: pure (device cpu; torch.float64 on cpu)"], lines
    x = torch.zeros(1, 4, 8)
    assert family.choose_kernel(x) == ("pure", "device cpu")
    with use_mamba_kernel("pure"):  # one switch for every fused core
        assert family.choose_kernel(x) == ("pure", "use_mamba_kernel('pure')")
    with use_mamba_kernel("fla"), pytest.raises(ValueError, match=r"use_mamba_kernel\('fla'\) cannot run here: device cpu"):
        family.choose_kernel(x)
    with use_stand_in("contract", family=family.name):  # a family's stand-in leaves the others alone
        assert family.choose_kernel(x) == ("contract", "stand-in 'contract' for FLA's kernel")
        assert fused.choose_kernel(x, row_documents(None, 1, 4, "cpu"), None, None) == ("pure", "device cpu")
        other = "kda" if family.name == "gdn" else "gdn"
        assert fused.select_kernel(other, x, lambda: (False, ""), logging.getLogger("t")) == ("pure", "device cpu")


def test_kernel_rules_on_cuda(family, monkeypatch):
    """On (fake) CUDA tensors: FLA's kernel when fla-core imports and the dtype has one; the reason otherwise."""
    available, note = family.fla_status()  # the suite's environment keeps fla off its path (test_fla_on_cpu.py)
    assert not available and note.startswith("fla-core does not import (ModuleNotFoundError"), note
    with FakeTensorMode():
        bf16, f64 = (torch.empty(1, 4, 8, device="cuda", dtype=d) for d in (torch.bfloat16, F64))
    monkeypatch.setattr(fused, "_LOGGED", set())
    assert family.choose_kernel(bf16) == ("pure", note)
    monkeypatch.setattr(family.module, "_FLA", (family.contract, f"fla-core 0.6.0 {family.fla_entry}"))
    assert family.choose_kernel(bf16) == ("fla", f"fla-core 0.6.0 {family.fla_entry}")
    assert family.choose_kernel(f64) == ("pure", "dtype torch.float64 has no fused kernel")
    with use_mamba_kernel("pure"):
        assert family.choose_kernel(bf16) == ("pure", "use_mamba_kernel('pure')")

