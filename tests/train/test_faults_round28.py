"""Round 28: numerical extremes -- valid but extreme values, each held to a float64 reference (docs/reliability.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpar.models.mamba.core import mamba_conv_scan


def _sequential_scan(x, dt, A, B, C, D, starts, h0=None, final_t=None):
    """The Mamba2 recurrence token by token (float64): ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``, ``y_t = C_t h_t + D x_t``,
    ``h`` reset at the tokens in ``starts`` (``h0 [H, P, N]`` before token 0). ``x [L, H, P]``, ``dt [L, H]``,
    ``B, C [L, G, N]``. Returns ``y``, or ``(y, h_{final_t})``."""
    length, heads, head_dim = x.shape
    repeat = heads // B.shape[1]
    h, ys, final = x.new_zeros(heads, head_dim, B.shape[2]) if h0 is None else h0, [], None
    for t in range(length):
        h = h * (0.0 if t in starts else 1.0)
        h = torch.exp(dt[t] * A)[:, None, None] * h + (dt[t, :, None] * x[t])[..., None] * B[t].repeat_interleave(repeat, 0)[:, None]
        ys.append((h * C[t].repeat_interleave(repeat, 0)[:, None]).sum(-1) + D[:, None] * x[t])
        if t == final_t:
            final = h
    return torch.stack(ys) if final_t is None else (torch.stack(ys), final)


@pytest.mark.parametrize("spike_at", [0, 100])
def test_the_ssd_scan_keeps_float32_precision_after_a_saturated_time_step(spike_at):
    """One token whose dt saturates the softplus (dt = 1e6, A = -e^2) beside steps of dt * A ~ -7e-3: the within-chunk
    cumsum of dt * A reaches -7e6, whose float32 ulp (0.5) swallowed the later steps, and y, d dt, d A_log came out
    19%, 15% and 210% off the sequential recurrence. Now float32 keeps ~1e-7 in y and every gradient."""
    torch.manual_seed(0)
    length, heads, head_dim, state, groups = 192, 2, 4, 4, 1
    xBC = torch.randn(1, length, heads * head_dim + 2 * groups * state, dtype=torch.float64)
    dt_raw = torch.full((1, length, heads), -7.0, dtype=torch.float64)
    dt_raw[:, spike_at] = 1e6
    dt_bias, A_log, D = torch.zeros(heads), torch.full((heads,), 2.0), torch.ones(heads)
    cu_docs = torch.tensor([0, 150, length])  # a second document inside the third chunk
    grad_y = torch.randn(1, length, heads * head_dim, dtype=torch.float64)
    inputs = [t.double().requires_grad_() for t in (xBC, dt_raw, dt_bias, A_log, D)]
    x, B, C = inputs[0][0].split([heads * head_dim, groups * state, groups * state], -1)
    ref = _sequential_scan(x.view(length, heads, head_dim), F.softplus(inputs[1][0] + inputs[2]), -torch.exp(inputs[3]),
                           B.view(length, groups, state), C.view(length, groups, state), inputs[4], {0, 150}).flatten(-2)
    ref_grads = torch.autograd.grad((ref * grad_y[0]).sum(), inputs)
    ours = [t.detach().float().requires_grad_() for t in inputs]
    y = mamba_conv_scan(ours[0], ours[1], None, None, ours[2], ours[3], ours[4], head_dim=head_dim, state_size=state,
                        chunk_size=64, cu_docs=cu_docs)
    grads = torch.autograd.grad((y * grad_y.float()).sum(), ours)
    for name, got, want in [("y", y[0], ref)] + list(zip(["dxBC", "ddt", "ddt_bias", "dA_log", "dD"], grads, ref_grads)):
        error = float((got.double() - want).abs().max() / want.abs().max())
        assert error < 2e-6, (name, error)


@pytest.mark.parametrize("spike_at", [5, 60])
def test_the_ssd_state_points_keep_float32_precision_after_a_saturated_time_step(spike_at):
    """The terms of an initial state entering a document and of a final state leaving it (CP's ``state`` strategy at
    every seam, generation's prefill) beside a token with dt = 1e6: y, the final state and every gradient, the
    initial state's included, within 1e-6 of the float64 recurrence in float32 (3e-7 measured)."""
    torch.manual_seed(0)
    length, heads, head_dim, state, final_t = 128, 2, 4, 4, 100
    xBC = torch.randn(1, length, heads * head_dim + 2 * state, dtype=torch.float64)
    dt_raw = torch.full((1, length, heads), -7.0, dtype=torch.float64)
    dt_raw[:, spike_at] = 1e6
    inputs = [t.requires_grad_() for t in (xBC, dt_raw, torch.zeros(heads, dtype=torch.float64),
                                           torch.full((heads,), 2.0, dtype=torch.float64),
                                           torch.ones(heads, dtype=torch.float64),
                                           torch.randn(1, heads, head_dim, state, dtype=torch.float64))]
    x, B, C = inputs[0][0].split([heads * head_dim, state, state], -1)
    ref, final = _sequential_scan(x.view(length, heads, head_dim), F.softplus(inputs[1][0] + inputs[2]),
                                  -torch.exp(inputs[3]), B.view(length, 1, state), C.view(length, 1, state), inputs[4],
                                  set(), inputs[5][0], final_t)
    grad_y, grad_final = torch.randn_like(ref), torch.randn_like(final)
    ref_grads = torch.autograd.grad((ref * grad_y).sum() + (final * grad_final).sum(), inputs)
    ours = [t.detach().float().requires_grad_() for t in inputs]
    y, states = mamba_conv_scan(ours[0], ours[1], None, None, ours[2], ours[3], ours[4], head_dim=head_dim,
                                state_size=state, chunk_size=64, cu_docs=torch.tensor([0, length]),
                                init_at=torch.tensor([0]), init_states=ours[5], final_at=torch.tensor([final_t]))
    y = y[0].view_as(ref)
    grads = torch.autograd.grad((y * grad_y.float()).sum() + (states[0] * grad_final.float()).sum(), ours)
    pairs = [("y", y, ref), ("final state", states[0], final)]
    pairs += zip(["dxBC", "ddt", "ddt_bias", "dA_log", "dD", "dinit"], grads, ref_grads)
    for name, got, want in pairs:
        error = float((got.double() - want).abs().max() / want.abs().max())
        assert error < 1e-6, (name, error)


def test_weight_decay_leaves_a_mamba1_a_log_matrix_alone():
    """A Mamba1 mixer's ``A_log`` is a matrix ``[d_inner, N]`` (Mamba, FalconMamba, Jamba): the optimizer decayed it as
    a weight, so every step pulled ``A = -exp(A_log)`` toward -1 (mamba_ssm marks it
    ``_no_weight_decay``; the docstring promised SSM parameters undecayed). A step with zero gradients now leaves every
    ``A_log``, ``D`` and ``dt_bias`` exactly as it was and decays the matrices by ``1 - lr * weight_decay``."""
    import transformers as hf

    from hybridpar.config import TrainConfig
    from hybridpar.train.optim import build_optimizer
    from tests.models.hf.mamba1_models import mamba1_config

    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(mamba1_config("jamba")).double()
    optimizer = build_optimizer(model, TrainConfig(lr=0.1, weight_decay=0.5))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    ssm = [name for name in before if name.rsplit(".", 1)[-1] in ("A_log", "D", "dt_bias")]
    assert any(before[name].dim() == 2 for name in ssm)  # Mamba1's A_log matrices
    for name, p in model.named_parameters():
        expected = before[name] * (0.95 if p.dim() >= 2 and name not in ssm else 1.0)
        assert torch.equal(p.detach(), expected), name


def test_a_finite_gradient_norm_past_float32s_squares_is_finite():
    """Gradients of 1e20 in float32 (or bf16: the same range) have a finite norm, but their squares (1e40) overflowed:
    the step's gradient norm read inf and ``train.on_nonfinite`` stopped (or skipped) a step that clipping makes sound.
    The squares now sum in float64: the norm is the float64 one and clipping brings it to ``max_norm``."""
    from hybridpar.train.optim import clip_grad_norm

    torch.manual_seed(0)
    grads = [torch.randn(5, 3, dtype=torch.float64) * 1e20, torch.randn(7, dtype=torch.float64) * 3e19]
    want = torch.cat([g.flatten() for g in grads]).norm()
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.nn.Parameter(torch.zeros_like(g, dtype=dtype)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        rounded = torch.cat([p.grad.double().flatten() for p in params]).norm()
        norm = clip_grad_norm(params, 1.0)
        assert abs(float(norm) / float(rounded) - 1) < 1e-12 and abs(float(rounded) / float(want) - 1) < 1e-2, (dtype, norm)
        clipped = torch.cat([p.grad.double().flatten() for p in params]).norm()
        assert abs(float(clipped) - 1.0) < 1e-2, (dtype, clipped)  # the clipped gradient's norm is max_norm


def _sequential_delta_rule(q, k, v, g, beta):
    """The gated delta rule token by token (float64): ``S <- exp(g_t) S`` (``g [T, H]`` or per key channel
    ``[T, H, dk]``), ``S <- S + k_t beta_t (v_t - S^T k_t)^T``, ``o_t = S^T q_t / sqrt(dk)``."""
    length, heads, dk = k.shape
    state, outs = q.new_zeros(heads, dk, v.shape[-1]), []
    for t in range(length):
        state = torch.exp(g[t]).view(heads, -1, 1) * state
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][..., None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t] * dk ** -0.5))
    return torch.stack(outs)


