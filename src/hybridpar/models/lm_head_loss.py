"""The LM head and cross entropy in blocks: the loss without ever holding the [T, V] logits.

For token ``t`` with final hidden state ``h_t`` (``[D]``), LM head rows ``W_v`` and label ``y_t``:

    z_tv   = h_t . W_v                                   logits (never stored)
    lse_t  = log sum_v exp(z_tv)
    loss   = sum_{t: y_t != -100} (lse_t - z_{t,y_t})    summed, not averaged

The vocabulary is walked in blocks of ``C`` rows and the tokens in chunks of ``C``; one
``[C, C]`` block of logits exists at a time. Per token an online logsumexp runs over the blocks:

    m_t <- max(m_t, max_{v in block} z_tv)
    s_t <- s_t * exp(m_t_old - m_t) + sum_{v in block} exp(z_tv - m_t)       lse_t = m_t + log s_t

and the target logit ``z_{t,y_t}`` is picked from the block that holds ``y_t``. The forward
saves ``hidden``, ``weight``, ``labels`` and ``lse [T]``. The backward recomputes each block:

    dz_tv = g * [y_t != -100] * (exp(z_tv - lse_t) - [v == y_t])      (g = d loss_sum)
    dh_t += sum_{v in block} dz_tv W_v        dW_v += sum_{t in chunk} dz_tv h_t

**Scaled and soft-capped logits** (Cohere, Granite, Falcon-H1: a scale ``s``; Gemma 2/3,
RecurrentGemma: a cap ``c``). The loss runs on the transformed logits of each block,

    z'_tv = c * tanh(s * z_tv / c)      when a cap c is set,   else   z'_tv = s * z_tv

(the online logsumexp, the target logit and the argmax are those of ``z'``; for ``s > 0`` the
argmax equals ``z``'s, both maps being increasing), and the backward applies the chain rule:

    dz_tv = g * [y_t != -100] * (exp(z'_tv - lse_t) - [v == y_t]) * s * (1 - tanh^2(s z_tv / c))
                                                                  (* s alone without a cap)

The default ``s = 1``, no cap, is the plain head and runs no extra operation.

Blocks are computed in ``promote(dtype, float32)`` (bfloat16 inputs run in float32; float64
stays float64); the statistics, ``grad_hidden [T, D]`` and each vocabulary block's ``dW``
accumulate in that dtype and are cast to the input dtypes once at the end. Under autocast (bf16
mixed precision of a float32 model) the block matmuls alone run in the autocast dtype, forward
and backward alike (the backward recomputes the forward's logits); statistics stay float32.
A block is ``TOKEN_BLOCKS * C`` tokens by ``C`` vocabulary rows (``C = chunk_size``), with more rows
when there are fewer tokens (``block_shape``: the same elements). Besides its matmul a block's update
(``lm_head_blocks.py``) is a dozen small ops eager, each a pass over the block; on CUDA it runs
compiled, one kernel each way.
Peak memory beyond the inputs and gradients: a few such blocks and ``O(T)`` statistics.

The same passes run on a vocabulary shard (rows ``[offset, offset + V_local)``): they return
the local max, sum of exponentials, target logit and argmax that ``parallel/vocab_parallel_loss``
all-reduces over the tensor-parallel group. This module is single-device code; the op
``hybridpar::lm_head_loss`` (a ``torch.library.custom_op`` with its autograd) is one opaque
node to ``torch.compile``; its Python loops run at execution time, with no host sync.

Labels outside ``[0, V)`` (other than -100) raise ``ValueError`` when the labels are on the
CPU (checking costs no device sync there). On an accelerator the check would need a host sync,
so instead such labels turn ``loss_sum`` into NaN (the trainer stops on a non-finite loss). The trainer's
ids cannot leave the vocabulary: its tokenizer is checked against the model once, at start
(``data/tokenizers.check_tokenizer``), and ``train/trainer.pack_tensors`` runs ``check_token_values`` and
``check_label_values`` on every pack while it is still on the CPU, before it moves to the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from hybridpar.models.arguments import python_number
from hybridpar.models.lm_head_blocks import block_gradient, block_statistics
from hybridpar.models.precision import full_precision

__all__ = [
    "IGNORE_INDEX", "LMHeadLoss", "block_shape", "ChunkedLMHeadLoss", "chunked_lm_head_loss", "check_lm_head_inputs",
    "check_label_values", "check_token_values", "check_logit_transform", "local_statistics", "local_gradients",
    "loss_from_statistics",
]

IGNORE_INDEX = -100


class LMHeadLoss(NamedTuple):
    """``loss_sum`` (scalar, compute dtype), ``valid_count`` (int64 scalar) and, when asked
    for, ``predictions`` (argmax token ids, the labels' shape; ties go to the lower id)."""

    loss_sum: Tensor
    valid_count: Tensor
    predictions: Tensor | None = None


def autocast_matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype | None:
    """The autocast dtype of ``hidden``'s device when autocast is on and the compute dtype is
    float32 (mixed precision: the logit matmuls in bf16, statistics in float32), else None."""
    device = hidden.device.type
    if compute_dtype(hidden, weight) != torch.float32 or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype blocks are computed and accumulated in: at least float32."""
    return torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)


def check_lm_head_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int) -> None:
    """Shapes, dtypes and ``chunk_size``: ``ValueError`` naming the value and the fix (no sync)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int (vocabulary rows per block, "
                         f"{TOKEN_BLOCKS} times that in tokens, e.g. 4096); pass chunk_size >= 1.")
    if weight.dim() != 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; the LM head weight must be [V, D] "
                         "(nn.Linear(D, V).weight); pass lm_head.weight.")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must end in the hidden size D={weight.shape[1]} of weight "
                         f"{tuple(weight.shape)}; pass the final-norm output [..., D] and the LM head weight [V, D].")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must be floating point.")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels have dtype {labels.dtype}; pass integer token ids (torch.long), -100 to ignore.")
    if labels.numel() != hidden.shape[:-1].numel():
        raise ValueError(f"labels {tuple(labels.shape)} and hidden {tuple(hidden.shape)} cover different token "
                         "counts; pass the labels of the same (context-parallel local, not sequence-scattered) tokens.")
    if hidden.device != weight.device or hidden.device != labels.device:
        raise ValueError(f"hidden ({hidden.device}), weight ({weight.device}) and labels ({labels.device}) must be "
                         "on one device; move the labels with .to(hidden.device).")


