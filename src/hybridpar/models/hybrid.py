"""The hybrid language model: a layer pattern of Mamba2, attention and MLP blocks.

Pattern characters follow Nemotron-H: ``M`` Mamba2 block, ``*`` attention block,
``-`` MLP block. Parameter names follow transformers' NemotronH/Mamba2 models
(``backbone.embeddings``, ``backbone.layers.i.{norm,mixer}``, ``backbone.norm_f``,
``lm_head``) so their checkpoints map onto this model by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hybridpar.config_rules import Rule, integer, number, one_of, quoted
from hybridpar.models.arguments import python_number, python_numbers
from hybridpar.models.attention.mixer import Attention
from hybridpar.models.blocks import MLP, ResidualBlock, RMSNorm
from hybridpar.models.lm_head_loss import ChunkedLMHeadLoss, check_token_values
from hybridpar.models.mamba.mixer import Mamba2Mixer

BLOCK_KINDS = {"M": "mamba", "*": "attention", "-": "mlp"}
COUNT_FIELDS = ("vocab_size", "hidden_size", "mamba_num_heads", "mamba_head_dim", "mamba_n_groups", "ssm_state_size",
                "conv_kernel", "chunk_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")

# Rules of the HybridConfig fields (``model.overrides`` names them by key; the API by field).
MODEL_RULES: dict[str, Rule] = {
    **{name: integer(1, 2**31 - 1) for name in COUNT_FIELDS},
    "rope_theta": number(0, low_open=True), "rotary_fraction": number(0, 1), "norm_eps": number(0, low_open=True),
    "initializer_range": number(0), "mlp_activation": one_of("silu", "relu2", "gelu"),
    "time_step_limit": Rule("[low, high] with 0 <= low <= high", lambda v: len(v) == 2 and 0 <= v[0] <= v[1]),
    "pattern": Rule("a non-empty string of 'M' (Mamba2), '*' (attention) and '-' (MLP) blocks",
                    lambda v: bool(v) and set(v) <= set("M*-")),
}


@dataclass
class HybridConfig:
    """Shape of a ``HybridLM``. Build one with ``HybridConfig.from_preset(name, **overrides)``."""

    vocab_size: int = 256
    hidden_size: int = 64
    pattern: str = "M*-M-"
    # Mamba2 mixer
    mamba_num_heads: int = 8
    mamba_head_dim: int = 16
    mamba_n_groups: int = 2
    ssm_state_size: int = 16
    conv_kernel: int = 4
    chunk_size: int = 16
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    # attention
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rotary_fraction: float = 1.0
    attention_bias: bool = False
    # MLP
    intermediate_size: int = 128
    mlp_activation: str = "relu2"
    mlp_gated: bool = False
    mlp_bias: bool = False
    # everything else
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        self.time_step_limit = tuple(map(python_number, self.time_step_limit))
        python_numbers(self, MODEL_RULES)  # np.int64(64) is 64 (was "must be a positive integer")
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` with the fix for shapes that cannot build a model."""
        if not isinstance(self.pattern, str) or not self.pattern:  # 5 or None was a TypeError, a list was built
            raise ValueError(f"layer pattern {self.pattern!r} must be a non-empty string of 'M' (Mamba2), '*' "
                             "(attention) and '-' (MLP), one character per block, e.g. 'M*-M-'.")
        unknown = sorted(set(self.pattern) - set(BLOCK_KINDS))
        if unknown:
            raise ValueError(
                f"layer pattern {self.pattern!r} has unknown characters {unknown}; use only "
                "'M' (Mamba2), '*' (attention) and '-' (MLP), e.g. 'M*-M-'."
            )
        for name in COUNT_FIELDS:  # before the divisions below (a 0 was a ZeroDivisionError, a '64' a TypeError)
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer"
                                 + (" (a number, not a string)" if isinstance(value, str) else "") + "; fix it in the config.")
        if self.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):  # "float32", torch.int64
            raise ValueError(f"dtype={quoted(self.dtype)} must be a floating torch.dtype (torch.float32, float64, bfloat16 "
                             "or float16); fix it in the config.")
        for name, rule in MODEL_RULES.items():  # the numbers and choices (rope_theta=0 or norm_eps=-1 gave NaN logits)
            value = getattr(self, name)
            try:
                holds = rule.holds(value) and not isinstance(value, bool)
            except (TypeError, ValueError):  # a string where a number goes
                holds = False
            if not holds:
                raise ValueError(f"{name}={quoted(value)} must be {rule.text}; fix it in the config.")
        rules = [
            (self.mamba_num_heads % self.mamba_n_groups == 0,
             f"mamba_num_heads={self.mamba_num_heads} must be divisible by mamba_n_groups={self.mamba_n_groups}"),
            (self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads={self.num_attention_heads} must be divisible by num_key_value_heads={self.num_key_value_heads}"),
            (self.head_dim * self.rotary_fraction >= 2 or self.rotary_fraction == 0,
             f"rotary_fraction={self.rotary_fraction} of head_dim={self.head_dim} leaves no channel pair to rotate"),
        ]
        for holds, message in rules:
            if not holds:
                raise ValueError(f"{message}; change one of them in the config.")

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "HybridConfig":
        """A named shape (``tiny``, ``demo``, ``small``, ``1b``, ``nemotronh-8b``) with field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown HybridConfig fields {unknown}; valid fields are {sorted(fields)}.")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict] = {
    # Tests: every block kind, grouped B/C, seconds on a CPU.
    "tiny": dict(),
    # The default job (`make demo`, configs/tiny-hybrid.yaml): tiny at width 128 with wider
    # mixers (SSM state 64, Mamba and attention heads of 32), where MQAR recall rises sooner;
    # SSD chunks of 64 tokens (a step 16% faster on CPU than 16).
    "demo": dict(hidden_size=128, ssm_state_size=64, mamba_head_dim=32, head_dim=32, chunk_size=64),
    # A ~100M-parameter shape for local experiments.
    "small": dict(
        vocab_size=32000, hidden_size=768, pattern="M-M-M*-M-M-M*-M-M-", mamba_num_heads=24,
        mamba_head_dim=64, mamba_n_groups=1, ssm_state_size=128, chunk_size=256,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, intermediate_size=3072,
    ),
    # ~1.2B Nemotron-H-like, for GPU throughput work (benchmarks/gpu_throughput.py): the 8B
    # pattern's 6:1:6 ratio of Mamba, attention and MLP blocks in 26 layers, hidden 2048, the
    # 8B's head shapes (Mamba heads of 64 with 8 groups and state 128, attention heads of 128
    # with 4:1 GQA, no RoPE) and MLP ratio (5.25 x hidden, relu2); a 64K vocabulary.
    "1b": dict(
        vocab_size=65536, hidden_size=2048, pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-",
        mamba_num_heads=64, mamba_head_dim=64, mamba_n_groups=8, ssm_state_size=128, conv_kernel=4,
        chunk_size=128, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        intermediate_size=10752, mlp_activation="relu2", rotary_fraction=0.0, time_step_limit=(0.001, float("inf")),
    ),
    # Nemotron-H-8B-like: used for planning and communication-volume tables.
    "nemotronh-8b": dict(
        vocab_size=131072, hidden_size=4096,
        pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        mamba_num_heads=128, mamba_head_dim=64, mamba_n_groups=8, ssm_state_size=128, conv_kernel=4,
        chunk_size=128, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=21504, mlp_activation="relu2", rotary_fraction=0.0, time_step_limit=(0.001, float("inf")),
    ),
}


def build_block(config: HybridConfig, kind: str) -> ResidualBlock:
    """One pre-norm residual block of the given pattern character."""
    if kind == "M":
        mixer = Mamba2Mixer(
            config.hidden_size, config.mamba_num_heads, config.mamba_head_dim, config.mamba_n_groups,
            config.ssm_state_size, config.conv_kernel, config.chunk_size, config.use_conv_bias,
            config.mamba_proj_bias, config.norm_eps, config.time_step_limit,
        )
    elif kind == "*":
        mixer = Attention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.rope_theta, config.rotary_fraction, config.attention_bias,
        )
    else:
        mixer = MLP(config.hidden_size, config.intermediate_size, config.mlp_activation, config.mlp_gated, config.mlp_bias)
    return ResidualBlock(RMSNorm(config.hidden_size, config.norm_eps), mixer, BLOCK_KINDS[kind])


class HybridBackbone(nn.Module):
    """Embeddings, the residual blocks and the final norm."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(build_block(config, kind) for kind in config.pattern)
        self.norm_f = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, input_ids: Tensor | None = None, inputs_embeds: Tensor | None = None, packed=None) -> Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, S] or inputs_embeds [B, S, D].")
        _check_input(input_ids, inputs_embeds)
        _check_packed(packed, input_ids if inputs_embeds is None else inputs_embeds)
        if input_ids is not None:
            check_token_values(input_ids, self.embeddings.num_embeddings)
        hidden_states = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, packed)
        return self.norm_f(hidden_states)