@pytest.mark.parametrize("rule", ["gated_delta", "kda"])
def test_the_delta_rules_keep_float32_precision_after_a_saturated_decay(rule):
    """Gated DeltaNet (Qwen3-Next) and KDA (Kimi Linear) take ``g = -exp(A_log) softplus(a + dt_bias)``: one token with a
    saturated softplus (g ~ -7e6) beside steps of -7e-3 made the chunk's float32 cumsum ``G`` step by its ulp, and the
    output and every gradient came out 8-20% off the sequential recurrence. Now ~3e-7."""
    from hybridpar.models.linear.gated_delta import chunk_gated_delta_rule
    from hybridpar.models.linear.kda import chunk_kda_rule

    torch.manual_seed(0)
    length, heads, dk, dv = 160, 2, 8, 8
    g_shape = (1, length, heads) + ((dk,) if rule == "kda" else ())
    g_raw = torch.full(g_shape, -7.0, dtype=torch.float64)
    g_raw[:, 100] = 1e6
    inputs = [torch.randn(1, length, heads, dk, dtype=torch.float64), F.normalize(torch.randn(1, length, heads, dk,
              dtype=torch.float64), dim=-1), torch.randn(1, length, heads, dv, dtype=torch.float64), g_raw,
              torch.rand(1, length, heads, dtype=torch.float64)]
    inputs = [t.requires_grad_() for t in inputs]
    decay = lambda raw: -F.softplus(raw) * 7.39  # noqa: E731
    ref = _sequential_delta_rule(*(t[0] for t in inputs[:3]), decay(inputs[3][0]), inputs[4][0])
    grad_o = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * grad_o).sum(), inputs)
    ours = [t.detach().float().requires_grad_() for t in inputs]
    run = chunk_kda_rule if rule == "kda" else chunk_gated_delta_rule
    o, _ = run(ours[0], ours[1], ours[2], decay(ours[3]), ours[4], chunk_size=64)
    grads = torch.autograd.grad((o[0] * grad_o.float()).sum(), ours)
    for name, got, want in [("o", o[0], ref)] + list(zip(["dq", "dk", "dv", "dg", "dbeta"], grads, ref_grads)):
        error = float((got.double() - want).abs().max() / want.abs().max())
        assert error < 3e-6, (name, error)