def check_label_values(labels: Tensor, vocab_size: int) -> None:
    """``ValueError`` for a label outside ``[0, vocab_size)`` other than -100, on CPU only (see the
    module docstring: on accelerators out-of-range labels make the loss NaN instead)."""
    if labels.device.type != "cpu":
        return
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"label {int(labels[index])} at token {index} is outside the vocabulary [0, {vocab_size}); labels "
            f"must be token ids below vocab_size={vocab_size} or -100 (ignored). Fix the data or tokenizer, or "
            "use a model whose vocab_size covers every token id.")


def check_token_values(input_ids: Tensor, vocab_size: int) -> None:
    """``ValueError`` for a token id outside ``[0, vocab_size)``, on CPU only (on an accelerator the check would
    sync every step). torch's embedding raised a bare ``IndexError`` for one; a vocabulary-parallel embedding
    (tensor parallelism) gave it a silent zero vector, since no rank's shard holds the row."""
    if input_ids.device.type != "cpu" or input_ids.numel() == 0:
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids hold the token id {bad}, outside the model's vocabulary [0, {vocab_size}); "
                         f"pass ids below vocab_size={vocab_size} (-100 marks ignored labels, not input ids), or use a "
                         "model whose vocab_size covers every id.")


def check_logit_transform(scale: float, softcap: float | None) -> None:
    """``ValueError`` unless ``scale`` is a finite float > 0 and ``softcap`` None or a finite float > 0."""
    for name, value in (("scale", scale), ("softcap", softcap)):
        if value is None and name == "softcap":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name}={value!r} must be a finite number > 0 (the logit transform z' = c tanh(s z / c) "
                             "or s z); pass scale=1.0 and softcap=None for plain logits.")


