"""The fused KDA rule (``models/linear/kda_fused.py``): which kernel runs and why, the mapping of our
arguments onto FLA's ``chunk_kda`` in float64, and FLA's own kernels on CPU.

In float64, FLA's contract written out token by token (``kda_contract.py``) stands in for the
kernel; the fused path must equal the pure-PyTorch core to 1e-10 (outputs, final states, every
input's gradient) on packed rows, with initial states entering and final states leaving every
document, compiled without a graph break, and pass ``torch.library.opcheck``. ``fla_kda_on_cpu.py``
(a fresh process, triton's interpreter) holds FLA's real kernels, forward and backward, to the pure
core in float32 against float64 (module docstring there for the tolerance). On a GPU,
``benchmarks/kda_parity.py`` does the same in float32.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hybridpar.models.linear import kda_fused
from hybridpar.models.linear.kda import chunk_kda_rule
from hybridpar.models.linear.kda_core import kimi_delta_core
from hybridpar.models.linear.kda_fused import choose_kda_kernel, fla_kda_status, fused_kda_rule, register_kda_rule
from hybridpar.models.mamba import fused
from hybridpar.models.mamba.core import row_documents
from hybridpar.models.mamba.fused import use_mamba_kernel, use_stand_in
from tests.models.linear.kda_contract import kda_contract
from tests.models.mamba.test_fla_on_cpu import ROOT, _kernels_folder

F64 = torch.float64
TOL = 1e-10
FLA_TOL = 1e-5  # FLA's float32 kernels against the float64 pure core (the pure core's own float32 error beside it)
MODEL_TOL = 5e-5  # a whole float32 model against float64: errors compound over layers
register_kda_rule("contract", kda_contract)


def _close(got, want, what):
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert err < TOL, (what, err)


def _core_inputs(seed, heads=2, d=8, batch=2, seqlen=24, kernel=4):
    gen = torch.Generator().manual_seed(seed)
    width = 3 * heads * d

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=F64)).requires_grad_()

    inputs = dict(mixed_qkv=r(batch, seqlen, width), f=r(batch, seqlen, heads * d), b=r(batch, seqlen, heads),
                  conv_weight=r(width, kernel, scale=0.5), conv_bias=r(width, scale=0.1),
                  A_log=torch.rand(heads, generator=gen, dtype=F64).log().requires_grad_(),
                  dt_bias=r(heads * d, scale=0.5))
    return inputs, dict(head_dim=d, chunk_size=8)


def _grads(outputs, inputs):
    gen = torch.Generator().manual_seed(9)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outputs)
    return torch.autograd.grad(loss, list(inputs.values()))


def test_fused_core_equals_the_pure_core_on_packed_rows():
    """Two rows of packed documents (a one-token document, boundaries inside and on chunk edges),
    rows laid end to end as FLA's ``cu_seqlens``: the output and every input's gradient."""
    inputs, sizes = _core_inputs(1)
    cu_docs = row_documents(torch.tensor([0, 7, 8, 16, 24]), 2, 24, "cpu")
    want = kimi_delta_core(*inputs.values(), **sizes, cu_docs=cu_docs)
    with use_stand_in("contract", family="kda"):
        got = kimi_delta_core(*inputs.values(), **sizes, cu_docs=cu_docs)
    _close(got, want, "o")
    for name, g, g_ref in zip(inputs, _grads([got], inputs), _grads([want], inputs)):
        _close(g, g_ref, f"grad {name}")


def _rule_inputs(seed, tokens, docs, k_heads=1, v_heads=2, dk=8, dv=10):
    gen = torch.Generator().manual_seed(seed)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=gen, dtype=F64), dim=-1)  # noqa: E731
    return {n: t.requires_grad_() for n, t in dict(
        q=unit(1, tokens, k_heads, dk), k=unit(1, tokens, k_heads, dk),
        v=torch.randn(1, tokens, v_heads, dv, generator=gen, dtype=F64),
        g=-torch.rand(1, tokens, v_heads, dk, generator=gen, dtype=F64),
        beta=torch.rand(1, tokens, v_heads, generator=gen, dtype=F64),
        initial_state=torch.randn(docs, v_heads, dk, dv, generator=gen, dtype=F64)).items()}


def test_fused_rule_takes_initial_states_and_returns_final_states_per_document():
    """What the ``state`` CP strategy asks: a state entering and one leaving every sequence of
    ``cu_seqlens``, against the pure rule run one document at a time; gradients through both."""
    cu = [0, 9, 10, 27]
    inputs = _rule_inputs(4, cu[-1], len(cu) - 1, k_heads=2)
    rule_args = list(inputs.values())[:5]
    o, final = fused_kda_rule(*rule_args, cu_seqlens=torch.tensor(cu), initial_state=inputs["initial_state"],
                              output_final_state=True, rule="contract")
    parts = [chunk_kda_rule(*(t[:, s:e] for t in rule_args), chunk_size=8, output_final_state=True,
                            initial_state=inputs["initial_state"][n:n + 1])
             for n, (s, e) in enumerate(zip(cu[:-1], cu[1:]))]
    o_ref, final_ref = torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts])
    _close(o, o_ref, "o")
    _close(final, final_ref, "final states")
    for name, g, g_ref in zip(inputs, _grads([o, final], inputs), _grads([o_ref, final_ref], inputs)):
        _close(g, g_ref, f"grad {name}")


def test_fused_rule_keeps_only_its_inputs_for_backward():
    inputs = _rule_inputs(5, 20, 1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused_kda_rule(*list(inputs.values())[:5], cu_seqlens=torch.tensor([0, 20]), rule="contract")
    assert {id(t) for t in saved} <= {id(t) for t in inputs.values()} | {id(t) for t in saved if t.dim() == 1}


def test_fused_op_passes_torch_library_opcheck():
    """Schema, fake kernel (float64, and bf16 q, k, v as under mixed precision), autograd registration
    and AOT dispatch of ``hybridpar::fused_kda_rule`` against its real kernel."""
    for dtype in (F64, torch.bfloat16):
        inputs = _rule_inputs(6, 12, 2)
        args = [t.detach().to(dtype if name in "qkv" else F64).requires_grad_() for name, t in inputs.items()]
        torch.library.opcheck(torch.ops.hybridpar.fused_kda_rule.default,
                              (*args, torch.tensor([0, 5, 12]), True, "contract"),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                          "test_aot_dispatch_dynamic"))


def test_fused_core_compiles_without_graph_breaks():
    """``torch.compile(fullgraph=True)`` (a graph break raises) through the core with the fused rule:
    equal to the eager pure core, output and gradients."""
    inputs, sizes = _core_inputs(7)
    cu_docs = row_documents(torch.tensor([0, 5, 24]), 2, 24, "cpu")

    def core(*tensors):
        return kimi_delta_core(*tensors, **sizes, cu_docs=cu_docs)

    torch._dynamo.reset()
    with use_stand_in("contract", family="kda"):
        got = torch.compile(core, backend="aot_eager", fullgraph=True)(*inputs.values())
    want = core(*inputs.values())
    _close(got, want, "compiled o")
    for name, g, g_ref in zip(inputs, _grads([got], inputs), _grads([want], inputs)):
        _close(g, g_ref, f"compiled grad {name}")


def test_the_kernel_that_runs_is_logged_once_with_its_reason(caplog, monkeypatch):
    monkeypatch.setattr(fused, "_LOGGED", set())
    inputs, sizes = _core_inputs(8)
    with caplog.at_level(logging.INFO, logger="hybridpar.models.linear.kda_fused"):
        for _ in range(2):
            kimi_delta_core(*(t.detach() for t in inputs.values()), **sizes)
    lines = [r.getMessage() for r in caplog.records if r.name == "hybridpar.models.linear.kda_fused"]
    assert lines == ["kda kernel: pure (device cpu; torch.float64 on cpu)"], lines
    x = torch.zeros(1, 4, 8)
    assert choose_kda_kernel(x) == ("pure", "device cpu")
    with use_mamba_kernel("pure"):  # one switch for every fused core
        assert choose_kda_kernel(x) == ("pure", "use_mamba_kernel('pure')")
    with use_mamba_kernel("fla"), pytest.raises(ValueError, match=r"use_mamba_kernel\('fla'\) cannot run here: device cpu"):
        choose_kda_kernel(x)
    with use_stand_in("contract", family="kda"):  # a family's stand-in leaves the others alone
        assert choose_kda_kernel(x) == ("contract", "stand-in 'contract' for FLA's kernel")
        assert fused.select_kernel("gdn", x, lambda: (False, ""), logging.getLogger("t")) == ("pure", "device cpu")


def test_kernel_rules_on_cuda(monkeypatch):
    """On (fake) CUDA tensors: FLA's chunk_kda when fla-core imports and the dtype has a kernel; the reason otherwise."""
    available, note = fla_kda_status()  # the suite's environment keeps fla off its path (test_fla_on_cpu.py)
    assert not available and note.startswith("fla-core does not import (ModuleNotFoundError"), note
    with FakeTensorMode():
        bf16, f64 = (torch.empty(1, 4, 8, device="cuda", dtype=d) for d in (torch.bfloat16, F64))
    monkeypatch.setattr(fused, "_LOGGED", set())
    assert choose_kda_kernel(bf16) == ("pure", note)
    monkeypatch.setattr(kda_fused, "_FLA", (kda_contract, "fla-core 0.6.0 chunk_kda"))
    assert choose_kda_kernel(bf16) == ("fla", "fla-core 0.6.0 chunk_kda")
    assert choose_kda_kernel(f64) == ("pure", "dtype torch.float64 has no fused kernel")
    with use_mamba_kernel("pure"):
        assert choose_kda_kernel(bf16) == ("pure", "use_mamba_kernel('pure')")


