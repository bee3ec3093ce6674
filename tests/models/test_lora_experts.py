"""LoRA on stacked MoE experts (``models/lora_experts.py``), one process, float64.

A tiny transformers Qwen3-MoE (and a NemotronH with an ungated MoE layer) with adapters on ``q_proj`` and on ``experts.gate_up_proj`` /
``experts.down_proj`` (``A`` and ``B`` random, so every factor has a gradient) against peft's own
``target_parameters`` model carrying the same factors (loaded through our export's names): the same
logits, loss and every adapter gradient. The experts implementations (eager, batched mm) agree, the
merged weights reproduce the adapted model, and bad targets are refused with a did-you-mean.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridpar.models.lora import add_lora, is_lora_parameter
from hybridpar.models.lora_experts import peft_names, peft_target_parameters
from hybridpar.parallel.state import canonical_state_dict

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
R, ALPHA = 2, 6.0


NEMOTRON = ["experts.up_proj", "experts.down_proj"]  # NemotronH's experts: no gate


def _base(implementation: str = "eager", name: str = "qwen3_moe"):
    if name == "gpt_oss":  # interleaved gate/up [E, D, 2I] with biases, its own experts loop, attention sinks
        import transformers as hf

        from tests.distributed.tensor.hf_models import COMMON

        torch.manual_seed(0)
        config = hf.GptOssConfig(**{**COMMON, "attn_implementation": "eager"}, head_dim=16, num_local_experts=4,
                                 num_experts_per_tok=2, experts_implementation="eager")
        model = hf.GptOssForCausalLM(config).double()
        _randomize_all(model)
        _exact_norms(model)
        return model
    if name == "llama4":  # transposed experts [E, D, 2I] / [E, I, D], the shared expert added in place
        import transformers as hf

        from tests.distributed.tensor.hf_models import COMMON

        torch.manual_seed(0)
        config = hf.Llama4TextConfig(**{**COMMON, "attn_implementation": "eager"}, head_dim=16,
                                     intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=2,
                                     no_rope_layers=[1, 0], attention_chunk_size=32)
        model = hf.Llama4ForCausalLM(config).double()
        _randomize_all(model)
        _exact_norms(model)
        return model
    if name == "nemotron_h_moe":  # Mamba, attention and MoE layers; its own (eager) experts loop
        from tests.models.hf.hybrid_models import build_hybrid

        return build_hybrid(name)
    from tests.distributed.tensor.hf_models import build_model

    model = build_model(name)
    model.set_experts_implementation(implementation)
    return model


def _randomize(model, seed: int = 3) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_lora_parameter(name):
                param.copy_(0.2 * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def _randomize_all(model) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))


def _adapted(base, experts=EXPERTS):
    model = copy.deepcopy(base)
    add_lora(model, r=R, alpha=ALPHA, targets=["q_proj"], target_parameters=experts, seed=1)
    _randomize(model)
    return model


def _exact_norms(model) -> None:
    """RMSNorms in float64 (transformers' compute in float32), as ``build_model`` makes them."""
    from tests.distributed.tensor.hf_models import exact_norm

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            exact_norm(module)


def _loss(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits
    return logits, torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])