def _check_input(input_ids, inputs_embeds) -> None:
    """A tensor of the layout the blocks read (shape and dtype only: no value is read, so nothing syncs): a [S] row
    was a bare "not enough values to unpack", numpy ids or float ids an error from inside the embedding."""
    name, value, dims = ("input_ids", input_ids, 2) if inputs_embeds is None else ("inputs_embeds", inputs_embeds, 3)
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} is a {type(value).__name__}, not a torch.Tensor; pass torch.as_tensor({name}).")
    integer = not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)
    if value.dim() != dims or (name == "input_ids") != integer or value.shape[1] == 0:
        want = "token ids [batch, seq] of an integer dtype" if name == "input_ids" else "[batch, seq, hidden] of a float dtype"
        fix = ("; a single row takes input_ids.unsqueeze(0)" if value.dim() == 1 and integer else "")
        raise ValueError(f"{name} has shape {list(value.shape)} and dtype {str(value.dtype).removeprefix('torch.')}; it "
                         f"must be {want}, at least one token long{fix}.")


def _check_packed(packed, tokens: Tensor) -> None:
    """``packed`` a ``PackedSeqParams`` of these tokens' row (shapes only, no sync): a dict was "'dict' object has no
    attribute 'cache'", and the params of a flattened [B, S] batch (``from_batch`` of B rows) a size mismatch deep in
    a layer."""
    if packed is None:
        return
    if not hasattr(packed, "seq_idx") or not hasattr(packed, "qkv_format"):
        raise ValueError(f"packed is a {type(packed).__name__}, not a PackedSeqParams; build it with "
                         "PackedSeqParams.from_batch(batch), or pass shard_inputs(...).packed.")
    rows, length = tokens.shape[0], packed.seq_idx.shape[-1]
    if tokens.shape[1] != length or (packed.qkv_format == "thd" and rows != 1):
        fix = ("the params of a collated batch describe its rows as one: pass input_ids.reshape(1, -1) and labels.reshape("
               "1, -1)" if rows * tokens.shape[1] == length else "build packed from this batch (PackedSeqParams.from_batch)")
        raise ValueError(f"packed describes {'a row' if packed.qkv_format == 'thd' else 'rows'} of {length} tokens, but "
                         f"the input has shape {list(tokens.shape[:2])}; {fix}.")


