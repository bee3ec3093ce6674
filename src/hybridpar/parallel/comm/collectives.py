"""Autograd-aware collectives on an explicit process group (bytes: ``comm_stats.CommStats``).

Every function takes the group it runs on; none reads the default group. Each one checks
its inputs (dims in range, divisibility by the group size, matching shapes) before any
communication, so a bad shape raises the same ValueError on every rank instead of leaving
the others waiting inside a collective. (Shapes that differ *between* ranks cannot be seen
without communicating; callers get them equal by construction.)

P is the group size, r this rank's index in the group.

    seq_to_hidden(ts, group)        [B, L/P, W_i] -> [B, L, W_i/P]   one fused all_to_all
    hidden_to_seq(ts, group)        [B, L, W_i/P] -> [B, L/P, W_i]   one fused all_to_all
    all_gather(x, group, dim)       concat over ranks along dim      backward: reduce_scatter
    reduce_scatter(x, group, dim)   sum over ranks, keep block r     backward: all_gather
    all_reduce(x, group, op)        sum (or max/min) over ranks      backward: identity (sum)
    sp_scatter(x, group, dim)       keep block r, no communication   backward: all_gather
    sp_gather(x, group, dim, grad)  all_gather                       backward: keep block r
                                                                     or reduce_scatter
    ring_shift(x, group)            send x to rank r+1, receive      no autograd (the caller
                                    rank r-1's x (async: .wait())    owns its backward)

Gradient conventions. seq_to_hidden/hidden_to_seq are permutations, so each one's backward is
the other. all_gather/reduce_scatter are exact adjoints of each other when every rank's
output feeds its own loss term (global loss = sum over ranks). all_reduce's identity
backward, sp_scatter and sp_gather(grad="split") follow the replicated convention: the
tensor after the collective is replicated and every rank back-propagates the same gradient
into it (Megatron's TP/SP regions). Use sp_gather(grad="reduce_scatter") when the gathered
tensor feeds rank-specific work (e.g. a column-parallel linear), so the grads are partial.

Byte counting lives in ``comm_stats.CommStats`` (re-exported here): it sees these
collectives and every other one (DTensor's, FSDP's) at the dispatcher, and counts what this
rank sends: all_gather ``(P-1) * n``, reduce_scatter and all_to_all ``(P-1)/P * n``,
all_reduce ``2(P-1)/P * n``, with n the bytes of this rank's input buffer. Collectives that
run in a backward pass are counted under the op that actually runs; ``ring_shift``'s
point-to-point sends count as ``send``. With P = 1 no collective
runs and nothing is counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridpar.parallel.comm.stats import CommStats

__all__ = [
    "CommStats",
    "all_gather",
    "all_reduce",
    "hidden_to_seq",
    "reduce_scatter",
    "ring_shift",
    "seq_to_hidden",
    "sp_gather",
    "sp_scatter",
]

# 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of these names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# --- validation (local, before any communication) --------------------------------------


def _group_size(group, fn: str) -> tuple[int, int]:
    """(group size, this rank's index in the group)."""
    if group is None:
        raise ValueError(
            f"{fn}: group is None; pass the process group explicitly "
            "(e.g. mesh.get_group('cp') or dist.group.WORLD); the default group is never implied"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{fn}: this process (global rank {dist.get_rank()}) is not a member of the group")
    return dist.get_world_size(group), rank


def _dim(dim: int, ndim: int, fn: str, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{fn}: {what} {dim} is out of range for a {ndim}-d tensor; use -{ndim} <= dim < {ndim}")
    return dim % ndim


def _divisible(x: torch.Tensor, dim: int, size: int, fn: str, name: str, what: str) -> None:
    if x.shape[dim] % size:
        raise ValueError(
            f"{fn}: {what} {x.shape[dim]} (dim {dim}) of {name} with shape {tuple(x.shape)} is not "
            f"divisible by the group size {size}; pad it or pick sizes that are multiples of {size}"
        )


def _check_fused(tensors, size, seq_dim, hidden_dim, split_is_hidden, fn) -> tuple[int, int]:
    """Validate a fused exchange; returns normalised (seq_dim, hidden_dim)."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence) or len(tensors) == 0:
        raise ValueError(
            f"{fn}: expected a non-empty list of tensors, got {type(tensors).__name__}; wrap one tensor in a list"
        )
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: item {i} is a {type(t).__name__}, not a tensor")
        if t.ndim != first.ndim or t.device != first.device:
            raise ValueError(
                f"{fn}: tensor {i} has shape {tuple(t.shape)} on {t.device} but tensor 0 has shape "
                f"{tuple(first.shape)} on {first.device}; fused tensors need the same rank and device"
            )
    seq_dim = _dim(seq_dim, first.ndim, fn, "seq_dim")
    hidden_dim = _dim(hidden_dim, first.ndim, fn, "hidden_dim")
    if seq_dim == hidden_dim:
        raise ValueError(f"{fn}: seq_dim and hidden_dim both name dim {seq_dim}; they must differ")
    for i, t in enumerate(tensors):
        for d in range(t.ndim):
            if d != hidden_dim and t.shape[d] != first.shape[d]:
                raise ValueError(
                    f"{fn}: tensor {i} has shape {tuple(t.shape)} but tensor 0 has {tuple(first.shape)}; "
                    f"fused tensors may differ only in the hidden dim ({hidden_dim})"
                )
        if split_is_hidden:
            _divisible(t, hidden_dim, size, fn, f"tensor {i}", "hidden dim")
        else:
            _divisible(t, seq_dim, size, fn, f"tensor {i}", "sequence dim")
    return seq_dim, hidden_dim


# --- raw collectives (no autograd); each records its bytes -----------------------------


def _exchange(send: torch.Tensor, group, size: int) -> torch.Tensor:
    """all_to_all_single of a [P, n] buffer: row j goes to rank j; row j of the result came from rank j."""
    if size == 1:
        return send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # [P, n] -> [P, n]
    return recv


def _fused_all_to_all(tensors, group, size: int, split_dim: int, join_dim: int) -> list[torch.Tensor]:
    """Cut every tensor into P parts along split_dim, send part j to rank j, and join the P
    received parts (in rank order) along join_dim. One all_to_all_single for all tensors."""
    rows, part_shapes = [], []
    for t in tensors:
        # [.., S, ..] -> [.., P, S/P, ..] -> [P, .., S/P, ..] -> [P, numel/P]
        parts = t.unflatten(split_dim, (size, t.shape[split_dim] // size)).movedim(split_dim, 0)
        part_shapes.append(parts.shape[1:])
        rows.append(parts.reshape(size, -1))
    same_dtype = all(t.dtype == tensors[0].dtype for t in tensors)
    if not same_dtype:  # pure data movement: travel as bytes, reinterpret on arrival
        rows = [row.contiguous().view(torch.uint8) for row in rows]
    send = torch.cat(rows, dim=1)  # [P, sum n_i]
    recv = _exchange(send, group, size)  # [P, sum n_i], row j from rank j
    outputs, offset = [], 0
    for t, row, part_shape in zip(tensors, rows, part_shapes):
        piece = recv[:, offset : offset + row.shape[1]]
        offset += row.shape[1]
        if not same_dtype:
            piece = piece.contiguous().view(t.dtype)
        # [P, .., J, ..] -> [.., P, J, ..] -> [.., P*J, ..]: received parts joined in rank order
        piece = piece.reshape(size, *part_shape).movedim(0, join_dim)
        outputs.append(piece.flatten(join_dim, join_dim + 1))
    return outputs


def _gather(x: torch.Tensor, group, size: int, dim: int) -> torch.Tensor:
    """[.., n, ..] -> [.., P*n, ..], rank-major along dim."""
    if size == 1:
        return x.clone()
    front = x.movedim(dim, 0).contiguous()  # [n, ..]
    out = front.new_empty((size * front.shape[0], *front.shape[1:]))  # [P*n, ..]
    _all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


def _scatter_sum(x: torch.Tensor, group, size: int, dim: int) -> torch.Tensor:
    """[.., P*n, ..] summed over ranks -> this rank's block [.., n, ..]."""
    if size == 1:
        return x.clone()
    front = x.movedim(dim, 0).contiguous()  # [P*n, ..]
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))  # [n, ..]
    _reduce_scatter_single(out, front, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim)


def _reduce(x: torch.Tensor, group, size: int, op: str) -> torch.Tensor:
    out = x.detach().clone(memory_format=torch.contiguous_format)
    if size > 1:
        dist.all_reduce(out, op=_REDUCE_OPS[op], group=group)
    return out


def _own_block(x: torch.Tensor, size: int, rank: int, dim: int) -> torch.Tensor:
    block = x.shape[dim] // size
    return x.narrow(dim, rank * block, block).clone(memory_format=torch.contiguous_format)


# --- autograd functions ----------------------------------------------------------------


class _FusedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, size, split_dim, join_dim, *tensors):
        ctx.group, ctx.size, ctx.split_dim, ctx.join_dim = group, size, split_dim, join_dim
        outputs = _fused_all_to_all(tensors, group, size, split_dim, join_dim)
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        # The transposed exchange, for the inputs that need a gradient (the same on every rank).
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        result = [None] * len(grads)
        if wanted:
            moved = _fused_all_to_all([grads[i] for i in wanted], ctx.group, ctx.size, ctx.join_dim, ctx.split_dim)
            for i, g in zip(wanted, moved):
                result[i] = g
        return (None, None, None, None, *result)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, rank, dim, grad_mode):
        ctx.group, ctx.size, ctx.rank, ctx.dim, ctx.grad_mode = group, size, rank, dim, grad_mode
        return _gather(x, group, size, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_mode == "split":
            return _own_block(grad, ctx.size, ctx.rank, ctx.dim), None, None, None, None, None
        return _scatter_sum(grad, ctx.group, ctx.size, ctx.dim), None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, dim):
        ctx.group, ctx.size, ctx.dim = group, size, dim
        return _scatter_sum(x, group, size, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.size, ctx.dim), None, None, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        return _reduce(x, group, size, "sum")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None  # replicated convention: every rank holds the same grad


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, rank, dim):
        ctx.group, ctx.size, ctx.dim = group, size, dim
        return _own_block(x, size, rank, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.size, ctx.dim), None, None, None, None


