"""hybridpar.parallel.comm.collectives on real gloo groups (world sizes 2 and 4), float64.

Every rank builds every rank's inputs from a seed, so it can compute the reference result
of the whole collective locally with plain torch ops (cat / narrow / sum) and compare:
forward outputs, and input gradients against autograd through that reference, where the
global loss is the sum over ranks of <output_r, upstream_grad_r>. Permutations must match
exactly (error 0); results summed over ranks to 1e-12. CommStats counts are compared with the closed-form formulas.
"""

import warnings

import pytest
import torch
import torch.distributed as dist

from hybridpar.parallel.comm.collectives import (
    CommStats,
    all_gather,
    all_reduce,
    hidden_to_seq,
    reduce_scatter,
    seq_to_hidden,
    sp_gather,
    sp_scatter,
)
from tests.distributed.harness import run_ranks

F64 = torch.float64
E = 8  # bytes per float64 element


SUM_TOL = 1e-12  # results that sum over ranks (summation order differs); permutations: exact


def _randn(seed: int, rank: int, shape, dtype=F64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def _everyone(seed, world, shape, dtype=F64, requires_grad=False):
    """Every rank's input for this seed, as leaves."""
    return [_randn(seed, q, shape, dtype).requires_grad_(requires_grad) for q in range(world)]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# --- references: the whole collective in one process ---------------------------------


def _ref_seq_to_hidden(xs_by_rank, world, seq_dim, hidden_dim):
    """xs_by_rank[q] = rank q's input; returns out[q] for every rank q."""
    full = torch.cat(xs_by_rank, dim=seq_dim)  # [B, L, W]
    w = full.shape[hidden_dim] // world
    return [full.narrow(hidden_dim, q * w, w) for q in range(world)]


def _ref_hidden_to_seq(ys_by_rank, world, seq_dim, hidden_dim):
    full = torch.cat(ys_by_rank, dim=hidden_dim)  # [B, L, W]
    block = full.shape[seq_dim] // world
    return [full.narrow(seq_dim, q * block, block) for q in range(world)]


def _check_fused(results, name, fn, ref_fn, world, rank, shapes, dims, dtypes=None, seed=0):
    """Forward and backward of a fused exchange against the single-process reference."""
    seq_dim, hidden_dim = dims
    dtypes = dtypes or [F64] * len(shapes)
    diff = [dt.is_floating_point for dt in dtypes]
    inputs = [_everyone(seed + i, world, s, dt, requires_grad=d) for i, (s, dt, d) in enumerate(zip(shapes, dtypes, diff))]
    mine = [per_rank[rank] for per_rank in inputs]
    outs = fn(mine, seq_dim=seq_dim, hidden_dim=hidden_dim)
    refs = [ref_fn(per_rank, world, seq_dim, hidden_dim) for per_rank in inputs]
    results[f"{name}: forward"] = max(_err(o, r[rank]) for o, r in zip(outs, refs))
    grads = [[_randn(seed + 100 + i, q, r[q].shape) for q in range(world)] for i, r in enumerate(refs)]
    loss = sum((o * g[rank]).sum() for o, g, d in zip(outs, grads, diff) if d)
    loss.backward()
    ref_loss = sum((r[q] * g[q]).sum() for r, g, d in zip(refs, grads, diff) if d for q in range(world))
    ref_grads = torch.autograd.grad(ref_loss, [x[rank] for x, d in zip(inputs, diff) if d])
    got = [x.grad for x, d in zip(mine, diff) if d]
    results[f"{name}: backward"] = max(_err(a, b) for a, b in zip(got, ref_grads))
    return mine, outs


def _check_exchanges(results, world, rank, group):
    lp = 3  # tokens per rank
    widths = [2 * world, 3 * world, world]  # fused tensors of different widths
    shapes = [(2, lp, w) for w in widths]
    _check_fused(results, "seq_to_hidden", lambda ts, **k: seq_to_hidden(ts, group, **k), _ref_seq_to_hidden, world, rank, shapes, (1, -1))
    out_shapes = [(2, lp * world, w // world) for w in widths]
    _check_fused(results, "hidden_to_seq", lambda ts, **k: hidden_to_seq(ts, group, **k), _ref_hidden_to_seq, world, rank, out_shapes, (1, -1), seed=10)
    # Ulysses layout: [B, L/P, heads, head_dim], heads split (q and k with different head counts)
    ulysses = [(2, lp, 2 * world, 4), (2, lp, world, 4)]
    _check_fused(results, "seq_to_hidden heads dim 2", lambda ts, **k: seq_to_hidden(ts, group, **k), _ref_seq_to_hidden, world, rank, ulysses, (1, 2), seed=20)
    # sequence-first [L/P, B, W] callers
    _check_fused(results, "seq_to_hidden seq_dim 0", lambda ts, **k: seq_to_hidden(ts, group, **k), _ref_seq_to_hidden, world, rank, [(lp, 2, world), (lp, 2, 2 * world)], (0, 2), seed=30)
    # mixed dtypes travel in one buffer: float64, float32 and int64 (e.g. positions)
    mixed = [torch.float64, torch.float32, torch.int64]
    _check_fused(results, "seq_to_hidden mixed dtypes", lambda ts, **k: seq_to_hidden(ts, group, **k), _ref_seq_to_hidden, world, rank, shapes, (1, -1), dtypes=mixed, seed=40)

    xs = [_randn(50 + i, rank, s) for i, s in enumerate(shapes)]
    back = hidden_to_seq(seq_to_hidden(xs, group), group)
    results["round trip hidden_to_seq(seq_to_hidden(x))"] = max(_err(a, b) for a, b in zip(back, xs))
    ys = [_randn(60 + i, rank, s) for i, s in enumerate(out_shapes)]
    back = seq_to_hidden(hidden_to_seq(ys, group), group)
    results["round trip seq_to_hidden(hidden_to_seq(y))"] = max(_err(a, b) for a, b in zip(back, ys))


def _check_reductions(results, world, rank, group):
    shape = (world, 2 * world, 3 * world)  # every dim divisible by the group size
    for dim in (0, 1, -1):
        # all_gather: y = cat_q x_q; global loss sum_q <y, g_q> -> dx_r = block r of sum_q g_q
        xs = _everyone(70, world, shape, requires_grad=True)
        y = all_gather(xs[rank], group, dim)
        ref = torch.cat(xs, dim=dim)
        gs = [_randn(71, q, ref.shape) for q in range(world)]
        (y * gs[rank]).sum().backward()
        (ref_grad,) = torch.autograd.grad(sum((ref * g).sum() for g in gs), [xs[rank]])
        results[f"all_gather dim {dim}: forward"] = _err(y, ref)
        results[f"all_gather dim {dim}: backward"] = (_err(xs[rank].grad, ref_grad), SUM_TOL)

        # reduce_scatter: y_r = block r of sum_q x_q; dx_r = cat_q g_q
        xs = _everyone(72, world, shape, requires_grad=True)
        y = reduce_scatter(xs[rank], group, dim)
        total = sum(xs)
        n = total.shape[dim] // world
        refs = [total.narrow(dim, q * n, n) for q in range(world)]
        gs = [_randn(73, q, refs[q].shape) for q in range(world)]
        (y * gs[rank]).sum().backward()
        (ref_grad,) = torch.autograd.grad(sum((r * g).sum() for r, g in zip(refs, gs)), [xs[rank]])
        results[f"reduce_scatter dim {dim}: forward"] = (_err(y, refs[rank]), SUM_TOL)
        results[f"reduce_scatter dim {dim}: backward"] = _err(xs[rank].grad, ref_grad)

    # all_reduce sum, replicated convention: one loss <y, g> with g the same on every rank
    xs = _everyone(74, world, (3, 4), requires_grad=True)
    y = all_reduce(xs[rank], group)
    g = _randn(75, 0, (3, 4))
    (y * g).sum().backward()
    results["all_reduce sum: forward"] = (_err(y, sum(x.detach() for x in xs)), SUM_TOL)
    results["all_reduce sum: backward (identity)"] = _err(xs[rank].grad, g)
    stacked = torch.stack([x.detach() for x in xs])
    results["all_reduce max"] = _err(all_reduce(xs[rank], group, op="max"), stacked.amax(0))
    results["all_reduce min"] = _err(all_reduce(xs[rank], group, op="min"), stacked.amin(0))

    # sp_scatter: x replicated; y_r = block r; global loss sum_q <y_q, g_q> -> dx = cat_q g_q
    x = _randn(76, 0, (2, 2 * world, 3)).requires_grad_(True)
    y = sp_scatter(x, group, 1)
    gs = [_randn(77, q, (2, 2, 3)) for q in range(world)]
    (y * gs[rank]).sum().backward()
    results["sp_scatter: forward"] = _err(y, x.detach()[:, 2 * rank : 2 * rank + 2])
    results["sp_scatter: backward"] = _err(x.grad, torch.cat(gs, dim=1))

    # sp_gather split: y = cat_q x_q replicated, one loss <y, g> -> dx_r = block r of g
    xs = _everyone(78, world, (2, 2, 3), requires_grad=True)
    y = sp_gather(xs[rank], group, 1)
    g = _randn(79, 0, (2, 2 * world, 3))
    (y * g).sum().backward()
    results["sp_gather split: forward"] = _err(y, torch.cat([x.detach() for x in xs], dim=1))
    results["sp_gather split: backward"] = _err(xs[rank].grad, g[:, 2 * rank : 2 * rank + 2])
    # sp_gather reduce_scatter: per-rank losses <y, g_q> -> dx_r = block r of sum_q g_q
    xs = _everyone(80, world, (2, 2, 3), requires_grad=True)
    y = sp_gather(xs[rank], group, 1, grad="reduce_scatter")
    gs = [_randn(81, q, (2, 2 * world, 3)) for q in range(world)]
    (y * gs[rank]).sum().backward()
    results["sp_gather reduce_scatter: backward"] = (_err(xs[rank].grad, sum(gs)[:, 2 * rank : 2 * rank + 2]), SUM_TOL)


def _counted(fn, *args, **kwargs):
    """(forward stats, backward stats, outer stats covering both): also proves nesting."""
    with CommStats() as outer:
        with CommStats() as fwd:
            out = fn(*args, **kwargs)
        outs = out if isinstance(out, list) else [out]
        loss = sum(o.sum() for o in outs)
        with CommStats() as bwd:
            loss.backward()
    return fwd, bwd, outer


def _check_stats(results, world, rank, group):
    p = world
    xs = [_randn(90 + i, rank, (2, 3, w)).requires_grad_(True) for i, w in enumerate((2 * p, 3 * p, p))]
    n = sum(x.numel() for x in xs) * E  # one fused buffer
    expected = {
        "seq_to_hidden": (lambda: seq_to_hidden(xs, group), {"all_to_all": (p - 1) * n // p}, {"all_to_all": (p - 1) * n // p}),
    }
    ys = [_randn(95 + i, rank, (2, 3 * p, w)).requires_grad_(True) for i, w in enumerate((2, 1))]
    n_y = sum(y.numel() for y in ys) * E
    expected["hidden_to_seq"] = (lambda: hidden_to_seq(ys, group), {"all_to_all": (p - 1) * n_y // p}, {"all_to_all": (p - 1) * n_y // p})
    x = _randn(99, rank, (2, 2 * p, 3)).requires_grad_(True)
    nx = x.numel() * E
    expected["all_gather"] = (lambda: all_gather(x, group, 1), {"all_gather": (p - 1) * nx}, {"reduce_scatter": (p - 1) * nx})
    expected["reduce_scatter"] = (lambda: reduce_scatter(x, group, 1), {"reduce_scatter": (p - 1) * nx // p}, {"all_gather": (p - 1) * (nx // p)})
    expected["all_reduce"] = (lambda: all_reduce(x, group), {"all_reduce": 2 * (p - 1) * nx // p}, {})
    expected["sp_scatter"] = (lambda: sp_scatter(x, group, 1), {}, {"all_gather": (p - 1) * (nx // p)})
    expected["sp_gather split"] = (lambda: sp_gather(x, group, 1), {"all_gather": (p - 1) * nx}, {})
    expected["sp_gather reduce_scatter"] = (lambda: sp_gather(x, group, 1, grad="reduce_scatter"), {"all_gather": (p - 1) * nx}, {"reduce_scatter": (p - 1) * nx})
    for name, (fn, fwd_bytes, bwd_bytes) in expected.items():
        for t in [*xs, *ys, x]:
            t.grad = None
        fwd, bwd, outer = _counted(fn)
        both = {op: fwd_bytes.get(op, 0) + bwd_bytes.get(op, 0) for op in {*fwd_bytes, *bwd_bytes}}
        ok = fwd.bytes_sent == fwd_bytes and bwd.bytes_sent == bwd_bytes and outer.bytes_sent == both
        ok = ok and fwd.calls == {op: 1 for op in fwd_bytes} and bwd.calls == {op: 1 for op in bwd_bytes}
        results[f"CommStats {name}"] = 0.0 if ok else f"fwd {fwd!r} bwd {bwd!r} outer {outer!r}; want fwd {fwd_bytes} bwd {bwd_bytes}"
    closed = CommStats()
    with closed:
        pass
    all_gather(x, group, 1)  # outside any recorder: nothing is counted anywhere
    results["CommStats inactive after exit"] = 0.0 if closed.calls == {} else repr(closed)


def _expect_value_error(results, name, fn, *fragments):
    """fn must raise ValueError naming every fragment, before any collective starts."""
    with CommStats() as stats:
        try:
            fn()
        except ValueError as exc:
            missing = [f for f in fragments if f not in str(exc)]
            ok = not missing and stats.calls == {}
            results[f"ValueError {name}"] = 0.0 if ok else f"message {exc!s} lacks {missing}; calls {stats.calls}"
            return
    results[f"ValueError {name}"] = "no ValueError raised"


def _check_validation(results, world, rank, group):
    p = world
    good = torch.zeros(2, 3, 2 * p, dtype=F64)
    bad = torch.zeros(2, 3, 2 * p + 1, dtype=F64)
    _expect_value_error(results, "seq_to_hidden hidden dim", lambda: seq_to_hidden([good, good, bad], group),
                        f"hidden dim {2 * p + 1}", "tensor 2", str((2, 3, 2 * p + 1)), f"group size {p}")
    _expect_value_error(results, "hidden_to_seq seq dim", lambda: hidden_to_seq([torch.zeros(2, 3 * p + 1, 2)], group),
                        f"sequence dim {3 * p + 1}", "tensor 0", f"group size {p}")
    _expect_value_error(results, "fused shape mismatch", lambda: seq_to_hidden([good, torch.zeros(3, 3, p)], group),
                        "tensor 1", str((3, 3, p)), "only in the hidden dim")
    _expect_value_error(results, "group None", lambda: all_gather(good, None, 1), "group is None")
    _expect_value_error(results, "dim out of range", lambda: all_gather(good, group, 3), "dim 3 is out of range")
    _expect_value_error(results, "reduce_scatter divisibility", lambda: reduce_scatter(bad, group, 2), f"size {2 * p + 1}", f"group size {p}")
    _expect_value_error(results, "sp_scatter divisibility", lambda: sp_scatter(bad, group, -1), f"group size {p}")
    _expect_value_error(results, "same seq and hidden dim", lambda: seq_to_hidden([good], group, seq_dim=2, hidden_dim=-1), "must differ")
    _expect_value_error(results, "a bare tensor", lambda: seq_to_hidden(good, group), "wrap one tensor in a list")
    _expect_value_error(results, "avg", lambda: all_reduce(good, group, op="avg"), "op='avg'")
    _expect_value_error(results, "sp_gather grad", lambda: sp_gather(good, group, 1, grad="sum"), "grad='sum'")
    # every rank raised locally and none entered a collective: the group is still in lockstep
    value = torch.tensor([float(rank + 1)], dtype=F64)
    dist.all_reduce(value, group=group)
    results["group in lockstep after the errors"] = abs(value.item() - p * (p + 1) / 2)


def _check_subgroups(results, world, rank):
    """Collectives on an explicit pair subgroup only involve that pair."""
    pairs = [list(range(i, i + 2)) for i in range(0, world, 2)]
    groups = [dist.new_group(pair) for pair in pairs]  # every rank creates every group
    group, members = groups[rank // 2], pairs[rank // 2]
    local = members.index(rank)
    shapes = [(2, 3, 4), (2, 3, 2)]
    xs = [[_randn(120 + i, q, s) for q in members] for i, s in enumerate(shapes)]
    outs = seq_to_hidden([x[local] for x in xs], group)
    refs = [_ref_seq_to_hidden(x, 2, 1, 2)[local] for x in xs]
    results["subgroup seq_to_hidden"] = max(_err(o, r) for o, r in zip(outs, refs))
    xg = [_randn(130, q, (2, 3)) for q in members]
    results["subgroup all_gather"] = _err(all_gather(xg[local], group, 0), torch.cat(xg, 0))


def _all_checks(rank, world_size):
    group = dist.group.WORLD
    results: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check_exchanges(results, world_size, rank, group)
        _check_reductions(results, world_size, rank, group)
        _check_stats(results, world_size, rank, group)
        _check_validation(results, world_size, rank, group)
        _check_subgroups(results, world_size, rank)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    results["no deprecation warnings"] = 0.0 if not deprecations else "; ".join(deprecations)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_match_single_process_reference(world_size):
    per_rank = run_ranks(world_size, _all_checks, timeout_s=180)
    failures = []
    for rank, results in enumerate(per_rank):
        assert len(results) > 50, sorted(results)
        for name, value in results.items():
            error, tolerance = value if isinstance(value, tuple) else (value, 0.0)
            if isinstance(error, str) or not error <= tolerance:
                failures.append(f"rank {rank} {name}: {error} (tolerance {tolerance})")
    assert not failures, "\n".join(failures)
