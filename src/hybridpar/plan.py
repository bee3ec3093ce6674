"""``hybridpar plan``: what a layout costs, before anything runs.

Prints the model's size, the parameter + AdamW bytes each rank holds under the layout,
and the bytes each rank sends per Mamba layer and step for both Mamba CP strategies,
from the closed forms the tests hold the collectives to.
"""

from __future__ import annotations

from hybridpar.config import RunConfig
from hybridpar.models.hybrid import HybridConfig
from hybridpar.train.preflight import validate_layout
from hybridpar.parallel.cp_mamba import a2a_bytes_per_layer
from hybridpar.parallel.cp_mamba_state import state_bytes_per_layer


def parameter_count(config: HybridConfig) -> int:
    """Parameters of a ``HybridLM`` computed from its shape (no model is built)."""
    d = n = config.hidden_size  # n: one RMSNorm weight
    d_inner, heads, groups, state = config.mamba_intermediate_size, config.mamba_num_heads, config.mamba_n_groups, config.ssm_state_size
    conv_dim = d_inner + 2 * groups * state
    mamba = d * (d_inner + conv_dim + heads) + conv_dim * (config.conv_kernel + int(config.use_conv_bias)) + 3 * heads + d_inner + d_inner * d
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attention = d * (q + 2 * kv) + q * d
    mlp = d * config.intermediate_size * (3 if config.mlp_gated else 2)
    blocks = {"M": mamba, "*": attention, "-": mlp}
    body = sum(blocks[kind] + n for kind in config.pattern)
    head = 0 if config.tie_word_embeddings else config.vocab_size * d
    return config.vocab_size * d + body + n + head


def print_plan(run: RunConfig, world_size: int | None = None) -> None:
    model = validate_layout(run, world_size)  # the same rules as train: an invalid layout has no plan
    p = run.parallel
    if not isinstance(model, HybridConfig):  # a transformers model: its size and the per-rank share
        from hybridpar.train.preflight import meta_model

        meta = meta_model(model)
        params = sum(t.numel() for t in meta.parameters())
        per_rank = params / (p.tp * p.dp_shard * p.cp)
        print(f"model: {type(meta).__name__} (transformers), {params / 1e6:,.1f}M parameters")
        print(f"layout: dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp}, "
              f"sequence_parallel={p.sequence_parallel}")
        print(f"per rank: {per_rank / 1e6:,.1f}M parameters; fp32 params + grads + AdamW = {per_rank * 16 / 2**30:,.2f} GiB")
        return
    world = p.dp_replicate * p.dp_shard * p.cp * p.tp
    params = parameter_count(model)
    per_rank = params / (p.tp * p.dp_shard * p.cp)
    print(f"model: preset {run.model.preset}, pattern {model.pattern} ({len(model.pattern)} blocks), {params / 1e6:,.1f}M parameters")
    print(f"layout: dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp} -> {world} ranks, "
          f"sequence_parallel={p.sequence_parallel}, cp_attention={p.cp_attention}, cp_mamba={p.cp_mamba}")
    print(f"per rank: {per_rank / 1e6:,.1f}M parameters; fp32 params + grads + AdamW = {per_rank * 16 / 2**30:,.2f} GiB")
    seq_len, heads_local = run.data.pack_size, model.mamba_num_heads // p.tp
    shape = dict(d_inner=model.mamba_intermediate_size // p.tp, num_heads=heads_local, n_groups=model.mamba_n_groups // p.tp, state_size=model.ssm_state_size)
    a2a = a2a_bytes_per_layer(1, seq_len, p.cp, element_size=2, **shape)
    travelling = a2a_bytes_per_layer(1, seq_len, p.cp, element_size=2, z_travels=True, **shape)
    state = state_bytes_per_layer(1, 1, p.cp, head_dim=model.mamba_head_dim, conv_kernel=model.conv_kernel,
                                  element_size=2, state_element_size=4, **shape)
    print(f"Mamba CP bytes sent per rank per layer, forward, one {seq_len}-token sequence (bf16 activations, fp32 states):")
    print(f"  a2a (z local) {a2a / 2**20:,.2f} MiB | a2a with z travelling {travelling / 2**20:,.2f} MiB | state {state / 2**20:,.2f} MiB")