TOKEN_BLOCKS = 4  # tokens per block, in chunk sizes


def block_shape(tokens: int, rows: int, chunk_size: int) -> tuple[int, int]:
    """``(tokens, rows)`` of one block of logits: ``TOKEN_BLOCKS * C`` tokens by ``C`` rows, and with
    fewer tokens than that, as many more rows as keep the block's ``TOKEN_BLOCKS * C * C`` elements
    (fewer blocks, each a dozen kernel launches: 8 where there were 16 for 8,192 tokens and a 64K
    vocabulary), never more rows than there are."""
    token_block = max(1, min(tokens, TOKEN_BLOCKS * chunk_size))
    row_block = max(chunk_size, TOKEN_BLOCKS * chunk_size * chunk_size // token_block)
    return token_block, max(1, min(rows, row_block))


def _blocks(size: int, chunk_size: int):
    return ((start, min(start + chunk_size, size)) for start in range(0, size, chunk_size))


@torch.no_grad()
@full_precision
def local_statistics(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int,
                     vocab_offset: int = 0, matmul_dtype: torch.dtype | None = None, scale: float = 1.0,
                     softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One blockwise pass over the rows ``weight [V_local, D]`` (global ids from ``vocab_offset``).

    Returns, per token of ``hidden [T, D]`` / ``labels [T]``: the max logit ``m [T]``, the sum of
    ``exp(z - m) [T]``, the target logit ``[T]`` (0 where the label is not in these rows) and the
    global id of the first max ``[T]`` (int64). An empty shard gives ``m = -inf``, ``s = 0``.
    ``matmul_dtype`` (bf16 under mixed precision): the logit blocks' matmuls run in it, every
    statistic stays in the compute dtype. ``scale``/``softcap``: the statistics are those of ``z'``.
    """
    dtype = compute_dtype(hidden, weight)
    tokens, rows = hidden.shape[0], weight.shape[0]
    h = hidden.to(matmul_dtype or dtype)
    row_max = torch.full((tokens,), float("-inf"), dtype=dtype, device=h.device)
    sum_exp = torch.zeros(tokens, dtype=dtype, device=h.device)
    target = torch.zeros(tokens, dtype=dtype, device=h.device)
    argmax = torch.zeros(tokens, dtype=torch.long, device=h.device)
    local_labels = labels - vocab_offset  # [T]; -100 and other shards' ids fall outside [0, rows)
    token_block, row_block = block_shape(tokens, rows, chunk_size)
    for v0, v1 in _blocks(rows, row_block):
        w = weight[v0:v1].to(matmul_dtype or dtype)  # [Cv, D]
        in_block = (local_labels >= v0) & (local_labels < v1)
        column = (local_labels - v0).clamp(0, v1 - v0 - 1)
        for t0, t1 in _blocks(tokens, token_block):
            t = slice(t0, t1)
            row_max[t], sum_exp[t], argmax[t], target[t] = block_statistics(
                h[t] @ w.T, row_max[t], sum_exp[t], argmax[t], target[t], column[t], in_block[t], v0 + vocab_offset,
                scale, softcap)  # a block of logits [Ct, Cv]
    return row_max, sum_exp, target, argmax


def loss_from_statistics(lse: Tensor, target: Tensor, labels: Tensor, vocab_size: int) -> Tensor:
    """``sum_{valid t} (lse_t - z_{t,y_t})``; NaN when a valid label is outside ``[0, vocab_size)``."""
    valid = labels != IGNORE_INDEX
    loss_sum = torch.where(valid, lse - target, 0.0).sum()
    out_of_range = valid & ((labels < 0) | (labels >= vocab_size))
    return torch.where(out_of_range.any(), float("nan"), loss_sum)


@torch.no_grad()
@full_precision
def local_gradients(grad_loss: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor,
                    chunk_size: int, vocab_offset: int = 0, matmul_dtype: torch.dtype | None = None,
                    scale: float = 1.0, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """``(grad_hidden [T, D] in the compute dtype, grad_weight [V_local, D] in weight's dtype)``.

    ``grad_hidden`` sums over these rows only (a partial sum under vocabulary parallelism).
    """
    dtype = compute_dtype(hidden, weight)
    mm = matmul_dtype or dtype  # the forward's matmul dtype: the same logits, recomputed
    tokens, rows = hidden.shape[0], weight.shape[0]
    h = hidden.to(mm)
    # [T]: g * [y != -100], times dz'/dz = s when there is no cap
    token_scale = grad_loss.to(dtype) * (labels != IGNORE_INDEX).to(dtype) * (scale if softcap is None else 1.0)
    local_labels = labels - vocab_offset
    grad_hidden = torch.zeros(tokens, h.shape[1], dtype=dtype, device=h.device)
    grad_weight = torch.empty_like(weight)
    in_place = grad_weight.dtype == dtype  # accumulate in the output's rows, no copy at the end
    token_block, row_block = block_shape(tokens, rows, chunk_size)
    for v0, v1 in _blocks(rows, row_block):
        w = weight[v0:v1].to(mm)  # [Cv, D]
        grad_w = grad_weight[v0:v1].zero_() if in_place else torch.zeros(w.shape, dtype=dtype, device=w.device)
        in_block = (local_labels >= v0) & (local_labels < v1)
        column = (local_labels - v0).clamp(0, v1 - v0 - 1)
        for t0, t1 in _blocks(tokens, token_block):
            dz = block_gradient(h[t0:t1] @ w.T, lse[t0:t1], token_scale[t0:t1], column[t0:t1], in_block[t0:t1], mm,
                                scale, softcap)  # [Ct, Cv] in the matmul dtype
            if mm == dtype:
                grad_hidden[t0:t1].addmm_(dz, w)  # [Ct, Cv] @ [Cv, D]
                grad_w.addmm_(dz.T, h[t0:t1])  # [Cv, Ct] @ [Ct, D]
            else:  # bf16 matmuls, accumulated in the compute dtype
                grad_hidden[t0:t1].add_(dz @ w)  # (``+=`` on a slice would copy the slice onto itself)
                grad_w.add_(dz.T @ h[t0:t1])
        if not in_place:
            grad_weight[v0:v1] = grad_w
    return grad_hidden, grad_weight


# ---------------------------------------------------------------- the single-process op


@torch.library.custom_op("hybridpar::lm_head_loss", mutates_args=())
def _lm_head_loss_op(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int,
                     matmul_dtype: torch.dtype | None = None, scale: float = 1.0, softcap: float | None = None
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss_sum, lse [T], argmax [T])`` of ``hidden [T, D]``, ``weight [V, D]``, ``labels [T]``."""
    check_label_values(labels, weight.shape[0])
    row_max, sum_exp, target, argmax = local_statistics(hidden, weight, labels, chunk_size, matmul_dtype=matmul_dtype,
                                                        scale=scale, softcap=softcap)
    lse = row_max + sum_exp.log()
    return loss_from_statistics(lse, target, labels, weight.shape[0]), lse, argmax


@_lm_head_loss_op.register_fake
def _(hidden, weight, labels, chunk_size, matmul_dtype=None, scale=1.0, softcap=None):
    dtype = compute_dtype(hidden, weight)
    tokens = hidden.shape[0]
    return hidden.new_empty((), dtype=dtype), hidden.new_empty((tokens,), dtype=dtype), labels.new_empty((tokens,))


@torch.library.custom_op("hybridpar::lm_head_loss_backward", mutates_args=())
def _lm_head_loss_backward_op(grad_loss: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor,
                              chunk_size: int, matmul_dtype: torch.dtype | None = None, scale: float = 1.0,
                              softcap: float | None = None) -> tuple[Tensor, Tensor]:
    grad_hidden, grad_weight = local_gradients(grad_loss, hidden, weight, labels, lse, chunk_size,
                                               matmul_dtype=matmul_dtype, scale=scale, softcap=softcap)
    return grad_hidden.to(hidden.dtype), grad_weight


@_lm_head_loss_backward_op.register_fake
def _(grad_loss, hidden, weight, labels, lse, chunk_size, matmul_dtype=None, scale=1.0, softcap=None):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, labels, chunk_size, matmul_dtype, scale, softcap = inputs
    ctx.save_for_backward(hidden, weight, labels, output[1])
    ctx.options = (chunk_size, matmul_dtype, scale, softcap)


def _backward(ctx, grad_loss, _grad_lse, _grad_argmax):
    hidden, weight, labels, lse = ctx.saved_tensors
    grad_hidden, grad_weight = torch.ops.hybridpar.lm_head_loss_backward(grad_loss, hidden, weight, labels, lse,
                                                                          *ctx.options)
    return grad_hidden, grad_weight, None, None, None, None, None


torch.library.register_autograd("hybridpar::lm_head_loss", _backward, setup_context=_setup_context)


def _reject_sharded(weight: Tensor) -> None:
    placements = getattr(weight, "placements", None)  # a DTensor, read by attribute: no distributed import
    if placements is not None and any(not p.is_replicate() for p in placements):
        raise ValueError(
            f"weight is a sharded DTensor (placements {tuple(placements)}); the single-process loss needs the whole "
            "LM head. Under tensor parallelism use hybridpar.train.loss.lm_head_loss(..., tp_group=...) (the "
            "HybridLM TP plan installs it); under FSDP compute the loss inside the root module's forward.")


def chunked_lm_head_loss(hidden: Tensor, weight: Tensor, labels: Tensor, *, chunk_size: int = 4096,
                         return_predictions: bool = False, scale: float = 1.0,
                         softcap: float | None = None) -> LMHeadLoss:
    """Single-process blockwise LM head + cross entropy (see the module docstring).

    ``hidden [..., D]``, ``weight [V, D]``, ``labels`` with hidden's leading shape (-100 ignored);
    the loss of the logits ``softcap * tanh(scale * z / softcap)`` (or ``scale * z`` without a cap).
    """
    _reject_sharded(weight)
    if getattr(weight, "placements", None) is not None:
        weight = weight.to_local()  # replicated DTensor: the whole weight on every rank
    chunk_size, scale, softcap = map(python_number, (chunk_size, scale, softcap))  # np.int64(2048) is 2048
    check_lm_head_inputs(hidden, weight, labels, chunk_size)
    check_logit_transform(scale, softcap)
    flat_labels = labels.reshape(-1).long()
    loss_sum, _, argmax = torch.ops.hybridpar.lm_head_loss(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                           flat_labels, chunk_size, autocast_matmul_dtype(hidden, weight),
                                                           float(scale), None if softcap is None else float(softcap))
    count = (flat_labels != IGNORE_INDEX).sum()
    return LMHeadLoss(loss_sum, count, argmax.view(labels.shape) if return_predictions else None)


class ChunkedLMHeadLoss:
    """``HybridLM.loss_core``, the seam tensor parallelism replaces: ``(hidden, weight, labels,
    return_predictions) -> LMHeadLoss``, here on one process."""

    def __init__(self, chunk_size: int = 4096):
        self.chunk_size = chunk_size

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, return_predictions: bool = False) -> LMHeadLoss:
        return chunked_lm_head_loss(hidden, weight, labels, chunk_size=self.chunk_size,
                                    return_predictions=return_predictions)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(chunk_size={self.chunk_size})"
