"""The fused Mamba path (``models/mamba/fused.py``, ``fused_op.py``): which kernel runs and why, the
mapping of Mamba2's arguments onto FLA's ``chunk_simple_gla`` in float64 on CPU, and the custom
ops under ``torch.compile``.

``simple_gla_contract`` is FLA's documented op written out token by token in float64 from its
docstring and ``naive_recurrent_simple_gla`` (the recurrence ``S = S * exp(g_t) + k_t v_t^T``,
``o_t = scale * q_t S``), per ``cu_seqlens`` document, states ``[N, H, V, K]`` with
``state_v_first``. The fused path with this contract in place of the kernel must equal the
pure-PyTorch core to 1e-10 in outputs, states and every input's gradient, by either route of the
backward op: autograd of the scan's forward (``"contract"``) or the scan's backward alone, registered as
FLA's is (``"contract_direct"``: autograd of the contract, called as ``fla_backward.py`` calls FLA's;
the same bits as the other route). FLA's real kernels,
run by triton's interpreter, are held to the pure core in ``test_fla_on_cpu.py``; on a GPU,
``benchmarks/run_on_gpu.sh`` does the same in float32 at 1e-4.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hybridpar.models.mamba import fla_backward, fused
from hybridpar.models.mamba.core import mamba_conv_scan, row_documents
from hybridpar.models.mamba.fused import choose_kernel, kernel_for, use_mamba_kernel
from hybridpar.models.mamba.fused_op import (autograd_on, fused_conv_scan, gated_backward_refusal, register_scan,
                                             states_at_boundaries)
from tests.models.mamba.test_core import F64, assert_close, grads, make_case


def simple_gla_contract(q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                        state_v_first=False):
    """FLA's ``chunk_simple_gla`` contract, sequentially: ``q, k [1, T, H, K]``, ``v [1, T, H, V]``,
    ``g [1, T, H]`` (log decay), states ``[N, H, V, K]`` (``state_v_first``)."""
    assert state_v_first and q.shape[0] == 1 and cu_seqlens is not None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    heads, dim_k, dim_v = q.shape[2], q.shape[3], v.shape[3]
    out_dtype, acc = v.dtype, torch.promote_types(q.dtype, torch.float32)  # FLA: o in v's dtype, fp32 states
    q, k, v, g = (t.to(acc) for t in (q, k, v, g))
    outputs, finals = [], []
    for n in range(cu_seqlens.shape[0] - 1):
        state = initial_state[n] if initial_state is not None else q.new_zeros(heads, dim_v, dim_k)
        for t in range(int(cu_seqlens[n]), int(cu_seqlens[n + 1])):
            state = state * g[0, t].exp()[:, None, None] + v[0, t][:, :, None] * k[0, t][:, None, :]  # [H, V, K]
            outputs.append(scale * (state @ q[0, t][:, :, None]).squeeze(-1))  # [H, V]
        finals.append(state)
    return torch.stack(outputs)[None].to(out_dtype), (torch.stack(finals) if output_final_state else None)


def contract_backward(q, k, v, g, do, dht, *, scale, initial_state, cu_seqlens, state_v_first):
    """``(dq, dk, dv, dg, dh0)`` of ``simple_gla_contract`` seeded with ``do`` and ``dht`` (None: no final
    states), by autograd of the contract, in ``fla_backward.simple_gla_backward``'s convention."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v, g, initial_state) if t is not None]
    with autograd_on():
        o, ht = simple_gla_contract(*leaves[:4], scale=scale, initial_state=leaves[4] if len(leaves) > 4 else None,
                                    output_final_state=dht is not None, cu_seqlens=cu_seqlens, state_v_first=state_v_first)
        outputs = [(o, do)] + ([(ht, dht)] if dht is not None else [])
        found = torch.autograd.grad([t for t, _ in outputs], leaves, [d for _, d in outputs], allow_unused=True)
    return (*found[:4], found[4] if len(leaves) > 4 else None)


register_scan("contract", simple_gla_contract)
register_scan("contract_direct", simple_gla_contract, backward=contract_backward)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.9)])
def test_fused_mapping_equals_the_pure_core_on_packed_rows(groups, dt_limit):
    """Two rows of packed documents (boundaries inside and on chunk edges, a one-token document):
    outputs and every input's gradient."""
    inputs, cu, sizes = make_case(20 + groups, groups)
    batch, seqlen = inputs["dt"].shape[:2]
    cu_docs = row_documents(cu, batch, seqlen, "cpu")
    y_ref = mamba_conv_scan(*inputs.values(), **sizes, cu_docs=cu_docs, dt_limit=dt_limit)
    y = fused_conv_scan(*inputs.values(), head_dim=sizes["head_dim"], state_size=sizes["state_size"], cu_docs=cu_docs,
                        dt_limit=dt_limit, scan="contract")
    assert_close(y, y_ref, "y")
    for name, g, g_ref in zip(inputs, grads([y], inputs), grads([y_ref], inputs)):
        assert_close(g, g_ref, f"grad {name}")


