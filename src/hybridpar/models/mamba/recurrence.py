"""Loop-free scalar-decay linear recurrence: the SSD state passing over chunks.

For ``n`` items with features ``u_j`` (``[D]``), log decays ``la_j <= 0`` and resets::

    h_j = exp(la_j) * [not reset_j] * h_{j-1} + u_j,        h_{-1} = 0

so ``h_j = sum_{i<=j} W[j, i] u_i`` with ``W[j, i] = exp(sum_{k=i+1..j} la_k)`` when no item in
``(i, j]`` resets, else 0 -- the segment-sum (``segsum``) matrix of mamba_ssm's ``ssd_minimal``.
A full ``n x n`` matrix costs ``n^2 D``; two levels keep it ``O(n^1.5 D)`` and exact:

1. items in blocks of ``m = ceil(sqrt(n))``: inside each block ``h_loc = W_block @ u`` from a
   zero entering state (one batched matmul over all blocks);
2. blocks: the state leaving block ``b`` follows the same recurrence over the ``n/m <= m``
   blocks, with ``u`` = the block's ``h_loc`` at its last item and the block's summed decay --
   one more segsum matmul;
3. ``h[b, j] = h_loc[b, j] + F[b, j] * h_last[b-1]`` with ``F[b, j]`` the decay from the
   block start through item ``j``.

A fixed number of tensor operations, whatever ``n``: no Python loop over items or blocks.
Segment sums are masked cumulative sums (no difference of two long cumsums, so no
cancellation) and every exponent is floored at ``log(tiny**0.75)`` as in ``ssd.py``. The
backward is the same recurrence run backwards (``reverse_recurrence``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def decay_floor(dtype: torch.dtype) -> float:
    """Smallest exponent used, ``log(tiny**0.75)`` (about -65 in float32, -531 in float64)."""
    return 0.75 * math.log(torch.finfo(dtype).tiny)


def underflow_log(dtype: torch.dtype) -> float:
    """A log decay whose ``exp`` is 0 in ``dtype``: below half its smallest subnormal (about -104.3 in
    float32, -745.4 in float64). A step's log decay floored there changes no value a recurrence held in
    ``dtype`` can take: every decay through that step rounds to 0 either way."""
    info = torch.finfo(dtype)
    return math.log(info.tiny * info.eps) - 1.0


def linear_recurrence(u: Tensor, log_decay: Tensor, reset: Tensor) -> Tensor:
    """``h`` of the recurrence above. u ``[..., n, D]``, log_decay ``[..., n]`` (<= 0), reset bool
    ``[n]`` (shared by all leading dims). Returns ``[..., n, D]``."""
    n = u.shape[-2]
    if n == 0:
        return u.clone()
    block = math.isqrt(n - 1) + 1  # ceil(sqrt(n)) >= number of blocks
    nblocks = -(-n // block)
    pad = nblocks * block - n
    if pad:  # padded items come last, so they change nothing before them
        u = torch.nn.functional.pad(u, (0, 0, 0, pad))
        log_decay = torch.nn.functional.pad(log_decay, (0, pad))
        reset = torch.cat([reset, reset.new_zeros(pad)])
    u = u.unflatten(-2, (nblocks, block))  # [..., nb, m, D]
    log_decay = log_decay.unflatten(-1, (nblocks, block))  # [..., nb, m]
    reset = reset.view(nblocks, block)  # [nb, m]
    resets_so_far = reset.long().cumsum(-1)  # [nb, m], resets in items 0..j of the block

    h_local = _segsum_matrix(log_decay, resets_so_far) @ u  # [..., nb, m, D] from a zero entering state
    block_decay = log_decay.sum(-1)  # [..., nb]
    block_reset = resets_so_far[:, -1] > 0  # [nb]
    leaving = _segsum_matrix(block_decay, block_reset.long().cumsum(-1)) @ h_local[..., -1, :]  # [..., nb, D]: after each block
    entering = torch.cat([torch.zeros_like(leaving[..., :1, :]), leaving[..., :-1, :]], dim=-2)  # [..., nb, D]
    from_start = _masked_exp(log_decay.cumsum(-1), resets_so_far == 0)  # [..., nb, m] F[b, j]
    h = torch.addcmul(h_local, from_start[..., None], entering[..., None, :])  # [..., nb, m, D]
    return h.flatten(-3, -2)[..., :n, :]


def reverse_recurrence(grad_h: Tensor, log_decay: Tensor, reset: Tensor) -> Tensor:
    """``g_j = grad_h_j + exp(la_{j+1}) [not reset_{j+1}] g_{j+1}``: the gradient of ``u`` given the
    gradient of ``h`` (the recurrence run from the end, decays shifted by one item)."""
    shifted_decay = torch.nn.functional.pad(log_decay[..., 1:], (0, 1))  # la_{j+1}, 0 after the end
    shifted_reset = torch.cat([reset[1:], reset.new_zeros(1)])
    flipped = linear_recurrence(grad_h.flip(-2), shifted_decay.flip(-1), shifted_reset.flip(-1))
    return flipped.flip(-2)


def step_decay(log_decay: Tensor, reset: Tensor) -> Tensor:
    """``exp(la_j) * [not reset_j]`` (floored exponent), the factor applied to ``h_{j-1}``."""
    return _masked_exp(log_decay, ~reset)


def _segsum_matrix(log_decay: Tensor, resets_so_far: Tensor) -> Tensor:
    """``W[..., j, i] = exp(sum_{k=i+1..j} la_k)`` for ``i <= j`` with no reset in ``(i, j]``, else 0.

    log_decay ``[..., m]``, resets_so_far ``[..., m]`` (cumulative reset count); returns
    ``[..., m, m]``. The sums are a cumsum of ``la`` masked below the diagonal (stable segsum).
    """
    m = log_decay.shape[-1]
    lower = torch.ones(m, m, dtype=torch.bool, device=log_decay.device).tril()
    same_run = (resets_so_far[..., :, None] == resets_so_far[..., None, :]) & lower
    return _masked_exp(segment_sums(log_decay), same_run)


def segment_sums(a: Tensor) -> Tensor:
    """``S[..., j, i] = sum_{i<k<=j} a_k`` (0 on and above the diagonal) of ``a [..., m]``: ``[..., m, m]``, a
    cumsum of ``a`` masked below the diagonal, never a difference of two cumsums (which cancels once one step is
    large: a float32 cumsum of -7e6 steps by 0.5)."""
    m = a.shape[-1]
    strictly_lower = torch.ones(m, m, dtype=torch.bool, device=a.device).tril(-1)
    return torch.where(strictly_lower, a[..., :, None], 0.0).cumsum(-2)  # [..., m(k), m(i)]: a_k for k > i, summed


def suffix_sums(a: Tensor) -> Tensor:
    """``sum_{k>s} a_k`` for every ``s`` of ``a [..., m]`` (0 at the last), without a difference of cumsums."""
    return F.pad(a.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))


def _masked_exp(exponent: Tensor, keep: Tensor) -> Tensor:
    """``exp(max(exponent, floor))`` where ``keep``, exactly 0 elsewhere."""
    return exponent.clamp(min=decay_floor(exponent.dtype)).exp() * keep
