"""Tiny float64 transformers Mamba2 hybrids, built from transformers' own config classes.

Granite 4.0-H (dense: NoPE, multipliers; MoE: RoPE, eager experts; ``_g1``: one B/C group), Falcon-H1 (``mamba_rms_norm``
with ``norm_before_gate``, μP multipliers; and the plain ``y * silu(z)`` gate), NemotronH (dense
with a dt clamp at ``time_step_min``; MoE), Bamba and Zamba2 (shared attention block, LoRA).
Every parameter is perturbed so no gradient is trivially zero; plain RMSNorms and NemotronH's
router (float32 in transformers) run in the input dtype (``tests/distributed/tensor/hf_models.exact_norm``),
so a float32 rounding flip cannot cap the 1e-9 parity.
"""

from __future__ import annotations


import torch

from tests.models.hf.tiny import perturbed_float64

from tests.distributed.tensor.hf_models import exact_norm

VOCAB = 97
_C = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
          use_cache=False)
_M = dict(mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8)
_GRANITE = dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=16,
                mamba_expand=1, shared_intermediate_size=64, embedding_multiplier=2.0, residual_multiplier=0.5,
                attention_multiplier=0.3, logits_scaling=1.0, **_M, **_C)
_NEMOTRON = dict(head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=8, **_C)


def _builders(hf) -> dict:
    return {
        "granite": lambda: hf.GraniteMoeHybridForCausalLM(hf.GraniteMoeHybridConfig(
            num_local_experts=0, position_embedding_type="nope", **_GRANITE)),
        "granite_moe": lambda: hf.GraniteMoeHybridForCausalLM(hf.GraniteMoeHybridConfig(
            num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope", **_GRANITE)),
        "falcon_h1": lambda: hf.FalconH1ForCausalLM(hf.FalconH1Config(
            num_hidden_layers=2, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_rms_norm=True,
            mamba_norm_before_gate=True, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], ssm_in_multiplier=0.7,
            key_multiplier=0.5, **_M, **_C)),
        "granite_moe_g1": lambda: hf.GraniteMoeHybridForCausalLM(hf.GraniteMoeHybridConfig(
            num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope", **{**_GRANITE, "mamba_n_groups": 1})),
        "falcon_h1_g1": lambda: hf.FalconH1ForCausalLM(hf.FalconH1Config(
            num_hidden_layers=2, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_rms_norm=True,
            mamba_norm_before_gate=True, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], ssm_in_multiplier=0.7,
            key_multiplier=0.5, **{**_M, "mamba_n_groups": 1}, **_C)),
        "falcon_h1_gate": lambda: hf.FalconH1ForCausalLM(hf.FalconH1Config(
            num_hidden_layers=2, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_rms_norm=False, **_M, **_C)),
        "nemotron_h": lambda: hf.NemotronHForCausalLM(hf.NemotronHConfig(
            layers_block_type=["mamba", "attention", "mlp"], time_step_min=0.3, **_NEMOTRON)),
        "nemotron_h_moe": lambda: hf.NemotronHForCausalLM(hf.NemotronHConfig(
            layers_block_type=["mamba", "attention", "moe"], n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1, **_NEMOTRON)),
        "bamba": lambda: hf.BambaForCausalLM(hf.BambaConfig(
            num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, **_M, **_C)),
        "zamba2": lambda: hf.Zamba2ForCausalLM(hf.Zamba2Config(
            num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=8, n_mamba_heads=8,
            mamba_ngroups=2, chunk_size=8, **_C)),
        # two hybrid layers reusing one shared block, its per-layer attention adapters, RoPE
        "zamba2_shared": lambda: hf.Zamba2ForCausalLM(hf.Zamba2Config(
            num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8,
            n_mamba_heads=8, mamba_ngroups=2, chunk_size=8, num_mem_blocks=1, use_shared_attention_adapter=True,
            adapter_rank=8, use_mem_rope=True, **{**_C, "num_key_value_heads": 4})),  # adapters need kv = heads
    }


HYBRIDS = ("granite", "granite_moe", "falcon_h1", "falcon_h1_gate", "nemotron_h", "nemotron_h_moe", "bamba", "zamba2")
MIXERS = {"granite": 2, "granite_moe": 2, "falcon_h1": 2, "falcon_h1_gate": 2, "nemotron_h": 1, "nemotron_h_moe": 1,
          "bamba": 1, "zamba2": 3, "zamba2_shared": 4, "granite_moe_g1": 2, "falcon_h1_g1": 2}  # Mamba2 mixers per tiny model


def build_hybrid(name: str, seed: int = 0):
    """The tiny float64 model ``name`` (train mode, eager experts, perturbed parameters)."""
    import transformers as hf

    model = perturbed_float64(_builders(hf)[name], seed)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            exact_norm(module)
        elif type(module).__name__ == "NemotronHTopkRouter":
            _exact_nemotron_router(module)
    return model.train()


def _exact_nemotron_router(module) -> None:
    """NemotronH's sigmoid top-k router (one group) with its logits in the input dtype, not float32."""
    assert module.num_group == 1

    def forward(hidden_states):
        logits = torch.nn.functional.linear(hidden_states.view(-1, module.hidden_dim), module.weight)
        scores = logits.sigmoid()
        index = torch.topk(scores + module.e_score_correction_bias, k=module.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if module.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * module.routed_scaling_factor, index

    module.forward = forward