@pytest.mark.parametrize("scan", ["contract", "contract_direct"])
@pytest.mark.parametrize("groups", [1, 2])
def test_fused_mapping_carries_initial_and_final_states(groups, scan):
    """The CP ``state`` strategy's calls: conv histories and SSM states entering documents (one
    entry -1: none), final states at every document end, with gradients through both (by either route
    of the backward)."""
    inputs, cu, sizes = make_case(30 + groups, groups, batch=1)
    gen = torch.Generator().manual_seed(3)
    xBC, dt, weight = inputs["xBC"], inputs["dt"], inputs["conv_weight"]
    heads, docs = dt.shape[-1], cu.shape[0] - 1
    init_at = cu[:-1].clone()
    init_at[1] = -1  # the second document starts from zeros
    history = torch.randn(docs, weight.shape[1] - 1, xBC.shape[-1], generator=gen, dtype=F64).requires_grad_()
    h0 = torch.randn(docs, heads, sizes["head_dim"], sizes["state_size"], generator=gen, dtype=F64).requires_grad_()
    states_in = dict(init_at=init_at, init_states=h0, conv_history=history, final_at=cu[1:] - 1)
    all_inputs = {**inputs, "history": history, "h0": h0}
    y_ref, final_ref = mamba_conv_scan(*inputs.values(), **sizes, cu_docs=cu, **states_in)
    y, final = fused_conv_scan(*inputs.values(), head_dim=sizes["head_dim"], state_size=sizes["state_size"], cu_docs=cu,
                               scan=scan, **states_in)
    assert_close(y, y_ref, "y")
    assert_close(final, final_ref, "final states")
    for name, g, g_ref in zip(all_inputs, grads([y, final], all_inputs), grads([y_ref, final_ref], all_inputs)):
        assert_close(g, g_ref, f"grad {name}")


@pytest.mark.parametrize("want_y, seeded", [(True, ("y", "final")), (True, ("y",)), (False, ("final",))])
def test_a_scan_with_a_backward_of_its_own_runs_it_alone_with_autograds_seeds(want_y, seeded):
    """The backward op's direct route (FLA's: ``fla_backward.py``) against autograd of the scan's forward:
    every gradient the same bits, the scan's forward never run in the backward but inside its own
    backward, once; an output without a gradient seeds zeros (``y``) or zero final states, as autograd
    would seed FLA's Function."""
    inputs, cu, sizes = make_case(41, 2, batch=1)
    gen = torch.Generator().manual_seed(4)
    h0 = torch.randn(cu.shape[0] - 1, inputs["dt"].shape[-1], sizes["head_dim"], sizes["state_size"], generator=gen,
                     dtype=F64).requires_grad_()
    states = dict(init_at=cu[:-1], init_states=h0, final_at=cu[1:] - 1)
    leaves = {**inputs, "h0": h0}
    calls = []
    register_scan("counted_direct", lambda *a, **kw: calls.append("scan") or simple_gla_contract(*a, **kw),
                  backward=lambda *a, **kw: calls.append("backward") or contract_backward(*a, **kw))
    found = {}
    for scan in ("contract", "counted_direct"):
        y, final = fused_conv_scan(*inputs.values(), head_dim=sizes["head_dim"], state_size=sizes["state_size"],
                                   cu_docs=cu, scan=scan, want_y=want_y, **states)
        calls.clear()
        found[scan] = grads([{"y": y, "final": final}[name] for name in seeded], leaves)
    assert calls == ["backward"], calls  # the contract's forward ran inside it (autograd), not before
    for name, a, b in zip(leaves, found["contract"], found["counted_direct"]):
        assert torch.equal(a, b), name


