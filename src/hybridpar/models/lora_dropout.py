"""LoRA dropout whose mask is a function of the token, not of the process that holds it.

A layout-exact dropout must give the token at global row ``b``, position ``t`` the same mask on
one process as on the context-parallel rank, data-parallel rank or micro-batch that holds it.
A generator cannot: its stream follows the local tensor. So the keep decision of feature ``f``
of that token, in adapter ``l`` at step ``s``, is a hash (counter-based, like Philox)::

    key    = b * 2**32 + t                     (``DropoutTokens.keys``, [B, S] int64)
    salt_t, salt_f = mix(mix(seed, s), l)      (int64 scalar tensors: no recompile per step)
    h_t    = mix32(mix32(key mod 2**32) ^ (key >> 32)) ^ salt_t        [N] per token
    h_f    = mix32(f ^ salt_f)                                         [F] per feature
    keep   = mix32(h_t ^ h_f) >= round(p * 2**24) * 2**8;   dropout(x) = x * keep / (1 - p)

``mix32`` is MurmurHash3's 32-bit finalizer, computed in place in int64 without overflow (every
product below 2**49): 3-6x the time of ``F.dropout`` on one CPU thread; on CUDA it is compiled
into one kernel. Masks are drawn in token chunks, so the int64 temporaries stay bounded at any
sequence length. The trainer sets the keys of every micro-batch (``set_dropout_tokens``);
activation checkpointing recomputes the same masks (no generator state to restore). Without
keys (a model used outside the trainer) the salt comes from the default generator and the
keys are the row-major index of the input's tokens: ordinary, but not layout-exact, dropout.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

__all__ = ["DropoutTokens", "LoRADropout", "keep_mask", "set_dropout_tokens", "token_keys"]

M32 = 0xFFFFFFFF
UNIT = 1 << 24  # the keep test's resolution
CHUNK_ELEMENTS = 1 << 22  # int64 temporaries per chunk: 32 MiB each


def _mul32_(h: Tensor, c: int) -> Tensor:
    """``h = (h * c) mod 2**32`` in place, for ``h`` in [0, 2**32): ``c``'s two 16-bit halves, no overflow."""
    high = h * (c >> 16)
    high.bitwise_and_(0xFFFF).mul_(65536)
    return h.mul_(c & 0xFFFF).add_(high).bitwise_and_(M32)


def mix32_(h: Tensor) -> Tensor:
    """MurmurHash3's finalizer, in place, on an int64 tensor holding values in [0, 2**32)."""
    h.bitwise_xor_(h >> 16)
    _mul32_(h, 0x85EBCA6B)
    h.bitwise_xor_(h >> 13)
    _mul32_(h, 0xC2B2AE35)
    return h.bitwise_xor_(h >> 16)


def mix32(h: Tensor) -> Tensor:
    """``mix32_`` on a copy."""
    return mix32_(h.clone())


def _mix_int(value: int) -> int:
    return int(mix32(torch.tensor([value & M32], dtype=torch.int64))[0])


def step_salt(seed: int, step: int) -> Tensor:
    """A 32-bit int64 scalar of (seed, step); a tensor, so a compiled block does not recompile per step."""
    h = _mix_int(seed & M32) ^ ((seed >> 32) & M32)
    return torch.tensor(_mix_int(h ^ _mix_int(step & M32)), dtype=torch.int64)


def _salts(salt: Tensor, layer: int) -> tuple[Tensor, Tensor]:
    """Two 32-bit salts of (seed, step, adapter): one for the tokens, one for the features."""
    h = mix32(salt ^ _mix_int((layer ^ 0x9E3779B9) & M32))
    return h, mix32(h ^ 0x7F4A7C15)


