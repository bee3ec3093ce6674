"""Cached autoregressive generation for ``HybridLM``: the prompt once, then one token at a time.

What each layer keeps between steps (``GenerationCache.layers[i]``):

    Mamba2     conv [B, C, K-1]      the last K-1 inputs of the convolution (xBC before the
                                     conv, oldest first; zeros before the prompt), C = H*P + 2*G*N
               ssm  [B, H, P, N]     the state after the last token
    attention  k, v [B, S, Hkv, Dh]  keys (after RoPE) and values of every token so far
    MLP        nothing

Prompt (``prefill``): one forward pass over the ``[B, S]`` prompt. Mamba layers run the
causal conv and the chunked scan once (``mamba_conv_scan`` with the state after each row's
last token, the training core) and keep the conv tail; attention layers run their own core and keep K/V.

Step (``decode_step``), one token per row. A Mamba head ``h`` of group ``g`` computes

    xBC   = silu(bias + sum_j w[:, j] * window_j)      window = [conv state, new input]
    dt    = softplus(dt_raw + dt_bias)                 (clamped to time_step_limit if set)
    state = exp(dt * A) * state + dt * x ⊗ B_g          A = -exp(A_log)
    y     = state · C_g + D * x

then the gated norm and ``out_proj`` as in ``Mamba2Mixer.forward``. An attention layer
rotates q and k at position ``S`` (tokens so far), appends k and v, and lets the one query
attend to every cached key. Logits therefore equal those of the full forward on the growing
sequence (tested in float64 to 1e-10).

Sampling: ``temperature == 0`` is greedy (argmax); otherwise softmax(logits / T) restricted
to the smallest set of tokens whose probability reaches ``top_p`` (nucleus), drawn with a
generator seeded by ``seed``.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.config_rules import quoted
from hybridpar.models.arguments import end_token_ids, python_number
from hybridpar.models.attention.rotary import apply_rotary, rotary_cos_sin
from hybridpar.models.mamba.core import mamba_conv_scan

__all__ = ["GenerationCache", "prefill", "decode_step", "sample_next", "check_sampling", "generate",
           "generation_bytes", "transformers_generation_bytes",
           "check_generation_memory"]


@dataclass
class GenerationCache:
    """Per-layer state after ``length`` tokens (see the module docstring for the tensors)."""

    layers: list[dict[str, Tensor]] = field(default_factory=list)
    length: int = 0


# ----------------------------------------------------------------------------- Mamba2


def _conv_weight(mixer: nn.Module) -> tuple[Tensor, Tensor | None]:
    """Depthwise conv weight ``[C, K]`` and bias ``[C]`` of a mixer's ``conv1d``."""
    return mixer.conv1d.weight[:, 0], mixer.conv1d.bias