def test_an_fla_core_whose_internals_differ_keeps_autograd_of_its_forward(monkeypatch, caplog):
    """``fla_internals`` names what it misses (a function, a keyword); where fla-core does not import (this
    environment), ``simple_gla_backward`` is None, logged once at INFO with why."""
    import sys
    import types

    chunk = types.ModuleType("fake_fla_chunk")
    chunk.backward = lambda q, k, v, g, do, scale: None
    monkeypatch.setitem(sys.modules, "fake_fla_chunk", chunk)
    needed = {"fake_fla_chunk:backward": ("q", "do", "dht")}
    assert fla_backward.fla_internals(needed, "fake_fla_chunk:entry") == (
        None, "fla-core's fake_fla_chunk.backward takes no dht")
    assert fla_backward.fla_internals({}, "fake_fla_chunk:entry") == (None, "fla-core has no fake_fla_chunk.entry")
    monkeypatch.setattr(fla_backward, "_RESOLVED", {})
    with caplog.at_level(logging.INFO, logger=fla_backward.__name__):
        assert fla_backward.simple_gla_backward() is None and fla_backward.simple_gla_backward() is None
    lines = [r.getMessage() for r in caplog.records if r.name == fla_backward.__name__]
    assert lines == ["mamba scan backward: autograd through FLA's forward (fla-core's internals could not be "
                     "checked (ModuleNotFoundError: No module named 'fla'))"], lines


def test_fused_core_keeps_only_its_inputs_for_backward():
    """Checkpointed: the saved tensors are the inputs (no conv output, no q/k/v), as the pure op."""
    inputs, cu, sizes = make_case(7, 2)
    batch, seqlen = inputs["dt"].shape[:2]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused_conv_scan(*inputs.values(), head_dim=sizes["head_dim"], state_size=sizes["state_size"],
                        cu_docs=row_documents(cu, batch, seqlen, "cpu"), scan="contract")
    ids = {id(t) for t in inputs.values()}
    largest = max(t.numel() for t in saved)
    assert largest <= inputs["xBC"].numel(), (largest, inputs["xBC"].numel())
    assert {id(t) for t in saved if t.numel() == inputs["xBC"].numel()} <= ids


@pytest.mark.parametrize(
    "device, dtype, available, mode, expected",
    [
        ("cpu", torch.float32, True, "auto", ("pure", "device cpu")),
        ("cuda", torch.float64, True, "auto", ("pure", "dtype torch.float64 has no fused kernel")),
        ("cuda", torch.bfloat16, False, "auto", ("pure", "fla-core is not installed; pip install 'hybridpar[gpu]'")),
        ("cuda", torch.bfloat16, True, "auto", ("fla", "fla-core chunk_simple_gla + causal_conv1d")),
        ("cuda", torch.float32, True, "pure", ("pure", "use_mamba_kernel('pure')")),
    ],
)
def test_kernel_rules(device, dtype, available, mode, expected):
    assert kernel_for(device, dtype, available, mode=mode) == expected


def test_states_inside_documents_keep_the_pure_core():
    cu = torch.tensor([0, 5, 9, 12])
    assert states_at_boundaries(cu, cu[:-1], cu[1:] - 1) is None
    assert states_at_boundaries(cu, torch.tensor([0, -1]), None) is None
    assert states_at_boundaries(cu, None, torch.tensor([3, 8, 11])) == "final states requested inside documents"
    assert states_at_boundaries(cu, torch.tensor([2]), None) == "initial states entering inside documents"


@pytest.mark.parametrize("hopper, triton, tilelang, refused", [
    (True, "3.6.0", False, True), (True, "3.4.0", False, True), (True, "3.7.0+git1a2b", False, True),
    (True, "3.7.1", False, False), (True, "3.3.1", False, False), (False, "3.6.0", False, False),
    (True, "3.6.0", True, False)])
def test_fla_gated_backward_refusal_follows_fla_640(hopper, triton, tilelang, refused):
    """An H200 with triton 3.6 (our first GPU lease): FLA 0.6.0 raises in the backward of its gated
    kernels (wrong results with triton 3.4 to 3.7.0 on Hopper, FLA #640) unless TileLang takes it."""
    reason = gated_backward_refusal(hopper, triton, tilelang)
    assert (reason is not None) == refused
    if refused:
        assert reason.startswith(f"fla-core refuses its gated backward on Hopper with triton {triton} (FLA #640)")


@pytest.mark.parametrize("family", ["mamba", "gdn"])
def test_training_on_a_refusing_gpu_keeps_the_pure_core_and_inference_keeps_fla(family):
    """Where FLA's backward cannot run, a training forward (autograd recording) takes the pure core and
    says why; generation (no grad) still takes FLA's forward kernels. ``x`` stands in for CUDA activations."""
    from types import SimpleNamespace

    x = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    status = lambda: (True, "fla-core 0.6.0 chunk_simple_gla")  # noqa: E731
    refusal = lambda: "fla-core refuses its gated backward on Hopper with triton 3.6.0 (FLA #640)"  # noqa: E731
    log = logging.getLogger("test")
    assert fused.select_kernel(family, x, status, log, backward=refusal) == ("pure", refusal())
    with torch.no_grad():
        assert fused.select_kernel(family, x, status, log, backward=refusal) == ("fla", "fla-core 0.6.0 chunk_simple_gla")
    assert fused.select_kernel(family, x, status, log, backward=lambda: None)[0] == "fla"
    with use_mamba_kernel("fla"), pytest.raises(ValueError, match="cannot run here: fla-core refuses its gated backward"):
        fused.select_kernel(family, x, status, log, backward=refusal)


