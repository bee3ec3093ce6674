"""Round 30: MoE routers under the parallel layouts and round 28's numerical leftovers (docs/reliability.md)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import run_ranks

DEFAULT = "configs/tiny-hybrid.yaml"


class _Router(torch.nn.Module):
    """NemotronH's ``NemotronHTopkRouter`` (transformers 5.24) with one group: a float32 linear, sigmoid, top-k."""

    def __init__(self, experts: int, hidden: int, top_k: int):
        super().__init__()
        self.weight, self.top_k = torch.nn.Parameter(torch.empty(experts, hidden)), top_k

    def forward(self, x):
        logits = F.linear(x.type(torch.float32), self.weight.type(torch.float32))
        scores = logits.sigmoid()
        experts = scores.topk(self.top_k, dim=-1, sorted=False).indices
        return logits, scores.gather(1, experts), experts


class _MoE(torch.nn.Module):
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight"]  # NemotronH's, DeepSeek-V3's, GLM4-MoE's

    def __init__(self):
        super().__init__()
        self.gate = _Router(32, 128, 4)


def test_a_router_transformers_keeps_in_float32_picks_its_experts_in_float32_under_autocast():
    """NemotronH (DeepSeek-V3, GLM4-MoE, ...) keeps ``gate.weight`` in float32 and its router casts to float32 to pick
    the experts; under ``mixed_precision=bf16`` without FSDP (autocast) its ``F.linear`` ran in bf16 anyway, and 9.7%
    of the tokens of a 64-expert router got other experts than the float32 router's. Now it runs with autocast off:
    the same experts and weights as float32. A router transformers does not keep in float32 is left as it was."""
    from hybridpar.parallel.precision import apply_autocast, float32_modules

    torch.manual_seed(0)
    model = _MoE()  # the real NemotronH router measured the same way: 11.7% of the tokens (round 30's probe)
    router = model.gate
    assert float32_modules(model) == [router]
    torch.nn.init.normal_(router.weight, std=0.02)  # a trained router's scale: near ties, as in a real one
    x = torch.randn(1024, 128)
    _, weights, experts = router(x)
    apply_autocast(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what a wrapped causal LM's forward runs its layers in
        logits, weights_mixed, experts_mixed = router(x)
    assert logits.dtype == torch.float32 and torch.equal(experts_mixed, experts) and torch.equal(weights_mixed, weights)
    model._keep_in_fp32_modules_strict = ["e_score_correction_bias"]  # a buffer only: no weight named
    assert float32_modules(model) == []


def test_an_rms_norm_past_float32s_squares_is_nan_not_a_silent_zero():
    """A group of values past ~1.8e19 overflows the float32 mean of squares: ``rsqrt(inf)`` was 0 and every norm gave
    a finite 0 (a HybridLM whose embeddings were scaled to 1e37 had the loss log V exactly and a gradient norm of 0,
    a step the guard applied). Now ``rstd`` is NaN there (an op on ``[T, groups]``): the loss is NaN and
    ``train.on_nonfinite`` sees it. Below the overflow nothing changes (float64 agreement as before). (Measured on a tiny
    HybridLM too: embeddings x 1e37 gave the loss log V and a gradient norm of 0 before, NaN now.)"""
    from hybridpar.models.blocks import gated_rms_norm, rms_norm
    from hybridpar.models.norm_kernels import _norm_to
    from hybridpar.train.optim import clip_grad_norm

    torch.manual_seed(0)
    weight = torch.ones(64)
    for scale, finite in ((1e17, True), (2e19, False), (1e30, False)):
        x = torch.randn(4, 64) * scale
        gate = torch.full_like(x, 1.0)  # silu(1) = 0.73: u = 0.73 x
        outputs = [rms_norm(x, weight, 1e-6), gated_rms_norm(x, gate, weight, 16, 1e-6),
                   _norm_to(x, weight, 1e-6, torch.bfloat16)[0].float()]
        for y in outputs:
            assert bool(torch.isfinite(y).all()) == finite and bool(torch.isnan(y).any()) != finite, (scale, y)
        if finite:
            want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
            assert float((outputs[0].double() - want).abs().max()) < 1e-6
    zero = torch.zeros(2, 64, requires_grad=True)
    rms_norm(zero, weight, 1e-6).sum().backward()  # 0 stays 0 (eps), finite gradients
    assert bool(torch.isfinite(zero.grad).all())

    embeddings = torch.nn.Parameter(torch.randn(64, 64) * 1e37)  # a stream past the squares: the final norm, the head
    head = torch.randn(64, 64)
    ids = torch.randint(0, 64, (32,))
    loss = F.cross_entropy(rms_norm(embeddings[ids], weight, 1e-6) @ head.T, ids)
    loss.backward()  # was log V exactly with a zero gradient: a step the guard applied
    assert math.isnan(float(loss.detach())) and math.isnan(float(clip_grad_norm([embeddings], math.inf)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clipping_is_torchs_clip_grad_norm_at_every_scale(dtype):
    """``train.grad_clip`` clips as ``torch.nn.utils.clip_grad_norm_`` does (its ``max_norm / (norm + 1e-6)``; the
    one-process reference and every layout share ``optim.clip_grad_norm``), also below a norm of 1e-6 where torch's
    ``+ 1e-6`` clips short (1e-7 at ``grad_clip=1e-8`` leaves 9e-10: torch's convention, kept)."""
    from hybridpar.train.optim import clip_grad_norm

    torch.manual_seed(0)
    for norm, max_norm in ((1e-7, 1e-8), (1e-7, 1.0), (1e-3, 1e-4), (10.0, 1.0), (1e18, 1.0)):  # past 1.8e19 torch's float32 norm is inf, ours not (round 28)
        grads = [torch.randn(7, 5, dtype=dtype), torch.randn(3, dtype=dtype)]
        total = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
        ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for a, b, g in zip(ours, theirs, grads):
            a.grad, b.grad = g * (norm / total), g * (norm / total)
        got = clip_grad_norm(ours, max_norm)
        want = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        tolerance = 1e-15 if dtype == torch.float64 else 1e-6
        assert abs(float(got) / float(want) - 1) < tolerance, (norm, float(got), float(want))
        for a, b in zip(ours, theirs):
            assert float((a.grad - b.grad).abs().max()) <= tolerance * float(b.grad.abs().max()), (norm, max_norm)


def _vocab_parallel_under_autocast(rank):
    """The vocabulary-parallel loss of rank ``rank``'s half of a 96-row head under CPU autocast, and one process's
    chunked loss of the whole head: ``(loss, d hidden, d weight of this rank's rows)`` of each (float64 copies)."""
    import torch.distributed as dist

    from hybridpar.models.lm_head_loss import chunked_lm_head_loss
    from hybridpar.parallel.tensor.vocab_parallel_loss import vocab_parallel_lm_head_loss

    torch.manual_seed(0)
    hidden, weight = torch.randn(40, 32), torch.randn(96, 32)
    labels = torch.randint(0, 96, (40,))
    labels[::7] = -100
    rows = slice(48 * rank, 48 * (rank + 1))
    out = []
    for parallel in (True, False):
        h, w = hidden.clone().requires_grad_(), (weight[rows] if parallel else weight).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (vocab_parallel_lm_head_loss(h, w, labels, tp_group=dist.group.WORLD, chunk_size=16) if parallel
                    else chunked_lm_head_loss(h, w, labels, chunk_size=16)).loss_sum
        loss.backward()
        out.append((float(loss), h.grad.double(), (w.grad if parallel else w.grad[rows]).double()))
    return out


def _overflow_on_rank_0(rank, world_size, root):
    """Steps 1-3 under ``mixed_precision=bf16``, rank 0's first block overflowing (past bf16's range) at step 2 only,
    as one rank's data would; returns each step's outcome (and ``_vocab_parallel_under_autocast``: one launch)."""
    from hybridpar.config import load_config
    from hybridpar.train.nonfinite import NonFiniteError
    from hybridpar.train.trainer import Trainer

    small = ["model.preset=tiny", "tensorboard=false", "plot=false", "train.eval_every=0", "data.pack_size=64",
             "data.packs_per_step=2", "parallel.mixed_precision=bf16", "train.steps=3", "parallel.cp=1",
             "data.task_options={min_len: 16, max_len: 32, num_kv_pairs: 2, vocab_size: 32}"]
    out = {"vocab parallel": _vocab_parallel_under_autocast(rank)}
    for layout, policy in ((["parallel.dp_shard=2"], "skip"), (["parallel.tp=2"], "stop")):
        trainer = Trainer(load_config(DEFAULT, small + [f"output_dir={root}/{layout[0]}-{policy}", *layout,
                                                        f"train.on_nonfinite={policy}"]), torch.device("cpu"))
        at = {"step": 0}

        def blow(module, args, output):
            if at["step"] == 1 and rank == 0:
                with torch.no_grad():
                    (output.to_local() if hasattr(output, "to_local") else output).mul_(1e38).mul_(1e38)
            return output

        trainer.model.backbone.layers[0].register_forward_hook(blow)
        steps = []
        for step in range(3):
            at["step"] = step
            try:
                metrics = trainer.train_step(step)
            except NonFiniteError as error:
                steps.append(str(error).split(";")[0])
                break
            steps.append((math.isfinite(metrics["loss"]), math.isfinite(metrics["grad_norm"]), metrics.get("skipped_steps")))
        out[f"{layout[0]} {policy}"] = steps
    return out


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """The file's one 2-rank launch (``_overflow_on_rank_0``)."""
    return run_ranks(2, _overflow_on_rank_0, str(tmp_path_factory.mktemp("round30")), timeout_s=300)


def test_a_bf16_overflow_on_one_rank_is_every_ranks_decision_at_the_same_step(tp_results):
    """``train.on_nonfinite`` under a bf16 overflow on rank 0 only (dp_shard=2: FSDP's bf16; tp=2: autocast): the loss
    and the gradient norm are global, so both ranks skip step 2 (and train on at step 3) or stop at step 2 together;
    nobody hangs in a collective the other left (tp=2 skips alike: measured, round 30)."""
    results = [{k: v for k, v in out.items() if k != "vocab parallel"} for out in tp_results]
    skipped = [(True, True, None), (False, False, 1), (True, True, 1)]
    for out in results:
        assert out["parallel.dp_shard=2 skip"] == skipped, out
        assert out["parallel.tp=2 stop"][:1] == [(True, True, None)], out
        assert out["parallel.tp=2 stop"][1].startswith("step 2: the loss is nan and the gradient norm nan"), out
    assert results[0] == results[1]


def test_the_vocabulary_parallel_loss_runs_its_matmuls_in_bf16_under_autocast_as_one_process(tp_results):
    """Under ``mixed_precision=bf16`` without FSDP the chunked loss runs its logit blocks' matmuls in bf16 on one
    process, but the vocabulary-parallel loss (tp > 1) ran them in float32: tp=2 and one process computed other
    logits (the loss 2.8e-4 apart here, relative). Now both take bf16 blocks and float32 statistics: the loss agrees to float32's rounding of the sums, the
    gradients to bf16's of each block's matmul (the blocks' rows differ with the shard)."""
    for parallel, single in [out["vocab parallel"] for out in tp_results]:
        assert abs(parallel[0] / single[0] - 1) < 1e-6, (parallel[0], single[0])
        for got, want in zip(parallel[1:], single[1:]):
            assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())