def _split_xBC(mixer: nn.Module, xBC: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``[B, L, C]`` -> x ``[B, L, H, P]``, B and C ``[B, L, G, N]``."""
    d_inner, state = mixer.num_heads * mixer.head_dim, mixer.ssm_state_size
    groups = (xBC.shape[-1] - d_inner) // (2 * state)
    x, B, C = torch.split(xBC, [d_inner, groups * state, groups * state], dim=-1)
    return (x.unflatten(-1, (mixer.num_heads, mixer.head_dim)), B.unflatten(-1, (groups, state)),
            C.unflatten(-1, (groups, state)))


def _mamba_prefill(mixer: nn.Module, hidden: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Mixer output ``[B, S, D]`` of the prompt and the layer's cache: the training core
    (``mamba_conv_scan``) with the state read after each row's last token."""
    z, xBC, dt = torch.split(mixer.in_proj(hidden), mixer.split_sizes(mixer.in_proj.out_features), dim=-1)
    batch, seq_len, _ = xBC.shape
    weight, bias = _conv_weight(mixer)
    width = weight.shape[1]
    history = F.pad(xBC.transpose(1, 2), (width - 1, 0))  # [B, C, K-1+S], zeros before the prompt
    conv_state = history[:, :, history.shape[-1] - (width - 1):].clone()  # [B, C, K-1]
    last_tokens = torch.arange(1, batch + 1, device=xBC.device) * seq_len - 1  # row-major stream positions
    y, ssm_state = mamba_conv_scan(
        xBC, dt, weight, bias, mixer.dt_bias, mixer.A_log, mixer.D, head_dim=mixer.head_dim,
        state_size=mixer.ssm_state_size, chunk_size=mixer.chunk_size, dt_limit=mixer.time_step_limit,
        final_at=last_tokens,
    )  # [B, S, H*P], [B, H, P, N]
    out = mixer.out_proj(mixer.norm(y, z))
    return out, {"conv": conv_state, "ssm": ssm_state}


def _mamba_step(mixer: nn.Module, hidden: Tensor, cache: dict[str, Tensor]) -> Tensor:
    """Mixer output ``[B, 1, D]`` of one new token; updates ``cache`` in place."""
    z, xBC, dt = torch.split(mixer.in_proj(hidden), mixer.split_sizes(mixer.in_proj.out_features), dim=-1)
    weight, bias = _conv_weight(mixer)
    window = torch.cat([cache["conv"], xBC.transpose(1, 2)], dim=-1)  # [B, C, K]
    cache["conv"] = window[:, :, 1:]
    xBC = (window * weight).sum(-1) + (0 if bias is None else bias)  # [B, C]
    x, B, C = _split_xBC(mixer, F.silu(xBC)[:, None])  # [B, 1, H, P], [B, 1, G, N] x2
    state = cache["ssm"]
    dtype = state.dtype  # the core's compute dtype: the input's, at least float32
    heads_per_group = mixer.num_heads // B.shape[2]
    x, B, C = x[:, 0].to(dtype), B[:, 0].to(dtype), C[:, 0].to(dtype)  # [B, H, P], [B, G, N] x2
    B, C = B.repeat_interleave(heads_per_group, dim=1), C.repeat_interleave(heads_per_group, dim=1)  # [B, H, N]
    dt = F.softplus(dt[:, 0].to(dtype) + mixer.dt_bias.to(dtype))  # [B, H]
    low, high = mixer.time_step_limit
    if (low, high) != (0.0, float("inf")):
        dt = dt.clamp(min=low, max=high)
    decay = torch.exp(dt * -torch.exp(mixer.A_log.to(dtype)))  # [B, H]
    state = decay[..., None, None] * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]  # [B, H, P, N]
    cache["ssm"] = state
    y = torch.einsum("bhpn,bhn->bhp", state, C) + mixer.D.to(dtype)[:, None] * x  # [B, H, P]
    return mixer.out_proj(mixer.norm(y.flatten(1)[:, None].to(hidden.dtype), z))


# ----------------------------------------------------------------------------- attention


def _qkv(mixer: nn.Module, hidden: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
    """q ``[B, S, Hq, Dh]``, k, v ``[B, S, Hkv, Dh]`` of tokens at positions ``start, start+1, ...``."""
    batch, seq_len, _ = hidden.shape
    q, k, v = (proj(hidden).unflatten(-1, (-1, mixer.head_dim)) for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
    if mixer.rotary_dim > 0:
        positions = torch.arange(start, start + seq_len, device=hidden.device).expand(batch, -1)  # [B, S]
        cos, sin = rotary_cos_sin(positions, mixer.rotary_dim, mixer.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return q, k, v


def _attention_prefill(mixer: nn.Module, hidden: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    q, k, v = _qkv(mixer, hidden, 0)
    out = mixer.core(q, k, v, None)  # [B, S, Hq, Dh], the model's own causal core
    return mixer.o_proj(out.flatten(2)), {"k": k, "v": v}


def _attention_step(mixer: nn.Module, hidden: Tensor, cache: dict[str, Tensor], position: int) -> Tensor:
    q, k, v = _qkv(mixer, hidden, position)
    cache["k"], cache["v"] = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)  # [B, S+1, Hkv, Dh]
    repeat = q.shape[2] // k.shape[2]
    keys, values = (t.repeat_interleave(repeat, dim=2).transpose(1, 2) for t in (cache["k"], cache["v"]))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values)  # one query sees every cached key
    return mixer.o_proj(out.transpose(1, 2).flatten(2))


# ----------------------------------------------------------------------------- the model


def check_prompt_ids(input_ids: Tensor, vocab: int) -> None:
    """ValueError (one line) unless ``input_ids`` is an integer tensor ``[B, S]`` of ids in ``[0, vocab)``."""
    if not isinstance(input_ids, Tensor):  # a list was "'list' object has no attribute 'dim'"
        raise ValueError(f"input_ids is a {type(input_ids).__name__}, not a torch.Tensor; pass torch.tensor([ids]).")
    if input_ids.dim() != 2 or input_ids.shape[1] < 1 or input_ids.is_floating_point():
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}; expected "
                         "integer [B, S] with S >= 1 (use ids[None] for one prompt).")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids hold ids in [{int(input_ids.min())}, {int(input_ids.max())}], outside the "
                         f"model's vocabulary [0, {vocab}); encode with the model's tokenizer.")