def keep_mask(keys: Tensor, features: int, feature_offset: int, p: float, salts: tuple[Tensor, Tensor],
              dtype: torch.dtype, chunked: bool = True) -> Tensor:
    """``keep / (1 - p)`` of shape ``[*keys.shape, features]`` for features ``offset..offset+features``;
    ``chunked=False`` (compiled: one fused kernel, no temporaries) hashes all tokens at once."""
    token_salt, feature_salt = (salt.to(keys.device) for salt in salts)
    f = torch.arange(feature_offset, feature_offset + features, dtype=torch.int64, device=keys.device)
    f = mix32_(f ^ feature_salt)  # [F]
    flat = keys.reshape(-1).to(torch.int64)
    t = mix32_(mix32(flat & M32) ^ ((flat >> 32) & M32)) ^ token_salt  # [N]
    threshold = round(p * UNIT) << 8  # keep when the top 24 bits of the 32-bit hash are >= p * 2**24
    out = torch.empty(flat.numel(), features, dtype=dtype, device=keys.device)
    rows = max(1, CHUNK_ELEMENTS // max(1, features)) if chunked else max(1, flat.numel())
    for start in range(0, flat.numel(), rows):
        out[start:start + rows] = mix32_(t[start:start + rows, None] ^ f[None, :]) >= threshold  # [n, F]
    return out.mul_(1 / (1 - p)).reshape(*keys.shape, features)


_compiled = None


def _fused_keep_mask(*args) -> Tensor:
    """``keep_mask`` compiled into one kernel; eager (chunked) if compiling fails, said once."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(partial(keep_mask, chunked=False), dynamic=True)
    try:
        return _compiled(*args)
    except Exception as error:  # noqa: BLE001 - an inductor/triton failure: the same bits, eager
        if _compiled is keep_mask:
            raise
        warnings.warn(f"LoRA dropout masks run eager: compiling them failed ({type(error).__name__}: "
                      f"{str(error)[:200]})", stacklevel=2)
        _compiled = keep_mask
        return keep_mask(*args)


def _masks_for(x: Tensor):
    """The mask function for ``x``'s device: on CUDA compiled into one kernel (eager, it is about 25
    int64 passes over the input); elsewhere eager, in chunks."""
    return _fused_keep_mask if x.device.type == "cuda" else keep_mask


def token_keys(rows: Tensor, positions: Tensor) -> Tensor:
    """``[B, S]`` keys of rows ``rows [B]`` (global row ids) at global positions ``positions [S]``."""
    return rows.to(torch.int64)[:, None] * (1 << 32) + positions.to(torch.int64)[None, :]


@dataclass
class DropoutTokens:
    """What the current micro-batch's masks are keyed by; one object shared by a model's adapters."""

    seed: int = 0
    step: int = 0
    keys: Tensor | None = None  # [B, S] int64, the global tokens of the model's input rows
    salt: Tensor | None = None  # step_salt(seed, step), set with the keys


class LoRADropout(nn.Module):
    """Dropout on adapter ``layer``'s input ``x [..., in]`` with token-keyed masks (module docstring)."""

    def __init__(self, p: float, layer: int, tokens: DropoutTokens, where: str = "a module"):
        super().__init__()
        self.p, self.layer, self.tokens, self.where = p, layer, tokens, where

    def _keys_for(self, leading: tuple[int, ...]) -> tuple[Tensor, tuple[int, int]]:
        """The keys of an input whose global leading shape is ``leading``, and the salts."""
        tokens = self.tokens
        if tokens.keys is None:  # outside the trainer: row-major token index, a salt from the default generator
            keys = torch.arange(math.prod(leading), dtype=torch.int64).reshape(leading)
            return keys, _salts(torch.randint(0, 2**32, (), dtype=torch.int64), self.layer)
        keys = tokens.keys
        if keys.numel() != math.prod(leading):
            raise ValueError(f"peft.dropout: the adapter on {self.where} sees an input of {tuple(leading)} tokens, not the "
                             f"{tuple(keys.shape)} tokens of the batch its masks are keyed by (a module fed a subset of "
                             "the tokens, e.g. an expert); set peft.dropout=0 or leave this module out of "
                             "peft.target_modules.")
        return keys.reshape(leading), _salts(tokens.salt, self.layer)

    def masked(self, x: Tensor, global_shape: tuple[int, ...], offset: tuple[int, ...]) -> Tensor:
        """``x`` (the block of a ``global_shape`` input starting at ``offset``) times its mask."""
        keys, salts = self._keys_for(tuple(global_shape[:-1]))
        block = keys[tuple(slice(o, o + n) for o, n in zip(offset[:-1], x.shape[:-1]))].to(x.device)
        return x * _masks_for(x)(block, x.shape[-1], offset[-1], self.p, salts, x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        return self.masked(x, tuple(x.shape), (0,) * x.dim())

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}"


def set_dropout_tokens(model: nn.Module, step: int, keys: Tensor | None) -> None:
    """Key the masks of ``model``'s adapters by ``keys`` ([B, S] global tokens of the next input) at
    ``step``; no-op for a model without LoRA dropout. ``None`` returns to generator-drawn salts."""
    tokens = getattr(model, "lora_dropout_tokens", None)
    if tokens is not None:
        tokens.step, tokens.keys, tokens.salt = int(step), keys, step_salt(tokens.seed, int(step))