class HybridLM(nn.Module):
    """Hybrid Mamba2/attention causal LM returning logits ``[B, S, vocab]``, or with ``labels``
    the loss ``(loss_sum, valid_count)`` from ``loss_core`` without building the logits.

    ``packed`` (``PackedSeqParams``) describes document boundaries of a packed ``[1, T]``
    row; no state, convolution or attention crosses a boundary. ``loss_core`` (the blockwise
    LM head + cross entropy) is the seam tensor parallelism replaces with a vocab-parallel one.
    """

    def __init__(self, config: HybridConfig):
        if not isinstance(config, HybridConfig):  # HybridLM("tiny"): an AttributeError from inside the backbone
            raise ValueError(f"config={quoted(config, 60)} is not a HybridConfig (type {type(config).__name__}); pass "
                             "e.g. HybridConfig.from_preset('tiny') or HybridConfig(**fields).")
        python_numbers(config, MODEL_RULES)  # a config changed after it was built: checked again (pattern 'M*X' was a
        config.validate()  # KeyError, num_key_value_heads=3 of 4 heads a model that fails at its first forward)
        super().__init__()
        self.config = config
        previous = torch.get_default_dtype()  # weights drawn in float32, then cast: under a caller's
        torch.set_default_dtype(torch.float32)  # set_default_dtype(float64) the same seed drew other weights
        try:
            self.backbone = HybridBackbone(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.loss_core = ChunkedLMHeadLoss()
            self._init_weights()
        finally:
            torch.set_default_dtype(previous)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight
        self.to(config.dtype)

    @torch.no_grad()
    def _init_weights(self) -> None:
        if self.lm_head.weight.is_meta:  # shapes only (planning, preflight): nothing to initialize
            return
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for layer in self.backbone.layers:  # scale residual outputs by depth (GPT-2 style)
            out = getattr(layer.mixer, "out_proj", None) or getattr(layer.mixer, "o_proj", None) or layer.mixer.down_proj
            out.weight.mul_(1.0 / (2 * len(self.backbone.layers)) ** 0.5)

    def forward(self, input_ids: Tensor | None = None, inputs_embeds: Tensor | None = None, packed=None,
                labels: Tensor | None = None, return_predictions: bool = False):
        """Logits ``[B, S, V]``; with ``labels`` ``(loss_sum, valid_count)``, plus the argmax
        ``predictions`` (labels' shape) when ``return_predictions``. The loss runs here, inside the
        root's forward, where FSDP has unsharded the LM head."""
        hidden_states = self.backbone(input_ids, inputs_embeds, packed)
        if labels is None:
            return self.lm_head(hidden_states)
        out = self.loss_core(hidden_states, self.lm_head.weight, labels, return_predictions=return_predictions)
        return tuple(out) if return_predictions else (out.loss_sum, out.valid_count)

    def generate(self, input_ids: Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, eos_token_id: int | list[int] | None = None) -> Tensor:
        """Prompt ``[B, S]`` plus up to ``max_new_tokens`` tokens, with a cache (see ``models/generation.py``)."""
        from hybridpar.models.generation import generate

        return generate(self, input_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                        eos_token_id=eos_token_id)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