@pytest.mark.parametrize("name, experts", [("qwen3_moe", EXPERTS), ("nemotron_h_moe", NEMOTRON), ("gpt_oss", EXPERTS),
                                           ("llama4", EXPERTS)])
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's call
def test_expert_adapters_match_peft_target_parameters(name, experts):
    from peft import LoraConfig, get_peft_model

    base = _base(name=name)
    ours = _adapted(base, experts)
    assert {".".join(n.split(".")[-2:]) for n in peft_target_parameters(ours)} == set(experts)  # full names
    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["q_proj"], target_parameters=experts)
    theirs = get_peft_model(copy.deepcopy(base), config).double()
    names = peft_names(ours)
    state = {n: t for n, t in canonical_state_dict(ours).items() if is_lora_parameter(n)}  # gate/up B fused
    peft_params = dict(theirs.named_parameters())
    mapped = {}
    for name in state:
        peft_name = names.get(name, name).replace(".lora_A.weight", ".lora_A.default.weight") \
            .replace(".lora_B.weight", ".lora_B.default.weight")
        mapped[name] = "base_model.model." + peft_name
    assert set(mapped.values()) == {n for n, p in peft_params.items() if p.requires_grad}
    with torch.no_grad():
        for name, peft_name in mapped.items():
            assert peft_params[peft_name].shape == state[name].shape, name
            peft_params[peft_name].copy_(state[name])
    ids = torch.randint(0, 127, (1, 12), generator=torch.Generator().manual_seed(0))
    logits, loss = _loss(ours, ids)
    peft_logits, peft_loss = _loss(theirs, ids)
    loss.backward()
    peft_loss.backward()
    assert (logits - peft_logits).abs().max().item() < 1e-12
    assert abs(loss.item() - peft_loss.item()) < 1e-12
    grads = canonical_state_dict(ours, grads=True)
    for name, peft_name in mapped.items():
        grad, peft_grad = grads[name], peft_params[peft_name].grad
        assert grad.abs().max() > 0, name
        assert (grad - peft_grad).abs().max().item() < 1e-12, name
    assert all(p.grad is None for n, p in ours.named_parameters() if not is_lora_parameter(n))