@torch.no_grad()
def prefill(model: nn.Module, input_ids: Tensor, last_only: bool = False) -> tuple[Tensor, GenerationCache]:
    """Logits ``[B, S, V]`` of the prompt ``[B, S]`` (``last_only``: ``[B, 1, V]``, no ``[S, V]``) and the cache."""
    check_prompt_ids(input_ids, model.config.vocab_size)
    cache = GenerationCache(length=input_ids.shape[1])
    hidden = model.backbone.embeddings(input_ids)
    for layer in model.backbone.layers:
        normed = layer.norm(hidden)
        if layer.kind == "mamba":
            out, state = _mamba_prefill(layer.mixer, normed)
        elif layer.kind == "attention":
            out, state = _attention_prefill(layer.mixer, normed)
        else:
            out, state = layer.mixer(normed), {}
        cache.layers.append(state)
        hidden = hidden + out
    return model.lm_head(model.backbone.norm_f(hidden[:, -1:] if last_only else hidden)), cache


@torch.no_grad()
def decode_step(model: nn.Module, token_ids: Tensor, cache: GenerationCache) -> Tensor:
    """Logits ``[B, 1, V]`` of one new token per row ``[B, 1]``; advances ``cache`` by one."""
    check_prompt_ids(token_ids, model.config.vocab_size)
    if token_ids.shape[1] != 1:
        raise ValueError(f"decode_step takes one token per row, got shape {tuple(token_ids.shape)}; run prefill "
                         "for a longer prompt.")
    hidden = model.backbone.embeddings(token_ids)
    for layer, state in zip(model.backbone.layers, cache.layers, strict=True):
        normed = layer.norm(hidden)
        if layer.kind == "mamba":
            out = _mamba_step(layer.mixer, normed, state)
        elif layer.kind == "attention":
            out = _attention_step(layer.mixer, normed, state, cache.length)
        else:
            out = layer.mixer(normed)
        hidden = hidden + out
    cache.length += 1
    return model.lm_head(model.backbone.norm_f(hidden))


GREEDY_BELOW = 1e-5  # a temperature below this is greedy: exp(-gap / T) underflows for any visible logit gap
MAX_NEW_TOKENS = 2**31 - 1
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed's range (negative seeds are refused here)


def sample_next(logits: Tensor, temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> Tensor:
    """Next token ``[B]`` from last-position logits ``[B, V]``: argmax at temperature 0 (and below
    ``GREEDY_BELOW``), else nucleus sampling. The logits are shifted by their maximum and scaled in
    float64, so no finite temperature overflows them."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    shifted = logits.double() - logits.double().amax(dim=-1, keepdim=True)  # <= 0, the top token at 0
    probs = torch.softmax(shifted / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)  # the top token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def check_sampling(max_new_tokens, temperature, top_p, seed=None) -> None:
    """ValueError (one line) for a token count outside [0, 2**31-1], a temperature that is not a
    finite number >= 0, top_p outside (0, 1], or a seed outside [0, 2**64-1]."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    rules = [
        (isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and 0 <= max_new_tokens <= MAX_NEW_TOKENS,
         f"max_new_tokens={quoted(max_new_tokens)} must be an integer in [0, 2**31-1]"),
        (number(temperature) and temperature >= 0,
         f"temperature={quoted(temperature)} must be a finite number >= 0 (0 is greedy, as is anything below {GREEDY_BELOW:g})"),
        (number(top_p) and 0 < top_p <= 1, f"top_p={quoted(top_p)} must be in (0, 1] (1 keeps every token)"),
        (seed is None or (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= SEED_MAX),
         f"seed={quoted(seed)} must be an integer in [0, 2**64-1]"),
    ]
    for holds, message in rules:
        if not holds:
            raise ValueError(f"{message}; change it in the generate call.")