def test_trained_bfloat16_weights_say_that_small_updates_round_away(tmp_path):
    """``model.dtype=bfloat16`` without mixed precision trains bf16 weights and AdamW rounds every update below half a
    weight's bf16 spacing away, silently: at lr=1e-4 a fifth of an N(0, 0.02) matrix and every norm weight never
    moved. The run now says so in one line, with the magnitude past which nothing moves (measured here) and the fix."""
    from hybridpar.config import TrainConfig
    from hybridpar.train.optim import build_optimizer
    from tests.train.fault_probes import cli

    code, out = cli("train", "--dry-run", "model.dtype=bfloat16", "train.lr=1e-4", f"output_dir={tmp_path / 'run'}")
    assert code == 0, out
    [line] = [line for line in out.splitlines() if "rounded away" in line]
    assert "weights of magnitude 0.0512 or more do not change" in line and "parallel.mixed_precision=bf16" in line
    code, out = cli("train", "--dry-run", "model.dtype=bfloat16", "parallel.mixed_precision=bf16", f"output_dir={tmp_path / 'mp'}")
    assert "rounded away" not in out  # float32 master weights
    torch.manual_seed(0)
    weights = torch.nn.Parameter(torch.linspace(-0.1, 0.1, 2001).to(torch.bfloat16))
    before = weights.detach().clone()
    weights.grad = torch.randn_like(weights)
    build_optimizer(torch.nn.ParameterList([weights]), TrainConfig(lr=1e-4, weight_decay=0.0)).step()
    moved = weights.detach() != before
    assert not moved[before.float().abs() >= 0.0512].any() and moved[before.float().abs() < 0.0128].all()


