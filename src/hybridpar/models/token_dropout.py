"""Dropout whose mask is a function of the token, not of the process that holds it (LoRA's, and
the hidden-state dropout of a transformers checkpoint).

A layout-exact dropout must give the token at global row ``b``, position ``t`` the same mask on
one process as on the context-parallel rank, data-parallel rank or micro-batch that holds it.
A generator cannot: its stream follows the local tensor. So the keep decision of feature ``f``
of that token, in dropout module ``l`` at step ``s``, is a hash (counter-based, like Philox)::

    key    = b * 2**32 + t                     (``DropoutTokens.keys``, [B, S] int64)
    salt_t, salt_f = mix(mix(seed, s), l)      (int64 scalar tensors: no recompile per step)
    h_t    = mix32(mix32(key mod 2**32) ^ (key >> 32)) ^ salt_t        [N] per token
    h_f    = mix32(f ^ salt_f)                                         [F] per feature
    keep   = mix32(h_t ^ h_f) >= round(p * 2**24) * 2**8;   dropout(x) = x * keep / (1 - p)

``mix32`` is MurmurHash3's 32-bit finalizer: per token and per feature in int64 without overflow
(every product below 2**49), per (token, feature) in int32, whose multiply wraps mod 2**32 itself
(the same bits); on CUDA the mask is compiled into one kernel. Masks are drawn in token chunks, so the int64 temporaries stay bounded at any
sequence length. The trainer sets the keys of every micro-batch (``set_dropout_tokens``);
activation checkpointing recomputes the same masks (no generator state to restore). Without
keys (a model used outside the trainer) the salt comes from the default generator and the
keys are the row-major index of the input's tokens: ordinary, but not layout-exact, dropout.
"""

from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

__all__ = ["DropoutTokens", "TokenDropout", "dropout_tokens", "keep_mask", "key_model_dropout", "set_dropout_tokens",
           "token_keys", "unkeyed_dropout"]

M32 = 0xFFFFFFFF
UNIT = 1 << 24  # the keep test's resolution
CHUNK_ELEMENTS = 1 << 22  # int32 temporaries per chunk: 16 MiB each


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


def _signed32(value: int) -> int:
    """The int32 holding the 32 bits of ``value`` in [0, 2**32)."""
    return value - (1 << 32) if value >= 1 << 31 else value


def mix32_int32_(h: Tensor) -> Tensor:
    """``mix32_`` on an int32 tensor holding the 32 bits (two's complement): a multiply wraps mod 2**32
    by itself, and a logical right shift is the arithmetic one masked; half the bytes and a third of
    the passes of the int64 form (equal bits: ``tests/models/test_token_dropout.py``)."""
    h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))
    h.mul_(_signed32(0x85EBCA6B))
    h.bitwise_xor_((h >> 13).bitwise_and_(0x7FFFF))
    h.mul_(_signed32(0xC2B2AE35))
    return h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))


def _mix_int(value: int) -> int:
    return int(mix32(torch.tensor([value & M32], dtype=torch.int64))[0])


def step_salt(seed: int, step: int) -> Tensor:
    """A 32-bit int64 scalar of (seed, step); a tensor, so a compiled block does not recompile per step."""
    h = _mix_int(seed & M32) ^ ((seed >> 32) & M32)
    return torch.tensor(_mix_int(h ^ _mix_int(step & M32)), dtype=torch.int64)


def _salts(salt: Tensor, module_hash: Tensor) -> tuple[Tensor, Tensor]:
    """Two 32-bit salts of (seed, step, module): one for the tokens, one for the features."""
    h = mix32(salt ^ module_hash.to(salt.device))
    return h, mix32(h ^ 0x7F4A7C15)