@torch.no_grad()
def generate(model: nn.Module, input_ids: Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, eos_token_id: int | list[int] | None = None) -> Tensor:
    """Prompt ``[B, S]`` followed by up to ``max_new_tokens`` generated tokens, ``[B, S + n]``.

    Stops early once every row has produced an ``eos_token_id`` (one id or a list); a row that
    finished first is filled with its end token. ``seed`` makes sampling reproducible.
    """
    max_new_tokens, temperature, top_p, seed = map(python_number, (max_new_tokens, temperature, top_p, seed))
    check_sampling(max_new_tokens, temperature, top_p, seed)
    check_prompt_ids(input_ids, model.config.vocab_size)
    eos = end_token_ids(eos_token_id, model.config.vocab_size)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    if max_new_tokens == 0:
        return input_ids
    tokens = [input_ids]
    logits, cache = prefill(model, input_ids, last_only=True)  # the last position's logits only: [B, 1, V]
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    filler = torch.full_like(finished, eos[0] if eos else 0, dtype=input_ids.dtype)
    for step in range(max_new_tokens):
        next_ids = sample_next(logits[:, -1], temperature, top_p, generator)
        next_ids = torch.where(finished, filler, next_ids.to(input_ids.dtype))  # [B]
        tokens.append(next_ids[:, None])
        if eos:
            finished |= torch.isin(next_ids, torch.tensor(eos, device=next_ids.device))
            if bool(finished.all()):
                break
        if step + 1 < max_new_tokens:
            logits = decode_step(model, next_ids[:, None], cache)
    return torch.cat(tokens, dim=1)


