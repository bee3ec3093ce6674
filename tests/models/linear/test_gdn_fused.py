"""The fused gated delta rule (``models/linear/gdn_fused.py``): which kernel runs and why, the mapping of
our arguments onto FLA's ``chunk_gated_delta_rule`` in float64, and FLA's own kernels on CPU.

The tests every fused rule passes (``fused_rules.py``, collected here for the gated DeltaNet) hold the
fused path, with FLA's contract (``gdn_contract.py``) standing in for the kernel in float64, to the pure
core on packed rows with grouped values. ``fla_gdn_on_cpu.py`` (a fresh process, triton's interpreter)
holds FLA's real kernels, forward and backward, to the pure core in float64 within 1e-5 (about 7e-7
measured) and the contract to FLA's own naive reference within 1e-6, and the backward of FLA's kernels
alone (``delta_backward.py``) to autograd through FLA's forward, bit for bit, two kernels fewer. On a GPU,
``benchmarks/gpu_parity.py`` does the same in float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hybridpar.models.linear import gdn_fused
from hybridpar.models.linear.gated_delta import chunk_gated_delta_rule
from hybridpar.models.linear.gdn_core import gated_delta_core
from hybridpar.models.linear.gdn_fused import choose_gdn_kernel, fla_rule_status, fused_gated_delta_rule, register_rule
from tests.models.linear.fused_rules import F64, RuleFamily, rule_backward_by_autograd, unit
from tests.models.linear.fused_rules import (  # noqa: F401  the shared tests, collected here
    test_a_rule_with_a_backward_of_its_own_runs_it_alone,
    test_an_fla_core_whose_internals_differ_keeps_autograd_of_its_forward,
    test_fused_core_compiles_without_graph_breaks, test_fused_core_equals_the_pure_core_on_packed_rows,
    test_fused_op_passes_torch_library_opcheck, test_fused_rule_keeps_only_its_inputs_for_backward,
    test_fused_rule_takes_initial_states_and_returns_final_states_per_document, test_kernel_rules_on_cuda,
    test_the_kernel_that_runs_is_logged_once_with_its_reason)
from tests.models.linear.gdn_contract import gated_delta_contract
from tests.models.mamba.test_fla_on_cpu import ROOT, SATURATED_TOL, _kernels_folder, assert_backward_routes

register_rule("contract", gated_delta_contract)
register_rule("contract_direct", gated_delta_contract, backward=rule_backward_by_autograd(gated_delta_contract))


def _core_inputs(seed, k_heads=2, v_heads=4, dk=8, dv=6, batch=2, seqlen=24, kernel=4):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * k_heads * dk + v_heads * dv

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=F64)).requires_grad_()

    inputs = dict(mixed_qkv=r(batch, seqlen, width), a=r(batch, seqlen, v_heads), b=r(batch, seqlen, v_heads),
                  conv_weight=r(width, kernel, scale=0.5), conv_bias=r(width, scale=0.1),
                  A_log=torch.rand(v_heads, generator=gen, dtype=F64).log().requires_grad_(), dt_bias=r(v_heads, scale=0.5))
    return inputs, dict(head_k_dim=dk, head_v_dim=dv, chunk_size=8)


def _rule_inputs(seed, tokens, docs, k_heads=1, v_heads=2, dk=8, dv=10):
    """q, k [1, T, Hk, dk]; v [1, T, Hv, dv]; a scalar decay g and beta [1, T, Hv]; h0 [docs, Hv, dk, dv]."""
    gen = torch.Generator().manual_seed(seed)
    return {n: t.requires_grad_() for n, t in dict(
        q=unit(gen, 1, tokens, k_heads, dk), k=unit(gen, 1, tokens, k_heads, dk),
        v=torch.randn(1, tokens, v_heads, dv, generator=gen, dtype=F64),
        g=-torch.rand(1, tokens, v_heads, generator=gen, dtype=F64),
        beta=torch.rand(1, tokens, v_heads, generator=gen, dtype=F64),
        initial_state=torch.randn(docs, v_heads, dk, dv, generator=gen, dtype=F64)).items()}


GDN = RuleFamily(name="gdn", module=gdn_fused, core=gated_delta_core, fused_rule=fused_gated_delta_rule,
                 pure_rule=chunk_gated_delta_rule, choose_kernel=choose_gdn_kernel, fla_status=fla_rule_status,
                 contract=gated_delta_contract, op="fused_gated_delta_rule", fla_entry="chunk_gated_delta_rule",
                 register=register_rule, core_inputs=_core_inputs, rule_inputs=_rule_inputs,
                 core_cases=({"k_heads": 1}, {"k_heads": 2}))


@pytest.fixture
def family():
    return GDN


def test_bad_streams_are_refused_in_one_line():
    inputs = _rule_inputs(3, 6, 1)
    q, k, v, g, beta = (t.detach() for t in list(inputs.values())[:5])
    with pytest.raises(ValueError, match=r"expects one stream: .*flatten rows first") as error:
        fused_gated_delta_rule(q.expand(2, -1, -1, -1), k, v, g, beta, cu_seqlens=torch.tensor([0, 6]), rule="contract")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="fused gated delta rule 'nope' is not registered"):
        fused_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 6]), rule="nope")


def test_fla_kernels_under_the_triton_interpreter_match_the_pure_core():
    """FLA 0.6.0's real Triton kernels on CPU (``fla_gdn_on_cpu.py``, a fresh process)."""
    paths = [str(_kernels_folder()), str(ROOT / "src"), str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run([sys.executable, "-m", "tests.models.linear.fla_gdn_on_cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["fla"] == "0.6.0"
    assert max(report["contract"].values()) <= 1e-6, report["contract"]  # ours = FLA's naive reference (fp32)
    assert set(report["cases"]) == {"core", "states", "segments", "saturated"}
    assert len(report["cases"]["core"]) == 8 and {"final_states", "grad initial_state"} <= set(report["cases"]["states"])
    for case, errors in report["cases"].items():
        for quantity, (fla_error, pure_error) in errors.items():
            tol = SATURATED_TOL if case == "saturated" else 1e-5
            assert fla_error <= tol and pure_error <= 1e-5, (case, quantity, fla_error, pure_error)
    assert_backward_routes(report["routes"], "chunk_fwd_kernel_o")  # FLA's backward alone: the same bits