def test_the_kernel_that_runs_is_logged_once_with_its_reason(caplog, monkeypatch):
    monkeypatch.setattr(fused, "_LOGGED", set())
    inputs, cu, sizes = make_case(1, 1)
    with caplog.at_level(logging.INFO, logger="hybridpar.models.mamba.fused"):
        for _ in range(2):
            mamba_conv_scan(*(t.detach() for t in inputs.values()), **sizes)
    lines = [r.getMessage() for r in caplog.records if r.name == "hybridpar.models.mamba.fused"]
    assert lines == ["mamba kernel: pure (device cpu; torch.float64 on cpu)"], lines
    cu_docs = row_documents(None, 2, 8, "cpu")
    assert choose_kernel(torch.zeros(2, 8, 4), cu_docs, None, None) == ("pure", "device cpu")
    with use_mamba_kernel("pure"):
        assert choose_kernel(torch.zeros(2, 8, 4), cu_docs, None, None) == ("pure", "use_mamba_kernel('pure')")
    with use_mamba_kernel("fla"), pytest.raises(ValueError, match=r"use_mamba_kernel\('fla'\) cannot run here: device cpu"):
        choose_kernel(torch.zeros(2, 8, 4), cu_docs, None, None)
    with pytest.raises(ValueError, match="'triton' is unknown"):
        with use_mamba_kernel("triton"):
            pass