# --- public API ------------------------------------------------------------------------


def seq_to_hidden(tensors, group, seq_dim: int = 1, hidden_dim: int = -1) -> list[torch.Tensor]:
    """Sequence-sharded -> hidden-sharded, all tensors in one all_to_all_single.

    Each ``[B, L/P, W_i]`` is cut into P parts along hidden_dim, part j goes to rank j; the
    result ``[B, L, W_i/P]`` holds the ranks' sequence chunks concatenated in rank order.
    Tensors may differ in width and dtype (mixed dtypes travel as bytes; integer outputs
    carry no grad). Backward: hidden_to_seq of the gradients.
    """
    size, _ = _group_size(group, "seq_to_hidden")
    seq_dim, hidden_dim = _check_fused(tensors, size, seq_dim, hidden_dim, True, "seq_to_hidden")
    # [B, L/P, W] -> [B, L, W/P]: split the hidden dim, join along the sequence dim
    return list(_FusedAllToAll.apply(group, size, hidden_dim, seq_dim, *tensors))


def hidden_to_seq(tensors, group, seq_dim: int = 1, hidden_dim: int = -1) -> list[torch.Tensor]:
    """Hidden-sharded -> sequence-sharded, the inverse of seq_to_hidden (one fused exchange).

    Each ``[B, L, W_i/P]`` is cut into P contiguous sequence blocks, block j goes to rank j;
    the result ``[B, L/P, W_i]`` joins the received hidden parts in rank order.
    Backward: seq_to_hidden of the gradients.
    """
    size, _ = _group_size(group, "hidden_to_seq")
    seq_dim, hidden_dim = _check_fused(tensors, size, seq_dim, hidden_dim, False, "hidden_to_seq")
    # [B, L, W/P] -> [B, L/P, W]: split the sequence dim, join along the hidden dim
    return list(_FusedAllToAll.apply(group, size, seq_dim, hidden_dim, *tensors))


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's x along dim in rank order: [.., n, ..] -> [.., P*n, ..].

    Backward: reduce-scatter (sum) of the gradient along dim.
    """
    size, rank = _group_size(group, "all_gather")
    dim = _dim(dim, x.ndim, "all_gather", "dim")
    return _AllGather.apply(x, group, size, rank, dim, "reduce_scatter")


def reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum over ranks, keep block r along dim: [.., P*n, ..] -> [.., n, ..]. Backward: all-gather."""
    size, _ = _group_size(group, "reduce_scatter")
    dim = _dim(dim, x.ndim, "reduce_scatter", "dim")
    _divisible(x, dim, size, "reduce_scatter", "the input", "size")
    return _ReduceScatter.apply(x, group, size, dim)