def test_every_experts_implementation_sees_the_adapted_weights():
    ids = torch.randint(0, 127, (1, 12), generator=torch.Generator().manual_seed(1))
    results = {}
    for implementation in ("eager", "batched_mm"):
        model = _adapted(_base(implementation))
        logits, loss = _loss(model, ids)
        loss.backward()
        results[implementation] = (logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (logits, grads), (other_logits, other_grads) = results["eager"], results["batched_mm"]
    assert (logits - other_logits).abs().max().item() < 1e-12
    assert set(grads) == set(other_grads) and any("lora_gate_up_proj" in n for n in grads)
    assert all((grads[n] - other_grads[n]).abs().max().item() < 1e-12 for n in grads)
    # grouped mm (transformers' default) has no float64 kernel: against eager in float32
    for implementation in ("eager", "grouped_mm"):
        model = _adapted(_base(implementation).float())
        logits, loss = _loss(model, ids)
        loss.backward()
        results[implementation] = (logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (logits, grads), (other_logits, other_grads) = results["eager"], results["grouped_mm"]
    assert (logits - other_logits).abs().max().item() < 1e-5
    assert set(grads) == set(other_grads)
    assert all((grads[n] - other_grads[n]).abs().max().item() < 1e-5 * max(1.0, grads[n].abs().max().item())
               for n in grads)


def test_bad_expert_targets_are_refused():
    base = _base()
    with pytest.raises(ValueError, match=r"'experts\.gate_proj'.*did you mean experts\.gate_up_proj\?"):
        add_lora(copy.deepcopy(base), target_parameters=["experts.gate_proj"])
    with pytest.raises(ValueError, match=r"peft\.dropout=0\.1 with peft\.target_parameters"):
        add_lora(copy.deepcopy(base), dropout=0.1, target_parameters=EXPERTS)
    with pytest.raises(ValueError, match=r"peft\.r=40 is larger than the smaller side of the expert weight"):
        add_lora(copy.deepcopy(base), r=40, targets=["q_proj"], target_parameters=EXPERTS)


def test_the_export_loads_in_peft_with_the_same_logits_and_merges(tmp_path):
    import json
    import warnings

    import transformers as hf
    from peft import PeftModel

    from hybridpar.models.hf.lora_export import export_lora

    base = _base()
    base.save_pretrained(tmp_path / "base")
    ours = _adapted(base)
    ids = torch.randint(0, 127, (2, 10), generator=torch.Generator().manual_seed(5))
    want = ours(input_ids=ids, use_cache=False).logits.detach()
    state = canonical_state_dict(ours)
    export_lora(ours, tmp_path / "adapter", state, base_path=tmp_path / "base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    layers = [f"model.layers.{i}." for i in range(2)]  # full names: peft adapts what was trained, no more
    assert sorted(config["target_parameters"]) == sorted(f"{layer}mlp.{e}" for layer in layers for e in EXPERTS)
    assert sorted(config["target_modules"]) == [f"{layer}self_attn.q_proj" for layer in layers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(hf.AutoModelForCausalLM.from_pretrained(
            tmp_path / "base", dtype=torch.float64, experts_implementation="eager"), tmp_path / "adapter")
    _exact_norms(loaded)
    placed = {n.replace(".default", "") for n, _ in loaded.named_parameters() if "lora_" in n}
    assert placed == {"base_model.model." + n for n in peft_names(ours).values()} | {
        "base_model.model." + n for n in state if "q_proj.lora_" in n}
    got = loaded(input_ids=ids, use_cache=False).logits
    assert (got - want).abs().max().item() < 1e-10 * want.abs().max().item()
    assert (base(input_ids=ids, use_cache=False).logits - want).abs().max().item() > 1e-4  # the adapters matter

    export_lora(ours, tmp_path / "merged", state, merge=True)
    merged = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64,
                                                     experts_implementation="eager")
    _exact_norms(merged)
    assert (merged(input_ids=ids, use_cache=False).logits - want).abs().max().item() < 1e-10 * want.abs().max().item()


def _trained(rank, world_size, overrides):
    from hybridpar.config import load_config
    from hybridpar.train.trainer import Trainer

    config = load_config("configs/tiny-hybrid.yaml", overrides)
    Trainer(config, torch.device("cpu")).fit()


@pytest.mark.parametrize("name", ["qwen3_moe", "llama4"])
def test_a_tp2_lora_run_exports_expert_adapters_that_peft_loads(tmp_path, name):
    """The trainer at tp=2 (experts sharded, factors paired), adapting the experts only
    (``peft.target_modules=[]``), writes an adapter peft loads on the base; its experts' factors moved
    (they trained) and the merged-by-peft logits differ from the base's. Llama 4's experts are stored
    transposed without the flag: the adapter follows peft's reading (its factors' shapes were swapped)."""
    import warnings

    import transformers as hf
    from peft import PeftModel

    from tests.distributed.harness import run_ranks

    base = _base(name=name)
    base.save_pretrained(tmp_path / "base")
    overrides = [f"model.hf_path={tmp_path / 'base'}", "model.dtype=float64", "parallel.cp=1", "parallel.tp=2",
                 "data.pack_size=32", "train.steps=2", "train.eval_every=0", "checkpoint.every=-1", "plot=false",
                 "tensorboard=false", "peft.method=lora", "peft.r=2", "peft.target_modules=[]",
                 "peft.target_parameters=[experts.gate_up_proj,experts.down_proj]", "train.lr=1e-2",
                 f"model.export_hf={tmp_path / 'adapter'}", f"output_dir={tmp_path / 'run'}"]
    run_ranks(2, _trained, overrides, timeout_s=240)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(hf.AutoModelForCausalLM.from_pretrained(
            tmp_path / "base", dtype=torch.float64, experts_implementation="eager"), tmp_path / "adapter")
    factors = {n: p for n, p in loaded.named_parameters() if "experts" in n and "lora_" in n}
    assert len(factors) == 2 * 2 * 2  # 2 layers x (gate_up, down) x (A, B)
    assert all(p.abs().max() > 0 for n, p in factors.items() if "lora_B" in n)  # B starts at zero: trained
    ids = torch.randint(0, 16, (1, 10), generator=torch.Generator().manual_seed(2))
    assert (loaded(input_ids=ids).logits - base(input_ids=ids, use_cache=False).logits).abs().max() > 1e-6