def test_fused_op_passes_torch_library_opcheck():
    """Schema, fake kernel (shapes and dtypes, the bf16 activations of mixed precision too), autograd
    registration and AOT dispatch of ``hybridpar::fused_conv_scan``, against its real kernel."""
    for dtype in (F64, torch.bfloat16):
        inputs, cu, sizes = make_case(11, 2, batch=1)
        args = [t.detach().to(dtype if name in ("xBC", "dt") else t.dtype).requires_grad_()
                for name, t in inputs.items()]
        xBC, dt, weight = args[0], args[1], args[2]
        history = torch.randn(cu.shape[0] - 1, weight.shape[1] - 1, xBC.shape[-1], dtype=F64)
        h0 = torch.randn(cu.shape[0] - 1, dt.shape[-1], sizes["head_dim"], sizes["state_size"], dtype=F64)
        op_args = (*args[:7], h0.requires_grad_(), history.requires_grad_(), cu, cu[:-1], cu[1:] - 1,
                   sizes["head_dim"], sizes["state_size"], 0.0, float("inf"), True, True, "contract")
        torch.library.opcheck(torch.ops.hybridpar.fused_conv_scan.default, op_args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                          "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("with_states", [False, True])
def test_fused_core_compiles_without_graph_breaks_and_matches_the_pure_core(with_states):
    """``torch.compile(fullgraph=True)`` through the fused path (a graph break raises): two opaque ops.
    With the CP ``state`` strategy's states the boundary check runs inside the op."""
    inputs, cu, sizes = make_case(21, 2, batch=1)
    states = {}
    if with_states:
        gen = torch.Generator().manual_seed(5)
        heads, docs = inputs["dt"].shape[-1], cu.shape[0] - 1
        states = dict(init_at=cu[:-1], final_at=cu[1:] - 1, init_states=torch.randn(
            docs, heads, sizes["head_dim"], sizes["state_size"], generator=gen, dtype=F64).requires_grad_())
    leaves = {**inputs, **{k: v for k, v in states.items() if k == "init_states"}}

    def core(*tensors):
        given = {**states, **dict(zip(["init_states"], tensors[7:]))}  # init_states: a leaf of this call
        out = mamba_conv_scan(*tensors[:7], **sizes, cu_docs=cu, **given)
        return out if isinstance(out, tuple) else (out,)

    torch._dynamo.reset()
    with fused.use_stand_in("contract"):
        got = torch.compile(core, backend="aot_eager", fullgraph=True)(*leaves.values())
    want = core(*leaves.values())  # the pure core, eager
    for a, b in zip(got, want):
        assert_close(a, b, "compiled fused output")
    for name, g, g_ref in zip(leaves, grads(list(got), leaves), grads(list(want), leaves)):
        assert_close(g, g_ref, f"compiled fused grad {name}")


def test_fused_op_refuses_states_inside_documents():
    """Outside compile such calls go to the pure core (``choose_kernel``); the op itself refuses them."""
    inputs, cu, sizes = make_case(3, 1, batch=1)
    with pytest.raises(ValueError, match="initial states entering inside documents; run this call with"):
        heads, docs = inputs["dt"].shape[-1], cu.shape[0] - 1
        fused_conv_scan(*inputs.values(), head_dim=sizes["head_dim"], state_size=sizes["state_size"], cu_docs=cu,
                        init_at=cu[:-1] + 1, scan="contract",
                        init_states=torch.zeros(docs, heads, sizes["head_dim"], sizes["state_size"], dtype=F64))


def test_selective_checkpointing_recomputes_the_mamba_core_and_keeps_attention_kernels():
    import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn ops)

    from hybridpar.parallel.checkpointing import _is_mixing_kernel, _kept_kernel_output

    for op, kept in ((torch.ops.hybridpar.fused_conv_scan.default, False),
                     (torch.ops.hybridpar.ssd_chunk_scan.default, False),
                     (torch.ops.torch_attn._varlen_attn.default, True)):
        assert _is_mixing_kernel(op) and _kept_kernel_output(op) == kept, op


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_compiled_model_with_the_fused_path_equals_eager_pure_without_graph_breaks(checkpointing):
    """The tiny hybrid, blocks compiled by ``parallelize`` (aot_eager), its Mamba layers on the fused
    path (FLA's contract standing in for the kernel), with and without full checkpointing: no
    graph break, loss and every parameter gradient equal to the eager pure-PyTorch model in float64."""
    import copy

    from torch._dynamo.utils import counters

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    torch.manual_seed(0)
    base = HybridLM(HybridConfig.from_preset("tiny", dtype=F64))
    eager = parallelize(copy.deepcopy(base), ParallelDims())
    compiled = parallelize(copy.deepcopy(base), ParallelDims(), compile="aot_eager",
                           activation_checkpointing=checkpointing)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 9, 25, 32], dtype=torch.int32))
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    weight = torch.randn(1, 32, 256, dtype=F64, generator=torch.Generator().manual_seed(2))
    calls = []
    register_scan("counted", lambda *args, **kwargs: calls.append(1) or simple_gla_contract(*args, **kwargs))
    torch._dynamo.reset()
    counters.clear()
    eager_loss = (eager(ids, packed=packed) * weight).sum()
    eager_loss.backward()
    assert not calls
    with fused.use_stand_in("counted"):
        loss = (compiled(ids, packed=packed) * weight).sum()
        loss.backward()
    assert dict(counters["graph_break"]) == {}
    mamba_layers = base.config.pattern.count("M")
    # each layer's forward and its backward op's recompute (+ the checkpoint's recompute of the forward)
    assert len(calls) == (2 if checkpointing == "none" else 3) * mamba_layers
    assert abs(loss.item() - eager_loss.item()) < 1e-10 * abs(eager_loss.item())
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, f"grad {name}")


@pytest.mark.parametrize("packed_rows", [True, False])
def test_every_layer_and_call_of_a_step_passes_one_cu_seqlens_tensor(packed_rows):
    """FLA caches the chunk indices it builds from ``cu_seqlens`` (a host sync each) by the tensor's
    identity, so every Mamba layer's scan, in forward and in backward's recompute, gets the same
    tensor object within a step (``core.shared_row_documents``); a new batch gets a new one."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hybrid import HybridConfig, HybridLM

    seen = []
    register_scan("identity", lambda *args, **kwargs: seen.append(kwargs["cu_seqlens"]) or
                  simple_gla_contract(*args, **kwargs))
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", dtype=F64))
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    steps = []
    for _ in range(2):
        packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 9, 25, 32], dtype=torch.int32)) if packed_rows else None
        seen.clear()
        with fused.use_stand_in("identity"):
            model(ids, packed=packed).sum().backward()
        assert len(seen) == 2 * model.config.pattern.count("M")  # each layer's forward and its backward's recompute
        assert len({id(t) for t in seen}) == 1, "one cu_seqlens object per step"
        steps.append(seen[0])
    assert packed_rows == (steps[0] is not steps[1])  # a new batch builds its own; unpacked shapes share one
    assert steps[0].tolist() == ([0, 9, 25, 32] if packed_rows else [0, 32])
