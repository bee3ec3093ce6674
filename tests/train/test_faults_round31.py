"""Round 31: what transformers keeps in float32, under FSDP's bf16 and under autocast (docs/reliability.md)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import run_each

D, E, K, H = 64, 32, 4, 4  # hidden, experts, experts per token, heads


class _Router(torch.nn.Module):
    """NemotronH's ``NemotronHTopkRouter`` with one group: a float32 linear, sigmoid, top-k."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(E, D) * 0.02)  # a trained router's scale: near ties

    def forward(self, x):
        logits = F.linear(x.type(torch.float32), self.weight.type(torch.float32))
        return logits, logits.sigmoid().topk(K, dim=-1, sorted=False).indices


class _Mixer(torch.nn.Module):
    """A mixer with bare float32 parameters read in elementwise math (Flint's ``sinks``, Kimi's ``dt_bias``,
    AFMoE's ``expert_bias``) next to its own bf16 linear."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(D, H, bias=False)
        self.sinks = torch.nn.Parameter(1 + torch.randn(H) * 1e-3)  # bf16 rounds these to 1/128 steps

    def forward(self, x):
        return self.proj(x).float() * self.sinks


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.gate, self.mixer = _Router(), _Mixer()
        self.up = torch.nn.Linear(D, D, bias=False)

    def forward(self, x):
        h = self.norm(x)
        logits, experts = self.gate(h)
        self.seen = (h.detach(), logits.detach(), experts, self.mixer(h).detach())
        return x + self.up(h) * logits.softmax(-1).amax(-1, keepdim=True).to(x.dtype)


class _Model(torch.nn.Module):
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight", "sinks"]  # NemotronH's + Flint's

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _fsdp_bf16(rank, world, fixed: bool):
    """One forward at dp_shard=2 under FSDP's bf16: per block, the router's logits and experts against the one-process
    float32 router on the same input, and the mixer's output against float32 ``sinks``."""
    import warnings

    from hybridpar.parallel.data import fsdp
    from hybridpar.parallel.dims import ParallelDims

    torch.manual_seed(0)
    model = _Model()
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    dims, float32_units = ParallelDims(dp_shard=world), getattr(fsdp, "float32_units", None)
    if not fixed:  # the old code: every parameter in its block's bf16 unit
        fsdp.float32_units = lambda *args: []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every kept parameter sits in a block: no warning
            fsdp.apply_fsdp(model, dims.build_mesh(), dims, mixed_precision="bf16")
    finally:
        if float32_units is not None:
            fsdp.float32_units = float32_units
    torch.manual_seed(1 + rank)
    model(torch.randn(256, D))
    out = []
    for i, layer in enumerate(model.layers):
        h, logits, experts, mixed = layer.seen
        want = F.linear(h.float(), reference[f"layers.{i}.gate.weight"])
        mixer = F.linear(h, reference[f"layers.{i}.mixer.proj.weight"].to(h.dtype)).float()
        out.append((h.dtype, logits.dtype, torch.equal(logits, want),
                    float((experts.sort(-1).values != want.sigmoid().topk(K, -1).indices.sort(-1).values).any(-1)
                          .float().mean()),
                    torch.equal(mixed, mixer * reference[f"layers.{i}.mixer.sinks"])))
    return out


@pytest.fixture(scope="module")
def fsdp_runs():
    new, old = run_each(2, _fsdp_bf16, [(True,), (False,)], timeout_s=300)  # one launch; each by rank
    return {True: new, False: old}


def test_under_fsdp_bf16_what_transformers_keeps_in_float32_is_gathered_in_float32(fsdp_runs):
    """FSDP2's bf16 policy gathered a float32-kept router's weight in bf16: its logits were not one process's
    float32 router's on the same input, and some tokens got other experts; a bare kept parameter (``sinks``) was
    rounded to bf16 too. Now each owner is a unit of its own with a float32 policy: the logits equal the float32
    router's bitwise, the mixer's output uses float32 ``sinks``, and the block's own linear is still bf16."""
    for rank in fsdp_runs[True]:
        for stream, logits, equal, flipped, sinks in rank:
            assert stream == torch.bfloat16 and logits == torch.float32 and equal and flipped == 0 and sinks
    old = [row for rank in fsdp_runs[False] for row in rank]
    assert not any(equal for _, _, equal, _, _ in old) and not any(sinks for *_, sinks in old)
    assert max(flipped for _, _, _, flipped, _ in old) > 0