def keep_mask(keys: Tensor, features: int, feature_offset: int, p: float, salts: tuple[Tensor, Tensor],
              dtype: torch.dtype, chunked: bool = True) -> Tensor:
    """``keep / (1 - p)`` of shape ``[*keys.shape, features]`` for features ``offset..offset+features``;
    ``chunked=False`` (compiled: one fused kernel, no temporaries) hashes all tokens at once."""
    token_salt, feature_salt = (salt.to(keys.device) for salt in salts)
    f = torch.arange(feature_offset, feature_offset + features, dtype=torch.int64, device=keys.device)
    f = _as_int32(mix32_(f ^ feature_salt))  # [F]
    flat = keys.reshape(-1).to(torch.int64)
    t = _as_int32(mix32_(mix32(flat & M32) ^ ((flat >> 32) & M32)) ^ token_salt)  # [N]
    # keep when the top 24 bits of the 32-bit hash are >= p * 2**24: an unsigned compare, done signed
    # on the bits with the top one flipped
    threshold = _signed32((round(p * UNIT) << 8) ^ (1 << 31))
    out = torch.empty(flat.numel(), features, dtype=dtype, device=keys.device)
    rows = max(1, CHUNK_ELEMENTS // max(1, features)) if chunked else max(1, flat.numel())
    for start in range(0, flat.numel(), rows):
        h = mix32_int32_(t[start:start + rows, None] ^ f[None, :])  # [n, F] int32
        out[start:start + rows] = h.bitwise_xor_(-(1 << 31)) >= threshold
    return out.mul_(1 / (1 - p)).reshape(*keys.shape, features)


def _as_int32(h: Tensor) -> Tensor:
    """An int64 tensor of values in [0, 2**32) as the int32 tensor of the same bits."""
    return (h - ((h >> 31) << 32)).to(torch.int32)


_compiled = None


def _fused_keep_mask(*args) -> Tensor:
    """``keep_mask`` compiled into one kernel; eager (chunked) if compiling fails, said once."""
    global _compiled
    if torch.compiler.is_compiling():  # inside a compiled block: its compile fuses the hash
        return keep_mask(*args, chunked=False)
    if _compiled is None:
        _compiled = torch.compile(partial(keep_mask, chunked=False), dynamic=True)
    try:
        return _compiled(*args)
    except Exception as error:  # noqa: BLE001 - an inductor/triton failure: the same bits, eager
        if _compiled is keep_mask:
            raise
        warnings.warn(f"dropout masks run eager: compiling them failed ({type(error).__name__}: "
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
    """What the current micro-batch's masks are keyed by; one object shared by a model's dropouts."""

    seed: int = 0
    step: int = 0
    keys: Tensor | None = None  # [B, S] int64, the global tokens of the model's input rows
    salt: Tensor | None = None  # step_salt(seed, step), set with the keys


def dropout_tokens(model: nn.Module, seed: int = 0) -> DropoutTokens:
    """``model``'s ``DropoutTokens``, created (with ``seed``) on first use."""
    tokens = getattr(model, "dropout_tokens", None)
    if tokens is None:
        tokens = model.dropout_tokens = DropoutTokens(seed=seed)
    return tokens


class TokenDropout(nn.Module):
    """Dropout of ``x [..., F]`` with token-keyed masks (module docstring). ``name``: the module's
    name in its model, whose CRC-32 makes its masks its own on every layout; ``fix``: what the user
    can do when its input does not hold one row per token."""

    def __init__(self, p: float, name: str, tokens: DropoutTokens, fix: str = "set its probability to 0"):
        super().__init__()
        self.p, self.name, self.tokens, self.fix = p, name, tokens, fix
        # a tensor, not an int attribute: blocks of one kind share a compiled graph instead of one each
        self.register_buffer("module_hash", torch.tensor(_mix_int(zlib.crc32(name.encode()) ^ 0x9E3779B9)),
                             persistent=False)

    def _keys_for(self, leading: tuple[int, ...]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """The keys of an input whose global leading shape is ``leading``, and the salts."""
        tokens = self.tokens
        if tokens.keys is None:  # outside the trainer: row-major token index, a salt from the default generator
            keys = torch.arange(math.prod(leading), dtype=torch.int64).reshape(leading)
            return keys, _salts(torch.randint(0, 2**32, (), dtype=torch.int64), self.module_hash)
        keys = tokens.keys
        if keys.numel() != math.prod(leading):
            raise ValueError(f"dropout {self.name} (p={self.p}) sees an input of {tuple(leading)} tokens, not the "
                             f"{tuple(keys.shape)} tokens of the batch its masks are keyed by (a module fed a subset of "
                             f"the tokens, e.g. an expert, or attention probabilities); {self.fix}.")
        return keys.reshape(leading), _salts(tokens.salt, self.module_hash)

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
        return f"p={self.p}"


ATTENTION_WORDS = ("attn", "attention")  # nn.Dropout modules of these names drop attention probabilities


def key_model_dropout(model: nn.Module, seed: int = 0) -> list[str]:
    """Replace every ``nn.Dropout`` (p > 0) of ``model`` that drops hidden states (embedding, residual,
    MLP outputs: one row per token) by a ``TokenDropout``; returns their names. Attention-probability
    dropouts (``[B, H, S, S]``, or a probability handed to SDPA) stay: ``unkeyed_dropout`` names them."""
    names = [name for name, m in model.named_modules() if type(m) is nn.Dropout and m.p > 0
             and not any(word in name.rsplit(".", 1)[-1] for word in ATTENTION_WORDS)]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, TokenDropout(owner.get_submodule(leaf).p, name, dropout_tokens(model, seed),
                                          fix="set its dropout to 0.0 in the checkpoint's config.json"))
    return names


ATTENTION_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
RANDOM_FIELD_WORDS = ("dropout", "pdrop", "jitter")  # config fields of the random numbers a model draws in training


def random_fields(values: dict, prefix: str = "") -> dict[str, float]:
    """``{field: value}`` of a transformers config's fields (``vars(config)``, or config.json with its nested
    configs) that draw random numbers in training: a dropout, ``*_pdrop`` or router jitter above 0
    (``classifier_dropout`` aside: no causal LM uses it)."""
    found = {}
    for key, value in values.items():
        if isinstance(value, dict):
            found.update(random_fields(value, f"{prefix}{key}."))
        elif (any(w in str(key) for w in RANDOM_FIELD_WORDS) and key != "classifier_dropout"
              and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            found[prefix + str(key)] = value
    return found


def unkeyed_dropout(config) -> dict[str, float]:
    """The attention-probability dropout of a transformers ``config``: ``{field: p}`` for p > 0. Its
    masks cover (query, key) pairs inside the attention kernel, so no token key reaches them."""
    found = {}
    for field in ATTENTION_DROPOUT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found[field] = float(value)
    return found


def set_dropout_tokens(model: nn.Module, step: int, keys: Tensor | None) -> None:
    """Key the masks of ``model``'s dropouts by ``keys`` ([B, S] global tokens of the next input) at
    ``step``; no-op for a model without keyed dropout. ``None`` returns to generator-drawn salts."""
    tokens = getattr(model, "dropout_tokens", None)
    if tokens is not None:
        salt = step_salt(tokens.seed, int(step))
        tokens.step, tokens.keys, tokens.salt = int(step), keys, salt if keys is None else salt.to(keys.device)
