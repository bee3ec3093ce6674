"""Attention context parallelism ("allgather", "ulysses", "ring") against single-process attention.

One gloo group per CP size (2 and 4) runs every check: the bare core against the dense-mask
reference (``tests/attention_reference.py``) at 1e-10 in float64, outputs and the gradients
of q, k, v, with small blocks so lengths are not multiples of the block (head_dim 16 on every
layout, 64 on the packed row with one-token chunks; GQA ratios 1 to 4, and for Ulysses every
kind of kv replication; documents of one token per zigzag chunk and documents over every rank); a
full ``Attention`` module with RoPE at 1e-9; dense (B=2) and packed rows; the bytes each rank
sends against the closed forms below; no tensor of ``S/cp x S`` elements on the allgather
path and none of all ``S`` keys on the ring path; and the ``ValueError``s that must come
before any collective.

Closed-form bytes per rank per attention layer (``e`` bytes per element)::

    allgather  forward  all_gather      (P-1)   * e * B * (S/P) * 2*Hkv * Dh
               backward reduce_scatter  (P-1)/P * e * B *  S    * 2*Hkv * Dh
    ulysses    forward  all_to_all      (P-1)/P * e * B * (S/P) * (2*Hq + 2*Hkv') * Dh
               backward all_to_all      the same
    ring       forward  send            (P-1)   * e * B * (S/P) * 2*Hkv * Dh
               backward send            (2P-1)  * e * B * (S/P) * 2*Hkv * Dh   (float64: e = e_c)
    with Hkv' = Hkv if P divides Hkv, else the smallest multiple of Hkv that P divides.
"""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.attention.mixer import Attention, causal_attention
from hybridpar.models.hybrid import HybridConfig, HybridLM
from hybridpar.parallel.comm.collectives import CommStats
from hybridpar.parallel.context.attention import (
    STRATEGIES as STRATEGY_CLASSES,
    AllGatherAttention,
    RingAttention,
    UlyssesAttention,
    apply_attention_cp,
    attention_cp_bytes_per_layer,
)
from hybridpar.parallel.context.inputs import gather_outputs, shard_inputs
from tests.attention_reference import dense_causal_attention
from tests.distributed.context.reference import cu_seqlens, expect_value_error, gather_by_reference, max_err, reference_zigzag, summed
from tests.distributed.harness import run_ranks
from tests.op_outputs import OpOutputs

TOL = 1e-9
CORE_TOL = 1e-10
HEAD_DIM = 4
CORE_HEAD_DIMS = (16, 64)
CORE_KINDS = ("dense", "packed", "packed2")
SMALL_BLOCKS = dict(block_size=5, keys_per_step=10)  # S/cp and S are never multiples of 5 here
HIDDEN = 16
STRATEGIES = ("allgather", "ulysses", "ring")
# (Hq, Hkv): no kv replication, kv replication (Hkv < P), and Hkv' = lcm(Hkv, P) in between.
HEAD_CONFIGS = [(4, 2), (4, 1), (6, 3), (8, 8), (12, 6), (6, 2)]
# GQA ratio 2 again, with other head counts: only Ulysses' kv replication (Hkv') depends on them, so
# allgather and ring (whose work and bytes depend on Hkv and the ratio alone) run (4, 2) for ratio 2
ULYSSES_ONLY_HEAD_CONFIGS = [(6, 3), (12, 6)]
WIDE_HEAD_CONFIGS = [(8, 8), (4, 2), (4, 1)]  # GQA ratios 1, 2, 4 also run at head_dim 64 ...
WIDE_KIND = "packed2"  # ... on the layout with the most document boundaries


# ---------------------------------------------------------------- references written here


def kv_heads_sent(hkv: int, cp: int) -> int:
    """Smallest multiple of ``hkv`` that ``cp`` divides (``hkv`` itself when ``cp | hkv``)."""
    heads = hkv
    while heads % cp:
        heads += hkv
    return heads