def test_bad_streams_are_refused_in_one_line():
    inputs = _rule_inputs(3, 6, 1)
    q, k, v, g, beta = (t.detach() for t in list(inputs.values())[:5])
    with pytest.raises(ValueError, match=r"expects one stream: .*flatten rows first") as error:
        fused_kda_rule(q, k, v, g[..., 0], beta, cu_seqlens=torch.tensor([0, 6]), rule="contract")  # GDN's scalar g
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="fused KDA rule 'nope' is not registered"):
        fused_kda_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 6]), rule="nope")
    with pytest.raises(ValueError, match="register a stand-in under another name"):
        register_kda_rule("fla", kda_contract)


def test_fla_kernels_under_the_triton_interpreter_match_the_pure_core():
    """FLA 0.6.0's real ``chunk_kda`` Triton kernels on CPU (``fla_kda_on_cpu.py``, a fresh process)."""
    paths = [str(_kernels_folder()), str(ROOT / "src"), str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run([sys.executable, "-m", "tests.models.linear.fla_kda_on_cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["fla"] == "0.6.0"
    assert max(report["contract"].values()) <= 1e-6, report["contract"]  # ours = FLA's naive reference (fp32)
    assert set(report["cases"]) == {"segments"}
    assert {"o", "final_states", "grad q", "grad k", "grad v", "grad g", "grad beta"} == set(report["cases"]["segments"])
    for case, errors in report["cases"].items():
        for quantity, (fla_error, pure_error) in errors.items():
            assert fla_error <= FLA_TOL and pure_error <= FLA_TOL, (case, quantity, fla_error, pure_error)
    assert report["compiled"] == {"graph_breaks": 0, "fused_calls": 4}, report["compiled"]  # 2 layers, fwd + bwd
    model = report["model_errors"]
    assert "loss" in model and len(model) > 20  # the loss and every parameter's gradient
    for quantity, (fla_error, pure_error) in model.items():
        assert fla_error <= MODEL_TOL, (quantity, fla_error, pure_error)
