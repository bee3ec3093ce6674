"""The fused KDA rule (``models/linear/kda_fused.py``): which kernel runs and why, the mapping of our
arguments onto FLA's ``chunk_kda`` in float64, and FLA's own kernels on CPU.

The tests every fused rule passes (``fused_rules.py``, collected here for KDA) hold the fused path,
with FLA's contract (``kda_contract.py``) standing in for the kernel in float64, to the pure core.
``fla_kda_on_cpu.py`` (a fresh process, triton's interpreter) holds FLA's real kernels, forward and
backward, to the pure core in float32 against float64 (module docstring there for the tolerance), and the
backward of FLA's kernels alone (``delta_backward.py``) to autograd through FLA's forward, bit for bit. On a
GPU, ``benchmarks/kda_parity.py`` does the same in float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hybridpar.models.linear import kda_fused
from hybridpar.models.linear.kda import chunk_kda_rule
from hybridpar.models.linear.kda_core import kimi_delta_core
from hybridpar.models.linear.kda_fused import choose_kda_kernel, fla_kda_status, fused_kda_rule, register_kda_rule
from tests.models.linear.fused_rules import F64, RuleFamily, rule_backward_by_autograd, unit
from tests.models.linear.fused_rules import (  # noqa: F401  the shared tests, collected here
    test_a_rule_with_a_backward_of_its_own_runs_it_alone,
    test_an_fla_core_whose_internals_differ_keeps_autograd_of_its_forward,
    test_fused_core_compiles_without_graph_breaks, test_fused_core_equals_the_pure_core_on_packed_rows,
    test_fused_op_passes_torch_library_opcheck, test_fused_rule_keeps_only_its_inputs_for_backward,
    test_fused_rule_takes_initial_states_and_returns_final_states_per_document, test_kernel_rules_on_cuda,
    test_the_kernel_that_runs_is_logged_once_with_its_reason)
from tests.models.linear.kda_contract import kda_contract
from tests.models.mamba.test_fla_on_cpu import ROOT, SATURATED_TOL, _kernels_folder, assert_backward_routes

FLA_TOL = 1e-5  # FLA's float32 kernels against the float64 pure core (the pure core's own float32 error beside it)
MODEL_TOL = 5e-5  # a whole float32 model against float64: errors compound over layers
register_kda_rule("contract", kda_contract)
register_kda_rule("contract_direct", kda_contract, backward=rule_backward_by_autograd(kda_contract))


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


def _rule_inputs(seed, tokens, docs, k_heads=1, v_heads=2, dk=8, dv=10):
    """As the gated DeltaNet's, but the decay g [1, T, Hv, dk] has one value per key channel."""
    gen = torch.Generator().manual_seed(seed)
    return {n: t.requires_grad_() for n, t in dict(
        q=unit(gen, 1, tokens, k_heads, dk), k=unit(gen, 1, tokens, k_heads, dk),
        v=torch.randn(1, tokens, v_heads, dv, generator=gen, dtype=F64),
        g=-torch.rand(1, tokens, v_heads, dk, generator=gen, dtype=F64),
        beta=torch.rand(1, tokens, v_heads, generator=gen, dtype=F64),
        initial_state=torch.randn(docs, v_heads, dk, dv, generator=gen, dtype=F64)).items()}


KDA = RuleFamily(name="kda", module=kda_fused, core=kimi_delta_core, fused_rule=fused_kda_rule,
                 pure_rule=chunk_kda_rule, choose_kernel=choose_kda_kernel, fla_status=fla_kda_status,
                 contract=kda_contract, op="fused_kda_rule", fla_entry="chunk_kda", register=register_kda_rule,
                 core_inputs=_core_inputs, rule_inputs=_rule_inputs, state_k_heads=2)


@pytest.fixture
def family():
    return KDA


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
    assert set(report["cases"]) == {"segments", "saturated"}
    assert {"o", "final_states", "grad q", "grad k", "grad v", "grad g", "grad beta"} == set(report["cases"]["segments"])
    for case, errors in report["cases"].items():
        for quantity, (fla_error, pure_error) in errors.items():
            tol = SATURATED_TOL if case == "saturated" else FLA_TOL
            assert fla_error <= tol and pure_error <= FLA_TOL, (case, quantity, fla_error, pure_error)
    assert report["compiled"] == {"graph_breaks": 0, "fused_calls": 2}, report["compiled"]  # 1 layer, fwd + bwd
    assert_backward_routes(report["routes"], "chunk_gla_fwd_kernel_o")  # FLA's backward alone: the same bits
    model = report["model_errors"]
    assert "loss" in model and len(model) > 20  # the loss and every parameter's gradient
    for quantity, (fla_error, pure_error) in model.items():
        assert fla_error <= MODEL_TOL, (quantity, fla_error, pure_error)