def expected_bytes(strategy: str, cp: int, elem: int, batch: int, seq: int, hq: int, hkv: int, dh: int) -> dict:
    """{"forward": {op: bytes}, "backward": {op: bytes}} from the closed forms in the docstring."""
    if strategy == "allgather":
        fwd = (cp - 1) * elem * batch * Fraction(seq, cp) * 2 * hkv * dh
        bwd = Fraction(cp - 1, cp) * elem * batch * seq * 2 * hkv * dh
        return {"forward": {"all_gather": fwd}, "backward": {"reduce_scatter": bwd}}
    if strategy == "ring":
        hop = elem * batch * Fraction(seq, cp) * 2 * hkv * dh
        return {"forward": {"send": (cp - 1) * hop}, "backward": {"send": (2 * cp - 1) * hop}}
    both = Fraction(cp - 1, cp) * elem * batch * Fraction(seq, cp) * (2 * hq + 2 * kv_heads_sent(hkv, cp)) * dh
    return {"forward": {"all_to_all": both}, "backward": {"all_to_all": both}}


def batch_layout(kind: str, cp: int):
    """``(B, doc padded lengths, global PackedSeqParams or None for dense)``."""
    if kind == "dense":
        return 2, [6 * cp], None
    if kind == "packed2":  # one token per zigzag chunk first (boundaries on every chunk edge), then long ones
        padded = [2 * cp, 10 * cp, 2 * cp, 4 * cp]
        return 1, padded, PackedSeqParams.from_cu_seqlens(cu_seqlens(padded))
    padded = [4 * cp, 2 * cp, 6 * cp]  # each a multiple of 2*cp, every document split over all ranks
    real = [4 * cp - 1, 2 * cp, 6 * cp - 3]
    return 1, padded, PackedSeqParams.from_cu_seqlens(cu_seqlens(real), cu_seqlens(padded))


def bytes_of(stats) -> dict:
    return {op: Fraction(n) for op, n in stats.bytes_sent.items() if n}


# ---------------------------------------------------------------- checks run on every rank


