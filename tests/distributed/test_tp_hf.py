"""Tensor/sequence-parallel plans for Hugging Face models against the single-process model.

One 2-rank gloo group runs every parity check: for Llama, Qwen2, Qwen3, Mistral, Gemma3,
Phi, Falcon-H1 (registered plans), Olmo2 (its own Hugging Face plan, translated) and a
Llama subclass nothing is registered for (the generic default plan), with and without
sequence parallelism where the plan has it, the float64 logits and every parameter gradient
(gathered with ``full_tensor``) equal the single-process model's to 1e-9 relative to the
tensor's scale. A few SP runs add a padding mask or packed position ids. Tiny random
configs, no downloads, SDPA attention (float64 softmax).

Hugging Face RMSNorms compute in float32 (``x.to(float32)``/``x.float()``); a float32
rounding flip caused by a 1e-16 difference in a TP partial sum would cap parity at ~1e-7,
so both the reference and the TP model run their RMSNorms in the input dtype here.

The same group checks the ``ValueError``s that must come before any collective and the
``MaskPartial`` mask-buffer repair of ``VocabParallelEmbedding``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from hybridpar.parallel.tp import apply_tp, get_tp_plan, known_plan_names, register_tp_plan
from hybridpar.parallel.tp_plans import hf_style, unregister_tp_plan
from tests.distributed.harness import run_ranks

TOL = 1e-9
VOCAB = 127  # odd: the vocab-parallel embedding and LM head shard unevenly
SEQ = 16
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, attn_implementation="sdpa", use_cache=False)

# name -> (expected plan source, sequence parallel supported, {param: expected TP placement})
L0 = "model.layers.0"
CASES = {
    "llama": ("registry", True, {f"{L0}.self_attn.q_proj.weight": "S0", f"{L0}.mlp.down_proj.weight": "S1"}),
    "qwen2": ("registry", True, {f"{L0}.self_attn.k_proj.bias": "S0", f"{L0}.mlp.up_proj.weight": "S0"}),
    "qwen3": ("registry", True, {f"{L0}.self_attn.q_norm.weight": "R", f"{L0}.self_attn.o_proj.weight": "S1"}),
    "mistral": ("registry", True, {f"{L0}.self_attn.v_proj.weight": "S0", f"{L0}.mlp.gate_proj.weight": "S0"}),
    "gemma3": ("registry", True, {f"{L0}.self_attn.k_norm.weight": "R", f"{L0}.mlp.down_proj.weight": "S1"}),
    "phi": ("registry", True, {f"{L0}.self_attn.dense.weight": "S1", f"{L0}.mlp.fc1.bias": "S0",
                               "lm_head.bias": "S0", f"{L0}.self_attn.q_layernorm.bias": "R"}),
    "falcon_h1": ("registry", True, {f"{L0}.feed_forward.down_proj.weight": "S1",
                                     f"{L0}.mamba.in_proj.weight": "R", f"{L0}.mamba.A_log": "R"}),
    "olmo2": ("hf", False, {f"{L0}.self_attn.q_proj.weight": "S0", f"{L0}.self_attn.q_norm.weight": "R"}),
    "unregistered_llama": ("default", True, {f"{L0}.self_attn.q_proj.weight": "S0"}),
}


# padding masks and packed documents (position ids restart) under sequence parallelism
INPUT_VARIANTS = [("llama", "padded"), ("qwen3", "packed"), ("falcon_h1", "padded")]


def _unregistered_llama_class():
    from transformers import LlamaForCausalLM

    class UnregisteredLlama(LlamaForCausalLM):
        """A Llama-shaped class with no registry entry and no Hugging Face plan."""

        _tp_plan = None

    UnregisteredLlama.__qualname__ = UnregisteredLlama.__name__ = "UnregisteredLlama"
    return UnregisteredLlama


def _exact_rmsnorm(module: nn.Module) -> None:
    """Run a Hugging Face RMSNorm in the input dtype (see module docstring)."""
    eps = getattr(module, "variance_epsilon", None) or module.eps
    offset = 1.0 if type(module).__name__.startswith("Gemma") else 0.0  # Gemma scales by (1 + w)

    def forward(x):
        return (offset + module.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    module.forward = forward


def build_model(name: str) -> nn.Module:
    """A tiny float64 model; every parameter perturbed so no gradient is trivially zero."""
    import transformers as hf

    torch.manual_seed(0)
    if name == "llama":
        model = hf.LlamaForCausalLM(hf.LlamaConfig(**COMMON))
    elif name == "qwen2":
        model = hf.Qwen2ForCausalLM(hf.Qwen2Config(**COMMON))  # q/k/v biases
    elif name == "qwen3":
        model = hf.Qwen3ForCausalLM(hf.Qwen3Config(head_dim=16, **COMMON))
    elif name == "mistral":
        model = hf.MistralForCausalLM(hf.MistralConfig(sliding_window=6, **COMMON))
    elif name == "gemma3":  # tied embeddings, sliding + full layers, soft-capped logits
        config = hf.Gemma3TextConfig(head_dim=16, sliding_window=5, final_logit_softcapping=30.0,
                                     layer_types=["sliding_attention", "full_attention"], **COMMON)
        model = hf.Gemma3ForCausalLM(config)
    elif name == "phi":  # LayerNorm with bias, partial rotary, per-head q/k LayerNorms, lm_head bias
        model = hf.PhiForCausalLM(hf.PhiConfig(partial_rotary_factor=0.5, qk_layernorm=True, **COMMON))
    elif name == "falcon_h1":
        config = hf.FalconH1Config(mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8,
                                   mamba_n_groups=1, mamba_chunk_size=8, **COMMON)
        model = hf.FalconH1ForCausalLM(config)
    elif name == "olmo2":
        model = hf.Olmo2ForCausalLM(hf.Olmo2Config(**COMMON))
    elif name == "unregistered_llama":
        config = hf.LlamaConfig(**COMMON)
        config.base_model_tp_plan = None
        model = _unregistered_llama_class()(config)
    else:
        raise ValueError(name)
    model = model.to(torch.float64)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            _exact_rmsnorm(module)
    return model


def _placement_code(param) -> str:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return "plain"
    (placement,) = param.placements
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    return "R" if isinstance(placement, Replicate) else repr(placement)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def _model_inputs(variant: str) -> dict:
    """Dense ids, plus a left-padded attention mask or two packed documents' position ids."""
    torch.manual_seed(1)
    inputs = {"input_ids": torch.randint(0, VOCAB, (2, SEQ)), "use_cache": False}
    if variant == "padded":
        inputs["attention_mask"] = torch.ones(2, SEQ, dtype=torch.long)
        inputs["attention_mask"][1, :5] = 0
    elif variant == "packed":
        inputs["position_ids"] = torch.cat([torch.arange(6), torch.arange(SEQ - 6)])[None].expand(2, -1)
    return inputs