class _ConvMixer(torch.nn.Module):
    """Bailing-hybrid's and GLM5-Next's kept ``conv1d`` (a depthwise causal conv on a bf16 ``in_proj`` output) and a
    kept bare ``dt_bias`` (Kimi Linear's) read in elementwise math."""

    _keep_in_fp32_modules_strict = ["gate.weight", "conv1d", "dt_bias"]

    def __init__(self):
        super().__init__()
        self.in_proj = torch.nn.Linear(D, D, bias=False)
        self.conv1d = torch.nn.Conv1d(D, D, 4, groups=D, padding=3)
        self.dt_bias = torch.nn.Parameter(1 + torch.randn(D) * 1e-3)

    def forward(self, x):  # [T, D]
        u = self.conv1d(self.in_proj(x).T[None])[0, :, : x.shape[0]].T
        return u, F.softplus(u + self.dt_bias)


def test_under_autocast_a_kept_conv_runs_in_float32_and_bare_kept_parameters_stay_float32():
    """Entries that do not name ``*.weight`` (``conv1d``, ``dt_bias``, ``sinks``, ``lm_head``) were not honoured:
    under autocast a kept ``conv1d`` ran in bf16 (cuDNN/oneDNN's conv is an autocast op). Now every module whose
    ``weight`` a strict entry matches runs with autocast off and its 16-bit inputs in float32: the conv's output is
    one process's float32 conv of the same (bf16) input, bitwise. A bare kept parameter in elementwise math was
    float32 already (checked: ``dt_bias``), and the ``in_proj`` transformers does not keep is still bf16."""
    from hybridpar.parallel import precision

    torch.manual_seed(0)
    model = _ConvMixer()
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(256, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        old = model(x)[0]
    precision.apply_autocast(model)
    u, dt = model(x)  # the wrapped forward enters autocast itself
    h = F.linear(x.bfloat16(), reference["in_proj.weight"].bfloat16())  # the bf16 in_proj, as before
    want = F.conv1d(h.float().T[None], reference["conv1d.weight"], reference["conv1d.bias"], padding=3, groups=D)
    want = want[0, :, :256].T
    assert u.dtype == torch.float32 and torch.equal(u, want)
    assert torch.equal(dt, F.softplus(want + reference["dt_bias"]))
    assert old.dtype == torch.bfloat16 and float((old.detach().float() - want).abs().max()) > 1e-3  # the old bf16 conv
    weight = reference["conv1d.weight"].requires_grad_()  # the kept conv's gradient is the float32 conv's
    (dt.sum() + u.sum()).backward()
    theirs = F.conv1d(h.float().T[None], weight, reference["conv1d.bias"], padding=3, groups=D)[0, :, :256].T
    (F.softplus(theirs + reference["dt_bias"]).sum() + theirs.sum()).backward()
    assert model.conv1d.weight.grad.dtype == torch.float32 and torch.allclose(model.conv1d.weight.grad, weight.grad,
                                                                               rtol=1e-6, atol=0)
    assert precision.float32_modules(model) == [model.conv1d] and sorted(precision.float32_parameters(model)) == [
        "conv1d.bias", "conv1d.weight", "dt_bias"]


def test_a_kept_lm_head_that_hybridpars_loss_computes_in_bf16_is_said_in_one_line():
    """Hunyuan V4 keeps ``lm_head`` in float32; hybridpar's loss takes ``lm_head.weight`` into bf16 matmuls under
    autocast (``models/lm_head_loss.py``), which this round does not change: one warning names it and the fix."""
    from hybridpar.config_rules import Notice
    from hybridpar.parallel.precision import apply_autocast

    class _Head(torch.nn.Module):
        _keep_in_fp32_modules_strict = ["lm_head"]

        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(D, 8, bias=False)

        def get_output_embeddings(self):
            return self.lm_head

    with pytest.warns(Notice, match=r"keeps lm_head in float32.*parallel.mixed_precision=null"):
        apply_autocast(_Head())

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hybridpar.parallel.data.fsdp import float32_units

    model = _Model()  # under FSDP a kept parameter outside the blocks stays in the root's bf16 unit: said too
    model._keep_in_fp32_modules_strict = ["gate.weight", "sinks", "lm_head"]
    model.lm_head = torch.nn.Linear(D, 8, bias=False)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.warns(Notice, match=r"FSDP gathers Linear.weight in torch.bfloat16 though transformers keeps them"):
        units = float32_units(model, list(model.layers), bf16)
    got = [(u, p.param_dtype, p.cast_forward_inputs) for u, p in units]
    for layer in model.layers:  # the router (float32, inputs cast); the mixer's linear (bf16) before the mixer
        assert (layer.gate, torch.float32, True) in got
        assert got.index((layer.mixer.proj, torch.bfloat16, True)) + 1 == got.index((layer.mixer, torch.float32, False))
    assert len(units) == 6 and float32_units(model, list(model.layers), MixedPrecisionPolicy()) == []


class _KernelMixer(torch.nn.Module):
    """Bailing-hybrid's (GLM5-Next's) mixer: its kept ``conv1d`` is read as ``self.conv1d.weight`` by a kernel
    (``causal_conv1d_fn``), so the conv module's own forward never runs."""

    def __init__(self):
        super().__init__()
        self.conv1d = torch.nn.Conv1d(D, D, 4, groups=D, padding=3)

    def forward(self, x):  # [T, D]
        return F.conv1d(x.T[None], self.conv1d.weight, self.conv1d.bias, padding=3, groups=D)[0, :, : x.shape[0]].T


def test_a_kept_parameter_its_parent_reads_itself_is_said_not_sharded_apart():
    """A kept module whose parent reads its weight itself cannot be reached by autocast-off on its forward nor gathered
    by an FSDP unit of its own: a unit of its own left it a sharded DTensor in its parent's conv (Bailing-hybrid at
    dp_shard=2 under bf16: "got mixed torch.Tensor and DTensor"). It stays in its block's unit, and both say so."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hybridpar.config_rules import Notice
    from hybridpar.parallel.data.fsdp import float32_units
    from hybridpar.parallel.precision import apply_autocast, read_directly

    class _Net(torch.nn.Module):
        _keep_in_fp32_modules_strict = ["conv1d"]

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([_KernelMixer()])

    model = _Net()
    assert read_directly(model) == {model.layers[0].conv1d: "_KernelMixer.conv1d.weight"}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.warns(Notice, match=r"FSDP gathers Conv1d.bias, Conv1d.weight in torch.bfloat16.*reads them itself"):
        assert float32_units(model, [model.layers[0]], bf16) == []
    with pytest.warns(Notice, match=r"keeps _KernelMixer.conv1d.weight in float32, but its parent reads it itself"):
        apply_autocast(model)


def test_a_kept_parameter_under_a_forward_hybridpar_replaced_stays_in_its_block_unit():
    """hybridpar's Kimi Linear core replaces the attention's forward and reads ``forget_gate.dt_bias`` itself, so the
    gate's own forward never runs: made a float32 unit of its own, ``dt_bias`` stayed a sharded DTensor there (a
    tiny Kimi Linear with ``install_kda_core`` at dp_shard=2 under bf16: "would remove or reshape sharded dimension
    0"). An owner below a replaced forward inside its block stays in the block's unit, said in one warning."""
    import types

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hybridpar.config_rules import Notice
    from hybridpar.parallel.data.fsdp import float32_units

    class _Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dt_bias = torch.nn.Parameter(torch.zeros(D))

    class _Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.forget_gate = _Gate()

    class _Net(torch.nn.Module):
        _keep_in_fp32_modules_strict = ["dt_bias"]

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"attn": _Attention()})])

    model = _Net()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert [u for u, _ in float32_units(model, list(model.layers), bf16)] == [model.layers[0]["attn"].forget_gate]
    attention = model.layers[0]["attn"]
    attention.forward = types.MethodType(lambda self, x: x + self.forget_gate.dt_bias, attention)  # switch_forward
    with pytest.warns(Notice, match=r"FSDP gathers _Gate.dt_bias in torch.bfloat16"):
        assert float32_units(model, list(model.layers), bf16) == []
