"""Mamba2 context parallelism ("a2a", "state") against the single-process mixer.

One gloo group per CP size (2 and 4) runs every check: float64 outputs, input gradients and
every mixer parameter gradient at 1e-10 against the single-process mixer running the *old*
core (``tests/models/mamba/reference.py``: per-tap conv, chunked scan with a loop over chunks),
for dense (B=2) and packed rows (documents of
several lengths, every one split over all ranks, boundaries on zigzag chunk edges, chunks
shorter than the conv window and longer than the scan chunk), n_groups in {1, 2, 8}
(repetition when n_groups < cp); the bytes each rank sends against the closed forms below;
and the ``ValueError``s that must come before any collective.

Closed-form bytes per rank per Mamba layer (``e`` bytes per element, forward)::

    a2a    all_to_all  e * B * (L/P) * (P-1)/P * (2*d_inner + 2*G_eff*N + H),  G_eff = max(G, P)
           backward: the same all-to-alls transposed, the same count
    state  all_gather  (P-1) * 2*B*n_docs * ((K-1) * (d_inner + 2*G*N) + H*p*N + H) * e
           (float64 here, so activations and states have the same e); independent of L
"""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.mamba.mixer import Mamba2Mixer
from hybridpar.parallel.comm.collectives import CommStats
from hybridpar.parallel.context.recurrent.mamba import HiddenParallelMamba, StatePassingMamba, apply_mamba_cp
from hybridpar.parallel.context.inputs import gather_outputs, shard_inputs
from tests.distributed.context.reference import cu_seqlens as cu, expect_value_error, gather_by_reference, max_err, reference_zigzag, summed
from tests.distributed.harness import run_ranks
from tests.models.mamba.reference import local_conv_scan as old_core

TOL = 1e-10
HIDDEN, HEADS, HEAD_DIM, STATE, KERNEL, CHUNK = 16, 8, 4, 4, 4, 4
STRATEGIES = ("a2a", "state")
GROUPS = (1, 2, 8)
PACKED_DOCS = [8, 24, 16, 8, 40]  # padded lengths, multiples of 8 = 2*cp for cp in {2, 4}
PACKED_REAL = [7, 24, 13, 8, 37]  # real lengths (padding belongs to the document it follows)


# ---------------------------------------------------------------- references written here


def expected_bytes(strategy: str, cp: int, elem: int, batch: int, seq: int, n_docs: int, groups: int, heads: int = HEADS) -> Fraction:
    d_inner = heads * HEAD_DIM
    if strategy == "a2a":
        g_eff = max(groups, cp)
        return elem * batch * Fraction(seq, cp) * Fraction(cp - 1, cp) * (2 * d_inner + 2 * g_eff * STATE + heads)
    per_segment = (KERNEL - 1) * (d_inner + 2 * groups * STATE) + heads * HEAD_DIM * STATE + heads
    return Fraction((cp - 1) * 2 * batch * n_docs * per_segment * elem)


def make_mixer(groups: int, heads: int = HEADS, time_step_limit=(0.0, float("inf")), seed: int = 0) -> Mamba2Mixer:
    """A float64 mixer whose states persist over many tokens (small |A|, large dt)."""
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(HIDDEN, heads, HEAD_DIM, groups, STATE, KERNEL, CHUNK, time_step_limit=time_step_limit).double()
    with torch.no_grad():
        mixer.A_log.copy_(torch.empty(heads).uniform_(0.05, 1.0).log())
        mixer.dt_bias.copy_(torch.randn(heads) * 0.5)
        mixer.D.copy_(torch.randn(heads))
        mixer.norm.weight.copy_(1 + 0.1 * torch.randn(mixer.norm.weight.shape))
    return mixer


def batch_layout(kind: str, seq: int = 48):
    """``(B, doc padded lengths, global PackedSeqParams or None for dense)``."""
    if kind == "dense":
        return 2, [seq], None
    return 1, PACKED_DOCS, PackedSeqParams.from_cu_seqlens(cu(PACKED_REAL), cu(PACKED_DOCS))


# ---------------------------------------------------------------- checks run on every rank