def test_a_checkpoint_saved_with_a_log_among_the_decayed_matrices_resumes(tmp_path):
    """A run saved before the fix above holds Mamba1's ``A_log`` in the decayed group; loading it into this optimizer
    (``A_log`` undecayed) gave a group without its hyperparameters (torch's loader matches groups by their members),
    and the first step after the resume stopped on KeyError 'eps'. The moments load by name and the groups are this
    run's: ``A_log`` keeps its moments and joins the undecayed group."""
    import torch.distributed as dist
    import transformers as hf

    from hybridpar.config import TrainConfig
    from hybridpar.train.optim import apply_settings, build_optimizer, build_scheduler
    from hybridpar.train.run.checkpoint import load_checkpoint, save_checkpoint
    from tests.models.hf.mamba1_models import mamba1_config

    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(mamba1_config("mamba"))
    config = TrainConfig(lr=1e-3, weight_decay=0.1)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    before = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},  # the grouping of a run before round 28
                                {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before.step()
    for p in model.parameters():
        p.grad = None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        path = save_checkpoint(tmp_path, 1, model, before, build_scheduler(before, config), extra={}, run_info={"run_id": "r"})
        optimizer = build_optimizer(model, config)
        scheduler = build_scheduler(optimizer, config)
        load_checkpoint(path, model, optimizer, scheduler)
    finally:
        dist.destroy_process_group()
    apply_settings(optimizer, scheduler, config)  # as the trainer resumes
    assert all(group["eps"] == 1e-8 for group in optimizer.param_groups)  # torch's loader left a group without it
    for name, p in model.named_parameters():
        assert torch.equal(optimizer.state[p]["exp_avg"], before.state[p]["exp_avg"]), name
    a_log = [p for name, p in model.named_parameters() if name.endswith("A_log")]
    assert all(any(p is q for q in optimizer.param_groups[1]["params"]) for p in a_log)