def all_reduce(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """Reduce over ranks, out of place, for losses and token counts.

    op="sum": backward is the identity (replicated convention: each rank back-propagates the
    same gradient into the sum). op="max"/"min": not differentiable, the result has no grad.
    """
    size, _ = _group_size(group, "all_reduce")
    if op not in _REDUCE_OPS:
        raise ValueError(
            f"all_reduce: op={op!r} is not supported; use one of {sorted(_REDUCE_OPS)} "
            "(for a mean, sum and divide: gloo's AVG has been unreliable)"
        )
    if op == "sum":
        return _AllReduceSum.apply(x, group, size)
    return _reduce(x, group, size, op)


def sp_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Keep this rank's contiguous block of a replicated x along dim (no communication).

    [.., S, ..] -> [.., S/P, ..]. Backward: all-gather of the gradient blocks.
    """
    size, rank = _group_size(group, "sp_scatter")
    dim = _dim(dim, x.ndim, "sp_scatter", "dim")
    _divisible(x, dim, size, "sp_scatter", "the input", "size")
    return _Scatter.apply(x, group, size, rank, dim)


def sp_gather(x: torch.Tensor, group, dim: int, grad: str = "split") -> torch.Tensor:
    """All-gather of sequence blocks along dim: [.., S/P, ..] -> [.., S, ..].

    grad="split": backward keeps this rank's block of the gradient (no communication); right
    when every rank back-propagates the same gradient into the gathered tensor (replicated
    compute). grad="reduce_scatter": backward sums the gradient blocks over ranks; right when
    the gathered tensor feeds rank-specific work such as a column-parallel linear.
    """
    size, rank = _group_size(group, "sp_gather")
    if grad not in ("split", "reduce_scatter"):
        raise ValueError(f"sp_gather: grad={grad!r}; use 'split' or 'reduce_scatter'")
    dim = _dim(dim, x.ndim, "sp_gather", "dim")
    return _AllGather.apply(x, group, size, rank, dim, grad)


class RingShift:
    """A started ``ring_shift``: ``wait()`` returns the tensor received from rank r-1."""

    def __init__(self, sent: torch.Tensor, received: torch.Tensor, works: list):
        self._sent, self._received, self._works = sent, received, works  # buffers live until wait()

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self._received


def ring_shift(x: torch.Tensor, group, tag: int = 0) -> RingShift:
    """Start sending ``x`` to rank ``(r+1) % P`` and receiving rank ``(r-1) % P``'s ``x`` (same shape).

    Raw point-to-point (``batch_isend_irecv``), no autograd: callers (ring attention) run their
    own backward. Shifts in flight at the same time need distinct ``tag``s. With P = 1 the
    "received" tensor is ``x`` itself.
    """
    size, rank = _group_size(group, "ring_shift")
    if size == 1:
        return RingShift(x, x, [])
    send = x.contiguous()
    received = torch.empty_like(send)
    peer = lambda r: dist.get_global_rank(group, r % size)  # noqa: E731 - group rank -> global rank
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, peer(rank + 1), group, tag),
        dist.P2POp(dist.irecv, received, peer(rank - 1), group, tag),
    ])
    return RingShift(send, received, works)