def check_core(group, cp, rank, strategy, hq, hkv, kind, head_dim) -> list[str]:
    """The bare core (small blocks) on random q, k, v against the dense mask: outputs, dq/dk/dv, bytes."""
    torch.manual_seed(1000 * hq + 10 * hkv + len(kind) + head_dim)  # same tensors on every rank
    batch, docs, packed = batch_layout(kind, cp)
    seq = sum(docs)
    q = torch.randn(batch, seq, hq, head_dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, seq, hkv, head_dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, seq, hkv, head_dim, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(batch, seq, hq, head_dim, dtype=torch.float64)
    out_ref = dense_causal_attention(q, k, v, packed)
    (out_ref * weight).sum().backward()
    grads_ref = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    sharded = shard_inputs(inputs_embeds=q, packed=packed, cp_group=group)  # the user's path
    idx = reference_zigzag(docs, cp, rank)
    assert sharded.packed.cp.local_indices.tolist() == idx
    q_local, k_local, v_local = sharded.inputs_embeds, k[:, idx], v[:, idx]
    core = STRATEGY_CLASSES[strategy](group, **SMALL_BLOCKS)
    with CommStats() as fwd:
        out_local = core(q_local, k_local, v_local, sharded.packed)
    loss = (out_local * weight[:, idx]).sum()
    with CommStats() as bwd:
        loss.backward()

    failures = []
    where = f"core {strategy} cp={cp} {kind} Hq={hq} Hkv={hkv} Dh={head_dim}"
    out = gather_by_reference(out_local.detach(), docs, cp, group)
    if max_err(out, out_ref) > CORE_TOL:
        failures.append(f"{where}: output differs by {max_err(out, out_ref):.3g}")
    for name, t, g_ref in zip("qkv", (q, k, v), grads_ref):
        err = max_err(summed(t.grad, group), g_ref)
        if err > CORE_TOL:
            failures.append(f"{where}: d{name} differs by {err:.3g}")
    expected = expected_bytes(strategy, cp, 8, batch, seq, hq, hkv, head_dim)
    for phase, stats in (("forward", fwd), ("backward", bwd)):
        if bytes_of(stats) != expected[phase]:
            failures.append(f"{where}: {phase} bytes {bytes_of(stats)} != closed form {expected[phase]}")
    return failures


def check_module(group, cp, rank, strategy, hq, hkv, kind) -> list[str]:
    """A full Attention module with RoPE: output, input and projection-weight gradients, bytes."""
    torch.manual_seed(7 + hq + hkv)
    batch, docs, packed = batch_layout(kind, cp)
    seq = sum(docs)
    reference = Attention(HIDDEN, hq, hkv, HEAD_DIM, rope_theta=100.0, bias=True).double()
    parallel = apply_attention_cp(copy.deepcopy(reference), group, strategy)
    x = torch.randn(batch, seq, HIDDEN, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(batch, seq, HIDDEN, dtype=torch.float64)
    out_ref = reference(x, packed)
    (out_ref * weight).sum().backward()
    x_grad_ref = x.grad.clone()
    x.grad = None

    sharded = shard_inputs(inputs_embeds=x, packed=packed, cp_group=group)
    with CommStats() as fwd:
        out_local = parallel(sharded.inputs_embeds, sharded.packed)
    loss = (out_local * weight[:, reference_zigzag(docs, cp, rank)]).sum()
    with CommStats() as bwd:
        loss.backward()

    failures = []
    where = f"module {strategy} cp={cp} {kind} Hq={hq} Hkv={hkv}"
    out = gather_outputs(out_local.detach(), sharded.packed, group)
    if max_err(out, out_ref) > TOL:
        failures.append(f"{where}: output differs by {max_err(out, out_ref):.3g}")
    if max_err(summed(x.grad, group), x_grad_ref) > TOL:
        failures.append(f"{where}: input gradient differs")
    for (name, p_ref), p in zip(reference.named_parameters(), parallel.parameters()):
        err = max_err(summed(p.grad, group), p_ref.grad)
        if err > TOL:
            failures.append(f"{where}: grad of {name} differs by {err:.3g}")
    expected = expected_bytes(strategy, cp, 8, batch, seq, hq, hkv, HEAD_DIM)
    for phase, stats in (("forward", fwd), ("backward", bwd)):
        if bytes_of(stats) != expected[phase]:
            failures.append(f"{where}: {phase} bytes {bytes_of(stats)} != closed form {expected[phase]}")
    return failures


def check_hybrid_lm(group, cp, rank, strategy) -> list[str]:
    """apply_attention_cp on a whole attention+MLP model: every Attention gets the core; logits match."""
    torch.manual_seed(3)
    config = HybridConfig(vocab_size=32, hidden_size=HIDDEN, pattern="*-*", num_attention_heads=4,
                          num_key_value_heads=2, head_dim=HEAD_DIM, intermediate_size=32, dtype=torch.float64)
    reference = HybridLM(config)
    parallel = apply_attention_cp(copy.deepcopy(reference), group, strategy)
    cores = [m.core for m in parallel.modules() if isinstance(m, Attention)]
    failures = []
    expected_type = STRATEGY_CLASSES[strategy]
    if len(cores) != 2 or not all(isinstance(c, expected_type) for c in cores):
        failures.append(f"hybrid {strategy}: cores installed {cores}")
    _, docs, packed = batch_layout("packed", cp)
    ids = torch.randint(0, 32, (1, sum(docs)))
    logits_ref = reference(ids, packed=packed)
    logits_ref.square().sum().backward()
    sharded = shard_inputs(input_ids=ids, packed=packed, cp_group=group)
    logits = parallel(sharded.input_ids, packed=sharded.packed)
    logits.square().sum().backward()
    if max_err(gather_outputs(logits.detach(), sharded.packed, group), logits_ref) > TOL:
        failures.append(f"hybrid {strategy} cp={cp}: logits differ")
    for (name, p_ref), p in zip(reference.named_parameters(), parallel.parameters()):
        if max_err(summed(p.grad, group), p_ref.grad) > TOL:
            failures.append(f"hybrid {strategy} cp={cp}: grad of {name} differs")
    return failures


def check_memory(group, cp, rank, strategy) -> list[str]:
    """A packed row: no op output and no saved tensor has S/cp * S elements (allgather), and none
    holds the keys of all S tokens (ring: S * 2*Hkv*Dh elements)."""
    docs = [16 * cp, 2 * cp, 78 * cp]  # S = 96 cp: every legitimate tensor is far below S/cp * S
    seq = sum(docs)
    packed = PackedSeqParams.from_cu_seqlens(cu_seqlens(docs))
    torch.manual_seed(5)
    q = torch.randn(1, seq, 2, 4, dtype=torch.float64)
    kv = torch.randn(1, seq, 1, 4, dtype=torch.float64)
    sharded = shard_inputs(inputs_embeds=q, packed=packed, cp_group=group)
    idx = sharded.packed.cp.local_indices
    q_local, k_local = sharded.inputs_embeds.requires_grad_(), kv[:, idx].requires_grad_()
    saved = []

    def keep(t):
        saved.append(t.numel())
        return t

    core = STRATEGY_CLASSES[strategy](group, block_size=16, keys_per_step=32)
    with OpOutputs() as tracker, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        core(q_local, k_local, k_local, sharded.packed).sum().backward()
    limit = (seq // cp) * seq if strategy == "allgather" else seq * 2 * 1 * 4
    if not 0 < tracker.largest < limit or max(saved) >= limit:
        return [f"cp={cp} {strategy} memory: largest op output {tracker.largest}, largest saved {max(saved)}, "
                f"limit {limit}"]
    return []


def check_errors_before_collectives(group, cp, rank) -> list[str]:
    """Bad input raises on rank 0 alone while the others wait at a barrier: a collective would hang."""
    failures = []
    if rank == 0:
        hq, hkv = (3, 1) if cp == 2 else (6, 3)
        bad_heads = Attention(HIDDEN, hq, hkv, HEAD_DIM).double()
        _, docs, packed = batch_layout("packed", cp)
        seq = sum(docs)
        local = shard_inputs(inputs_embeds=torch.zeros(1, seq, 1), packed=packed, cp_group=group).packed
        q = torch.randn(1, seq // cp, hq, HEAD_DIM, dtype=torch.float64)
        k = torch.randn(1, seq // cp, hkv, HEAD_DIM, dtype=torch.float64)
        wrong_rank = shard_inputs(inputs_embeds=torch.zeros(1, seq, 1), packed=packed, cp_group=group).packed
        wrong_rank.cp.cp_rank = (rank + 1) % cp
        q_ok = torch.randn(1, seq // cp, 4, HEAD_DIM, dtype=torch.float64)
        k_ok = torch.randn(1, seq // cp, 2, HEAD_DIM, dtype=torch.float64)
        cases = {
            "apply ulysses, heads not divisible": (
                lambda: apply_attention_cp(bad_heads, group, "ulysses"), str(hq), f"cp={cp}", "allgather"),
            "ulysses core, heads not divisible": (
                lambda: UlyssesAttention(group)(q, k, k, local), str(hq), f"cp={cp}", "allgather"),
            "dense sequence not divisible by 2*cp": (
                lambda: shard_inputs(inputs_embeds=torch.zeros(2, 2 * cp + 2, HIDDEN), cp_group=group),
                str(2 * cp + 2), f"2*cp = {2 * cp}"),
            "padded document not divisible by 2*cp": (
                lambda: shard_inputs(
                    inputs_embeds=torch.zeros(1, 4 * cp + 2, HIDDEN), cp_group=group,
                    packed=PackedSeqParams.from_cu_seqlens(torch.tensor([0, 2 * cp, 4 * cp + 2]))),
                str(2 * cp + 2), f"2*cp = {2 * cp}"),
        }
        for strategy, cls in STRATEGY_CLASSES.items():
            cases[f"{strategy} core, block size 0"] = (lambda cls=cls: cls(group, block_size=0), "block_size", "0")
            cases[f"{strategy} core, wrong q/k shapes"] = (
                lambda cls=cls: cls(group)(q_ok, k_ok[:, :-1], k_ok[:, :-1], local), str(tuple(q_ok.shape)))
            cases[f"{strategy} core, packed without CP layout"] = (
                lambda cls=cls: cls(group)(q_ok, k_ok, k_ok, packed), "packed.cp is None")
            cases[f"{strategy} core, layout of another rank"] = (
                lambda cls=cls: cls(group)(q_ok, k_ok, k_ok, wrong_rank), f"cp_rank={(rank + 1) % cp}")
            cases[f"{strategy} core, dense batch without params"] = (
                lambda cls=cls: cls(group)(q_ok, k_ok, k_ok, None), "shard_inputs")
        with CommStats() as stats:
            for name, (call, *needles) in cases.items():
                problem = expect_value_error(call, *needles)
                if problem:
                    failures.append(f"cp={cp} {name}: {problem}")
        if any(stats.bytes_sent.values()):
            failures.append(f"cp={cp}: bad input sent bytes {dict(stats.bytes_sent)}")
    dist.barrier(group=group)
    return failures


def run_all_checks(rank, world_size) -> list[str]:
    cp = world_size
    group = dist.new_group(list(range(world_size)))  # an explicit group, not the default one
    failures = check_errors_before_collectives(group, cp, rank)
    failures += check_memory(group, cp, rank, "allgather") + check_memory(group, cp, rank, "ring")
    for strategy in STRATEGIES:
        for hq, hkv in HEAD_CONFIGS:
            if (strategy == "ulysses" and hq % cp) or (strategy != "ulysses" and (hq, hkv) in ULYSSES_ONLY_HEAD_CONFIGS):
                continue
            for kind in CORE_KINDS:
                for head_dim in CORE_HEAD_DIMS:
                    if head_dim == CORE_HEAD_DIMS[-1] and ((hq, hkv) not in WIDE_HEAD_CONFIGS or kind != WIDE_KIND):
                        continue
                    failures += check_core(group, cp, rank, strategy, hq, hkv, kind, head_dim)
        for hq, hkv in ((4, 2), (4, 1)):
            for kind in ("dense", "packed"):
                failures += check_module(group, cp, rank, strategy, hq, hkv, kind)
        failures += check_hybrid_lm(group, cp, rank, strategy)
    return failures


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_matches_single_process(cp):
    results = run_ranks(cp, run_all_checks, timeout_s=300)
    problems = [f"rank {r}: {msg}" for r, failures in enumerate(results) for msg in failures]
    assert not problems, "\n".join(problems)


def test_unknown_strategy_names_the_choices():
    with pytest.raises(ValueError, match=r"'stripe'.*\['allgather', 'ring', 'ulysses'\]"):
        apply_attention_cp(Attention(HIDDEN, 4, 2, HEAD_DIM), None, "stripe")


@pytest.mark.parametrize("cls", [AllGatherAttention, UlyssesAttention, RingAttention])
def test_group_of_one_is_the_single_process_core(cls):
    torch.manual_seed(0)
    q = torch.randn(1, 12, 4, HEAD_DIM, dtype=torch.float64)
    k = torch.randn(1, 12, 2, HEAD_DIM, dtype=torch.float64)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 5, 12]))
    assert torch.equal(cls(None)(q, k, k, packed), causal_attention(q, k, k, packed))


def test_expected_bytes_formula_matches_the_worked_example():
    """peers-and-anchors B.2(c): Ulysses, n_q=32, n_kv=8, h_d=128, L=131072, P=8, bf16 -> ~294 MB."""
    total = expected_bytes("ulysses", 8, 2, 1, 131072, 32, 8, 128)["forward"]["all_to_all"]
    assert round(float(total) / 1e6) == 294


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bytes_helper_matches_the_closed_form(strategy):
    """The library's helper (used by benchmarks) against the formula written in this file."""
    for cp in (2, 3, 4, 8):
        for hq, hkv in HEAD_CONFIGS:
            if strategy == "ulysses" and hq % cp:
                continue
            seq = 2 * cp * 5
            expected = expected_bytes(strategy, cp, 2, 3, seq, hq, hkv, HEAD_DIM)["forward"]
            helper = attention_cp_bytes_per_layer(strategy, 3, seq, cp, hq, hkv, HEAD_DIM, 2)
            assert helper == pytest.approx(float(sum(expected.values())), rel=1e-12)
    assert attention_cp_bytes_per_layer(strategy, 3, 40, 1, 4, 2, HEAD_DIM, 2) == 0.0