def check_parity(group, cp: int, rank: int, strategy: str, groups: int, kind: str, heads: int = HEADS,
                 time_step_limit=(0.0, float("inf")), seq: int = 48) -> tuple[list[str], dict]:
    """Outputs, input and parameter gradients, bytes; returns (failures, forward bytes by op)."""
    where = f"{strategy} cp={cp} {kind} L={seq} H={heads} G={groups} dt_limit={time_step_limit}"
    reference = make_mixer(groups, heads, time_step_limit)
    parallel = apply_mamba_cp(copy.deepcopy(reference), group, strategy)
    reference.core = old_core  # the implementation the new core replaced
    batch, docs, packed = batch_layout(kind, seq)
    torch.manual_seed(1)
    u = torch.randn(batch, sum(docs), HIDDEN, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(batch, sum(docs), HIDDEN, dtype=torch.float64)
    out_ref = reference(u, packed)
    (out_ref * weight).sum().backward()

    u_cp = u.detach().clone().requires_grad_(True)
    sharded = shard_inputs(inputs_embeds=u_cp, packed=packed, cp_group=group)
    idx = reference_zigzag(docs, cp, rank)
    failures = []
    if sharded.packed.cp.local_indices.tolist() != idx:
        failures.append(f"{where}: shard_inputs layout differs from the reference zigzag")
    with CommStats() as fwd:
        out_local = parallel(sharded.inputs_embeds, sharded.packed)
    with CommStats() as bwd:
        (out_local * weight[:, idx]).sum().backward()

    out = gather_by_reference(out_local.detach(), docs, cp, group)
    if max_err(out, out_ref) > TOL:
        failures.append(f"{where}: output differs by {max_err(out, out_ref):.3g}")
    if max_err(gather_outputs(out_local.detach(), sharded.packed, group), out_ref) > TOL:
        failures.append(f"{where}: gather_outputs differs from the reference order")
    if max_err(summed(u_cp.grad, group), u.grad) > TOL:
        failures.append(f"{where}: input gradient differs by {max_err(summed(u_cp.grad, group), u.grad):.3g}")
    for (name, p_ref), p in zip(reference.named_parameters(), parallel.parameters()):
        if p.grad is None:
            failures.append(f"{where}: {name} got no gradient")
            continue
        err = max_err(summed(p.grad, group), p_ref.grad)
        if err > TOL:
            failures.append(f"{where}: grad of {name} differs by {err:.3g}")

    op = "all_to_all" if strategy == "a2a" else "all_gather"
    sent = {o: n for o, n in fwd.bytes_sent.items() if n}
    expected = expected_bytes(strategy, cp, 8, batch, sum(docs), len(docs), groups, heads)
    if sent != {op: expected}:
        failures.append(f"{where}: forward sent {sent}, expected {{{op!r}: {expected}}}")
    back = sum(bwd.bytes_sent.values())  # a2a: transposed all-to-alls; state: reduce-scatters of the gathers
    if back != expected:
        failures.append(f"{where}: backward sent {dict(bwd.bytes_sent)}, expected {expected} in total")
    return failures, sent


def check_errors_before_collectives(group, cp: int, rank: int) -> list[str]:
    failures = []
    odd_heads = Mamba2Mixer(HIDDEN, 2 * cp - 1, HEAD_DIM, 1, STATE, KERNEL, CHUNK)
    fine = Mamba2Mixer(HIDDEN, 4 * cp, HEAD_DIM, 1, STATE, KERNEL, CHUNK)
    xBC, dt = torch.zeros(1, 4, 4 * cp * HEAD_DIM + 2 * STATE), torch.zeros(1, 4, 4 * cp)
    three_groups = Mamba2Mixer(HIDDEN, 12, HEAD_DIM, 3, STATE, KERNEL, CHUNK)
    group_rule = "cp % n_groups == 0" if cp > 3 else "n_groups % cp == 0"
    u = torch.randn(1, 8 * cp + 2, HIDDEN)
    cases = {
        "heads not divisible by cp": (lambda: apply_mamba_cp(odd_heads, group, "a2a"), f"{2 * cp - 1} heads", f"cp={cp}", "\"state\""),
        "group rule": (lambda: apply_mamba_cp(three_groups, group, "a2a"), group_rule, "n_groups=3"),
        "unknown strategy": (lambda: apply_mamba_cp(three_groups, group, "ring"), "'ring'", "['a2a', 'state']"),
        "dense length not a multiple of 2*cp": (lambda: shard_inputs(inputs_embeds=u, cp_group=group), f"{8 * cp + 2}", f"2*cp = {2 * cp}"),
        "packed length not a multiple of 2*cp": (
            lambda: shard_inputs(inputs_embeds=u, packed=PackedSeqParams.from_cu_seqlens(cu([2 * cp + 2, 6 * cp])), cp_group=group),
            f"{2 * cp + 2}", f"2*cp = {2 * cp}"),
        "a2a without packed params": (lambda: HiddenParallelMamba(group)(fine, xBC, dt, None), "shard_inputs"),
        "state without packed params": (lambda: StatePassingMamba(group)(fine, xBC, dt, None), "shard_inputs"),
        "a2a with another batch's params": (
            lambda: HiddenParallelMamba(group)(fine, xBC, dt, shard_inputs(inputs_embeds=torch.zeros(1, 16 * cp, 1), cp_group=group).packed),
            "4 tokens", "holds 16"),
    }
    with CommStats() as stats:
        for name, (call, *needles) in cases.items():
            problem = expect_value_error(call, *needles)
            if problem:
                failures.append(f"cp={cp} {name}: {problem}")
        apply_mamba_cp(three_groups, group, "state")  # "state" has no head or group rule
    if any(stats.bytes_sent.values()):
        failures.append(f"cp={cp}: bad input sent bytes {dict(stats.bytes_sent)}")
    dist.barrier(group=group)
    return failures


def run_all_checks(rank, world_size) -> list[str]:
    cp = world_size
    group = dist.new_group(list(range(world_size)))  # an explicit group, not the default one
    failures = check_errors_before_collectives(group, cp, rank)
    for strategy in STRATEGIES:
        for groups in GROUPS:
            for kind in ("dense", "packed"):
                failures += check_parity(group, cp, rank, strategy, groups, kind)[0]
        failures += check_parity(group, cp, rank, strategy, 2, "packed", time_step_limit=(0.05, 0.9))[0]
    # "state" needs no divisibility: 12 heads, 3 groups, at any cp.
    failures += check_parity(group, cp, rank, "state", 3, "packed", heads=12)[0]
    # "state" traffic does not grow with the sequence length.
    short = check_parity(group, cp, rank, "state", 2, "dense", seq=8 * cp)
    long = check_parity(group, cp, rank, "state", 2, "dense", seq=32 * cp)
    failures += short[0] + long[0]
    if short[1] != long[1]:
        failures.append(f"state cp={cp}: bytes at L={8 * cp} {short[1]} differ from L={32 * cp} {long[1]}")
    return failures


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_mamba_matches_single_process(cp):
    results = run_ranks(cp, run_all_checks, timeout_s=300)
    problems = [f"rank {r}: {msg}" for r, failures in enumerate(results) for msg in failures]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("cls", [HiddenParallelMamba, StatePassingMamba])
def test_group_of_one_is_the_single_process_core(cls):
    mixer = make_mixer(2)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 5, 12]))
    u = torch.randn(1, 12, HIDDEN, dtype=torch.float64)
    expected = mixer(u, packed)
    mixer.core = cls(None)
    assert torch.equal(mixer(u, packed), expected)


def test_expected_bytes_formula_matches_the_worked_example():
    """peers-and-anchors B.2(a): a2a z local, 8B-like, L=131072, P=8, bf16 -> ~532 MB per rank."""
    from hybridpar.parallel.context.recurrent.mamba import a2a_bytes_per_layer

    total = a2a_bytes_per_layer(1, 131072, 8, 8192, 128, 8, 128, 2)
    assert round(total / 1e6) == 532
    assert round(a2a_bytes_per_layer(1, 131072, 8, 8192, 128, 8, 128, 2, z_travels=True) / 1e6) == 767