def generation_bytes(model: nn.Module, batch: int, prompt: int, new_tokens: int) -> int:
    """A lower estimate of the bytes ``generate`` allocates beyond the weights, for ``batch`` rows of a
    ``prompt``-token prompt and ``new_tokens`` more: the last position's logits ``[B, V]`` (and their
    float32 copy to sample), the largest layer's prefill activations (Mamba's in_proj output and
    the scan's chunk states ``[B, S/Q, H, P, N]`` in float32; attention's q, k, v), every
    attention layer's K/V cache at full length ``[B, S+n, Hkv, Dh]`` x2 (and the repeated keys
    of one step), and the token ids ``[B, S+n]``."""
    c = model.config
    size = torch.finfo(c.dtype).bits // 8 if c.dtype.is_floating_point else 4
    total = prompt + new_tokens
    logits = batch * c.vocab_size * (size + 4)
    kinds = [layer.kind for layer in model.backbone.layers]
    layer_peak = 0
    if "mamba" in kinds:
        mixer = next(layer.mixer for layer in model.backbone.layers if layer.kind == "mamba")
        chunks = -(-prompt // max(1, c.chunk_size))
        states = batch * chunks * c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size * 4
        layer_peak = max(layer_peak, batch * prompt * mixer.in_proj.out_features * size * 2 + states)
    if "attention" in kinds:
        qkv = batch * prompt * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * size
        layer_peak = max(layer_peak, 2 * qkv)
    kv = kinds.count("attention") * 2 * batch * total * c.num_key_value_heads * c.head_dim * size
    repeated = (2 * batch * total * c.num_attention_heads * c.head_dim * size) if "attention" in kinds else 0
    per_token = 512 * new_tokens  # a Python tensor object per generated step, kept until the final cat
    return logits + layer_peak + kv + repeated + 2 * batch * total * 8 + per_token


RECURRENT_NAMES = ("Delta", "Linear")  # k_proj/v_proj of a constant-size state: no K/V cache


def _cached_tokens(module: nn.Module, config, total: int) -> int:
    """Tokens an attention module's K/V cache keeps: at most its window for a sliding layer of a config whose
    ``layer_types`` name it (transformers' ``DynamicCache(config)``; RecurrentGemma's local MQA), else all."""
    window = getattr(module, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    return min(total, window) if sliding and isinstance(window, int) and window > 0 else total


def transformers_generation_bytes(model: nn.Module, batch: int, prompt: int, new_tokens: int) -> int:
    """A lower estimate for a transformers model's ``generate``: the K/V cache ``[B, S+n, k/v_proj
    out]`` of every attention module the model has (read from its ``k_proj``/``v_proj`` layers, so a
    hybrid's Mamba, linear-attention or convolution layers add none: Bamba's, NemotronH's and
    Qwen3-Next's attention layers are counted, not all layers alike; a sliding layer's up to its window
    (``_cached_tokens``); a plain decoder with a fused projection, GPT-2's ``c_attn``: every layer's K/V from
    its config), the recurrent and conv states ``[B, Cd]`` (float32) and ``[B, Cd, K-1]`` of every RG-LRU
    block (RecurrentGemma, which counted neither before), the widest linear layer's
    prefill output (x2: its input lives too), the last position's logits and the token ids; plus a
    Python object per step."""
    c = getattr(model, "config", None)
    size = torch.finfo(model.dtype).bits // 8 if getattr(model, "dtype", torch.float32).is_floating_point else 4
    total = prompt + new_tokens
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kv, widest = 0, 0
    for module in model.modules():
        k, v = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        name = type(module).__name__
        if isinstance(k, nn.Linear) and isinstance(v, nn.Linear) and not any(r in name for r in RECURRENT_NAMES):
            kv += batch * _cached_tokens(module, c, total) * (k.out_features + v.out_features) * size
        conv = getattr(module, "conv_1d", None)
        if isinstance(getattr(module, "rg_lru", None), nn.Module) and isinstance(conv, nn.Conv1d):
            kv += batch * conv.in_channels * (4 + (conv.kernel_size[0] - 1) * size)  # RG-LRU and conv states
        mla = getattr(module, "kv_b_proj", None)  # multi-head latent attention (DeepSeek-V2/V3, Kimi Linear's full
        if isinstance(mla, nn.Linear):  # layers): its cache holds per-head K (nope + rope dims) and V, [B, H, S, .]
            rope = (getattr(c, "num_attention_heads", 0) or 0) * (getattr(c, "qk_rope_head_dim", 0) or 0)
            kv += batch * total * (mla.out_features + rope) * size
        if isinstance(module, nn.Linear) and module is not head:
            widest = max(widest, module.out_features)
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None)
    hybrid = any(getattr(c, f, None) for f in ("attn_layer_indices", "layers_block_type", "layer_types",
                                                "hybrid_override_pattern", "layers_block_types"))
    layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None)
    if not kv and not hybrid and isinstance(heads, int) and heads > 0 and isinstance(layers, int):  # fused qkv (GPT-2)
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or (getattr(c, "hidden_size", None) or c.n_embd) // heads
        kv = layers * 2 * batch * total * kv_heads * head_dim * size
    vocab = getattr(c, "vocab_size", 0) or 0
    prefill = 2 * batch * prompt * widest * size
    return kv + prefill + batch * vocab * 4 * 2 + 2 * batch * total * 8 + 512 * new_tokens


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (CUDA: the driver's free bytes; CPU: ``MemAvailable``), or None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_generation_memory(model: nn.Module, batch: int, prompt: int, new_tokens: int,
                            free: int | None = None, estimate=generation_bytes, device=None) -> None:
    """ValueError (one line) when ``generation_bytes`` is more than the device's free memory (``free``
    overrides what ``available_bytes`` reads): a prompt of a million tokens or ``max_new_tokens``
    of 2**31 fails at once, naming the sizes and what fits, instead of swapping or being killed. ``device``: where
    it will run (default: the model's; a meta model's estimate before training names the device it will use)."""
    device = next(model.parameters()).device if device is None else device
    free = available_bytes(device) if free is None else free
    need = estimate(model, batch, prompt, new_tokens)
    if free is None or need <= free:
        return
    fit = 0
    low, high = 0, max(0, new_tokens)
    while low <= high:  # the most new tokens whose estimate fits
        mid = (low + high) // 2
        if estimate(model, batch, prompt, mid) <= free:
            fit, low = mid, mid + 1
        else:
            high = mid - 1
    advice = (f"ask for at most {fit} new tokens" if estimate(model, batch, prompt, 1) <= free
              else "shorten the prompt")
    raise ValueError(f"generating {new_tokens} tokens after a {prompt}-token prompt needs about {need / 2**30:.3g} GiB "
                     f"(the prompt's logits over {model.config.vocab_size} tokens, activations and the attention "
                     f"cache), but {device} has {free / 2**30:.3g} GiB free; {advice}.")