def _rotary_is_plain_and_equal(model, reference, tp_mesh) -> bool:
    """Under SP the rotary module gets a sequence-sharded DTensor and must return the
    full-sequence (cos, sin) as plain tensors, equal to the reference's."""
    from torch.distributed.tensor import Shard, distribute_tensor

    x_full = torch.randn(2, SEQ, COMMON["hidden_size"], dtype=torch.float64)
    x = distribute_tensor(x_full, tp_mesh, [Shard(1)])
    position_ids = torch.arange(SEQ)[None]
    extra = ("full_attention",) if "Gemma3" in type(model).__name__ else ()
    got = model.model.rotary_emb(x, position_ids, *extra)
    want = reference.model.rotary_emb(x_full, position_ids, *extra)
    return all(type(g) is torch.Tensor and torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _parity(name: str, sequence_parallel: bool, tp_mesh, variant: str = "dense") -> dict:
    from torch.distributed.tensor import DTensor

    inputs = _model_inputs(variant)
    weights = torch.randn(2, SEQ, VOCAB, dtype=torch.float64)

    reference = build_model(name)
    ref_logits = reference(**inputs).logits
    (ref_logits * weights).sum().backward()

    model = build_model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "default plan" notice for the unregistered class
        apply_tp(model, tp_mesh, sequence_parallel=sequence_parallel)
    logits = model(**inputs).logits
    (logits * weights).sum().backward()

    ref_params = dict(reference.named_parameters())
    grad_errors = {}
    for pname, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grad_errors[pname] = _relative_error(grad, ref_params[pname].grad)
    return {
        "source": model._tp_plan_applied.source.split(":")[0],
        "logits_error": _relative_error(logits, ref_logits),
        "grad_errors": grad_errors,
        "same_names": sorted(ref_params) == sorted(dict(model.named_parameters())),
        "placements": {n: _placement_code(p) for n, p in model.named_parameters()},
        "tied": getattr(model.config, "tie_word_embeddings", False)
        and model.lm_head.weight is model.model.embed_tokens.weight,
        "rotary_ok": not sequence_parallel or _rotary_is_plain_and_equal(model, reference, tp_mesh),
    }


def _errors_before_collectives(tp_mesh) -> dict:
    """ValueErrors apply_tp and the SP input check raise (no collective runs before them)."""
    import transformers as hf

    out = {}
    bad_heads = hf.LlamaForCausalLM(hf.LlamaConfig(**{**COMMON, "num_key_value_heads": 1}))
    try:
        apply_tp(bad_heads, tp_mesh)
    except ValueError as err:
        out["kv_heads"] = str(err)
    bad_mlp = hf.LlamaForCausalLM(hf.LlamaConfig(**{**COMMON, "intermediate_size": 129}))
    try:
        apply_tp(bad_mlp, tp_mesh)
    except ValueError as err:
        out["intermediate"] = str(err)
    olmo = build_model("olmo2")
    try:
        apply_tp(olmo, tp_mesh, sequence_parallel=True)
    except ValueError as err:
        out["hf_sp"] = str(err)
    sp_model = apply_tp(build_model("llama"), tp_mesh, sequence_parallel=True)
    try:
        sp_model(input_ids=torch.zeros(2, SEQ - 1, dtype=torch.long))
    except ValueError as err:
        out["odd_sequence"] = str(err)
    return out


def _mask_partial_repair(tp_mesh) -> dict:
    """Empty the embedding output's mask buffer (the torch bug) and check the repair."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hybridpar.parallel.tp_styles import repair_mask_partial

    torch.manual_seed(2)
    table = torch.randn(VOCAB, 8, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    expected = F.embedding(ids, table)
    weight = distribute_tensor(table, tp_mesh, [Shard(0)])
    ids_dt = distribute_tensor(ids, tp_mesh, [Replicate()])

    out = {}
    healthy = F.embedding(ids_dt, weight)
    out["no_repair_needed"] = not repair_mask_partial(healthy, ids, VOCAB, tp_mesh)
    # reduce it now: torch caches the output placement, so unreduced outputs share one buffer
    out["healthy_error"] = (healthy.full_tensor() - expected).abs().max().item()
    broken = F.embedding(ids_dt, weight)
    broken.placements[0].mask_buffer.release_mask()  # what the buggy dispatch leaves behind
    try:
        broken.redistribute(tp_mesh, [Replicate()])
    except (AssertionError, RuntimeError):
        out["broken_fails"] = True
    broken = F.embedding(ids_dt, weight)
    broken.placements[0].mask_buffer.release_mask()
    out["repaired"] = repair_mask_partial(broken, ids, VOCAB, tp_mesh)
    out["repair_error"] = (broken.full_tensor() - expected).abs().max().item()
    return out


def tp_checks(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    results = {}
    for name, (_, supports_sp, _) in CASES.items():
        for sequence_parallel in (False, True) if supports_sp else (False,):
            results[(name, sequence_parallel)] = _parity(name, sequence_parallel, tp_mesh)
    for name, variant in INPUT_VARIANTS:
        results[(name, variant)] = _parity(name, True, tp_mesh, variant)
    results["errors"] = _errors_before_collectives(tp_mesh)
    results["mask_repair"] = _mask_partial_repair(tp_mesh)
    return results


@pytest.fixture(scope="module")
def tp_results():
    return run_ranks(2, tp_checks, timeout_s=400)


PARITY_RUNS = [(name, sp) for name, case in CASES.items() for sp in (False, True) if sp <= case[1]]


@pytest.mark.parametrize("name,sequence_parallel", PARITY_RUNS)
def test_hf_plan_parity(tp_results, name, sequence_parallel):
    expected_source, _, expected_placements = CASES[name]
    for result in tp_results:
        case = result[(name, sequence_parallel)]
        assert case["source"] == expected_source
        assert case["same_names"]
        assert case["logits_error"] < TOL
        worst = max(case["grad_errors"], key=case["grad_errors"].get)
        assert case["grad_errors"][worst] < TOL, f"{worst}: {case['grad_errors'][worst]:.3e}"
        assert "plain" not in case["placements"].values(), "every parameter must be a DTensor"
        for pname, code in expected_placements.items():
            assert case["placements"][pname] == code, pname
        assert case["placements"]["model.embed_tokens.weight"] == "S0"
        assert case["rotary_ok"], "rotary outputs under SP must be plain full-sequence tensors"
    if name == "gemma3":
        assert all(r[(name, sequence_parallel)]["tied"] for r in tp_results), "tied lm_head must stay tied"


@pytest.mark.parametrize("name,variant", INPUT_VARIANTS)
def test_sequence_parallel_with_padding_mask_and_packed_positions(tp_results, name, variant):
    for result in tp_results:
        case = result[(name, variant)]
        assert case["logits_error"] < TOL
        assert max(case["grad_errors"].values()) < TOL


def test_errors_before_any_collective(tp_results):
    for result in tp_results:
        errors = result["errors"]
        assert "num_key_value_heads=1" in errors["kv_heads"] and "tp=2" in errors["kv_heads"]
        assert "intermediate_size=129" in errors["intermediate"] and "tp=2" in errors["intermediate"]
        assert "sequence parallelism" in errors["hf_sp"] and "sequence_parallel=False" in errors["hf_sp"]
        assert "sequence length 15" in errors["odd_sequence"] and "multiple of 2" in errors["odd_sequence"]


def test_vocab_parallel_embedding_repairs_empty_mask(tp_results):
    for result in tp_results:
        repair = result["mask_repair"]
        assert repair["no_repair_needed"] and repair["healthy_error"] == 0.0
        assert repair["broken_fails"], "an empty mask buffer must break the reduction, or the repair tests nothing"
        assert repair["repaired"] and repair["repair_error"] == 0.0


# ----------------------------------------------------------------------- registry (no ranks)


def test_unknown_plan_name_lists_known_names():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError) as err:
        get_tp_plan(model, "no_such_plan")
    assert "no_such_plan" in str(err.value) and "LlamaForCausalLM" in str(err.value)
    assert "HybridLM" in known_plan_names() and "default" in known_plan_names()


def test_plan_without_sequence_parallel_rejects_it():
    register_tp_plan("tests.no_sp_plan", lambda model, sp: {}, sequence_parallel=False)
    try:
        assert get_tp_plan(nn.Linear(2, 2), "tests.no_sp_plan").source == "registry:tests.no_sp_plan"
        with pytest.raises(ValueError, match="does not support sequence parallelism"):
            get_tp_plan(nn.Linear(2, 2), "tests.no_sp_plan", sequence_parallel=True)
    finally:
        unregister_tp_plan("tests.no_sp_plan")


def test_registry_rejects_duplicate_names_and_unregisters():
    register_tp_plan("tests.dup_plan", lambda model, sp: {}, aliases=("tests.dup_alias",))
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_tp_plan("tests.other_plan", lambda model, sp: {}, aliases=("tests.dup_alias",))
    finally:
        unregister_tp_plan("tests.dup_plan")
    assert "tests.dup_alias" not in known_plan_names() and "tests.dup_plan" not in known_plan_names()


def test_registered_plan_is_found_by_class_key():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2)

    key = f"{Tiny.__module__}.{Tiny.__qualname__}"
    register_tp_plan(key, lambda model, sp: {"proj": hf_style("colwise")})
    try:
        assert get_tp_plan(Tiny()).source == f"registry:{key}"
    finally:
        unregister_tp_plan(key)


def test_hybrid_lm_is_a_registry_key_and_alias():
    from hybridpar.parallel.tp_plans import lookup_tp_plan

    entry = lookup_tp_plan("HybridLM")
    assert entry is not None and entry.key == "hybridpar.models.hybrid.HybridLM"
    assert lookup_tp_plan("LlamaForCausalLM").key == "transformers.models.llama.modeling_llama.LlamaForCausalLM"


def test_user_plan_dict_accepts_hf_strings_and_rejects_unknown():
    plan = get_tp_plan(nn.Linear(2, 2), {"a": "colwise", "b": "embedding_rowwise"})
    assert plan.source == "user" and type(plan.styles["b"]).__name__ == "VocabParallelEmbedding"
    with pytest.raises(ValueError, match="'moe_tp_experts' is not supported"):
        get_tp_plan(nn.Linear(2, 2), {"experts": "moe_tp_experts"})
