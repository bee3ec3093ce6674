"""One block of the LM head loss (``lm_head_loss.py``): its statistics and its logit gradient, eager
or compiled into a kernel or two.

For a block of logits ``z [Ct, Cv]`` (one matmul's output) and per-token running statistics ``[Ct]``:

    z'        = c tanh(s z / c)  (a cap c)   or   s z                     the transformed logits
    m_new     = max(m, max_v z'_v)            arg_new: the id of the first max (earlier blocks win ties)
    s_new     = s exp(m - m_new) + sum_v exp(z'_v - m_new)
    target_new = target + [y in block] z'_y

and, given ``lse [Ct]`` and the token factor ``f [Ct]`` (``g [y != -100]``, times ``s`` without a cap),

    dz_v = f (exp(z'_v - lse) - [v == y]) dz'/dz       dz'/dz = 1, s, or s (1 - tanh^2(s z / c))

rounded once to the matmul dtype. Eager, these are about ten aten ops per block, each a pass over the
``[Ct, Cv]`` block: 20 bytes per logit forward and 22 backward at bf16 logits (``benchmarks/step_traffic.py``,
the loss's part). On CUDA they run compiled (``cuda_compile.run_compiled``): inductor fuses each into a
reduction or a pointwise kernel that reads the block once or twice and writes only ``[Ct]`` statistics
or the bf16 ``dz``. The compiled form computes the same expressions and writes no input, in float32
or wider: equal to the eager form within that dtype's rounding, not bitwise (sums run in
another order; under a soft cap, ``tanh`` saturates, so the argmax may pick another of logits that tie
within rounding). On CPU the eager form runs, the exact reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridpar.models.cuda_compile import eager_mode, run_compiled

__all__ = ["block_statistics", "block_gradient"]


def _transformed(z: Tensor, dtype: torch.dtype, scale: float, softcap: float | None) -> Tensor:
    """``z'`` in the compute ``dtype``; ``z`` as it is without a transform (bf16 under mixed precision is
    read in ``dtype`` by ``_shifted``: no float32 copy of the block, the same values). Eager it writes
    the matmul's own output (or its copy) in place; traced, it writes no input."""
    if softcap is None and scale == 1.0:
        return z
    z = z.to(dtype)
    if not eager_mode():
        return torch.tanh(z * (scale / softcap)) * softcap if softcap is not None else z * scale
    return z.mul_(scale / softcap).tanh_().mul_(softcap) if softcap is not None else z.mul_(scale)


def _shifted(logits: Tensor, shift: Tensor, dtype: torch.dtype) -> Tensor:
    """``logits - shift[:, None]`` in ``dtype``: in place on an eager block already in it, else one
    promoting pass (``bf16 - fp32`` is computed and stored in fp32, as the cast then the subtraction)."""
    if logits.dtype == dtype and eager_mode():
        return logits.sub_(shift[:, None])
    return torch.sub(logits, shift[:, None])


def _statistics(z: Tensor, row_max: Tensor, sum_exp: Tensor, argmax: Tensor, target: Tensor, column: Tensor,
                in_block: Tensor, first_id: int, scale: float, softcap: float | None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The running ``(max, sum of exp, argmax, target logit)`` ``[Ct]`` after this block (module docstring);
    ``first_id``: the global id of the block's first row."""
    dtype = row_max.dtype
    logits = _transformed(z, dtype, scale, softcap)  # [Ct, Cv]: z'
    block_max, block_arg = logits.max(dim=1)
    block_max = block_max.to(dtype)  # exact: the max is one of the block's values
    new_max = torch.maximum(row_max, block_max)
    # strictly greater: on a tie the earlier block (lower id) keeps the argmax, as torch.argmax
    new_arg = torch.where(block_max > row_max, block_arg + first_id, argmax)
    picked = logits.gather(1, column[:, None]).squeeze(1).to(dtype)
    new_target = target + torch.where(in_block, picked, 0.0)
    block_sum = _shifted(logits, new_max, dtype).exp_().sum(dim=1)  # exp_ on a block of its own, never an input
    return new_max, sum_exp * torch.exp(row_max - new_max) + block_sum, new_arg, new_target


def _gradient(z: Tensor, lse: Tensor, token_factor: Tensor, column: Tensor, in_block: Tensor,
              out_dtype: torch.dtype, scale: float, softcap: float | None) -> Tensor:
    """``dz [Ct, Cv]`` in ``out_dtype`` (module docstring), from ``lse`` and ``token_factor`` in the compute
    dtype, which ``dz`` is computed in and rounded from once."""
    dtype = lse.dtype
    if softcap is None:  # softmax(z') of this block; _shifted gives a block of its own to write in place
        dz = _shifted(_transformed(z, dtype, scale, None), lse, dtype).exp_()
    else:
        tanh = (z.to(dtype) * (scale / softcap)).tanh_()  # tanh(s z / c)
        dz = (tanh * softcap).sub_(lse[:, None]).exp_()
    dz.scatter_add_(1, column[:, None], -in_block.to(dtype)[:, None])  # - onehot(y)
    factor = token_factor[:, None]
    if softcap is not None:
        dz.mul_(factor)
        factor = tanh.square_().neg_().add_(1.0).mul_(scale)  # dz'/dz = s (1 - tanh^2)
    if out_dtype == dtype:
        return dz.mul_(factor)
    if eager_mode():  # the last factor and the rounding in one pass: computed in dtype, stored in out_dtype
        return torch.mul(dz, factor, out=torch.empty(dz.shape, dtype=out_dtype, device=dz.device))
    return (dz * factor).to(out_dtype)  # traced: inductor rounds once as it stores


def block_statistics(z: Tensor, row_max: Tensor, sum_exp: Tensor, argmax: Tensor, target: Tensor, column: Tensor,
                     in_block: Tensor, first_id: int, scale: float, softcap: float | None):
    """``_statistics``, compiled on CUDA (``cuda_compile.py``)."""
    return run_compiled("LM head loss statistics", _statistics, z.device, z, row_max, sum_exp, argmax, target, column,
                        in_block, first_id, scale, softcap)


def block_gradient(z: Tensor, lse: Tensor, token_factor: Tensor, column: Tensor, in_block: Tensor,
                   out_dtype: torch.dtype, scale: float, softcap: float | None) -> Tensor:
    """``_gradient``, compiled on CUDA (``cuda_compile.py``)."""
    return run_compiled("LM head loss gradient", _gradient, z.device, z, lse, token_factor, column, in_block,
                        out_dtype, scale, softcap)
