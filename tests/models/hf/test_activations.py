"""Nemotron-H's squared ReLUs (dense MLPs and MoE experts) run as products: the swap leaves the
logits bitwise unchanged in float64 (``tests/models/test_blocks.py`` holds the product off ``pow``,
float32 under CUDA's autocast), and ``install_cores`` (what training and ``check`` run) makes it.
Llama-form gated MLPs run ``gated_product``: the loss and every gradient bitwise unchanged, one
``[T, I]`` less kept per layer; other forwards and activations keep transformers' own. Llama-form
RMSNorms over the hidden state run ``blocks.rms_norm``: the same loss, one ``[T, D]`` less kept each;
so do the Mamba2 hybrids' gated norms of Bamba's form (``blocks.gated_rms_norm``)."""

import pytest
import torch

from hybridpar.models.hf.activations import (LEAN_NORM_MARK, ProductReLUSquared, lean_gated_norms, lean_rms_norms,
                                             use_lean_gated_mlps, use_lean_rms_norms, use_product_relu2)
from hybridpar.train.hf_model import install_cores
from tests.models.hf.hybrid_models import build_hybrid
from tests.op_outputs import kept_for_backward


@pytest.mark.parametrize("name", ["nemotron_h", "nemotron_h_moe"])
def test_squared_relus_become_products_with_the_same_logits(name):
    from transformers.activations import ReLUSquaredActivation

    model = build_hybrid(name).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    relus = sum(type(m) is ReLUSquaredActivation for m in model.modules())
    assert relus and use_product_relu2(model) == relus
    assert sum(type(m) is ProductReLUSquared for m in model.modules()) == relus
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(after, before)
    fresh = install_cores(build_hybrid(name))
    assert not any(type(m) is ReLUSquaredActivation for m in fresh.modules())


def _llama(hidden_act: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, hidden_act=hidden_act)
    return LlamaForCausalLM(config).double()


def _loss_grads_and_kept(model, ids):
    with kept_for_backward() as kept:
        loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss, grads, sum(kept.values())


@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_mlps_run_the_gated_product_bitwise_and_keep_one_intermediate_less(hidden_act):
    model = _llama(hidden_act)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    before = _loss_grads_and_kept(model, ids)
    assert use_lean_gated_mlps(model) == 2 and use_lean_gated_mlps(model) == 2  # idempotent
    after = _loss_grads_and_kept(model, ids)
    assert torch.equal(after[0], before[0])
    assert after[1].keys() == before[1].keys() and all(torch.equal(after[1][n], g) for n, g in before[1].items())
    assert before[2] - after[2] == 2 * 20 * 48 * 8  # act(gate) [T, I] float64, per layer
    assert "gated" not in str(list(model.state_dict()))  # names and checkpoints unchanged


def test_other_gated_mlp_forwards_and_activations_keep_transformers_forward():
    from transformers.models.llama.modeling_llama import LlamaMLP

    class ScaledMLP(LlamaMLP):  # a different forward: not the Llama form
        def forward(self, x):
            return 2 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    relu = _llama("relu")
    assert use_lean_gated_mlps(relu) == 0
    scaled = ScaledMLP(relu.config)
    assert use_lean_gated_mlps(scaled) == 0 and "forward" not in vars(scaled)
    assert use_lean_gated_mlps(install_cores(_llama("silu"))) == 2  # install_cores made the swap


def test_every_planned_gated_mlp_runs_the_gated_product():
    """The planner counts three ``[T, I]`` per gated MLP of the decoders it plans through a twin
    (``plan/hf/twin.TWIN_MODEL_TYPES``): each of their MLP classes must take the lean forward. Falcon-H1's
    MLP (its multipliers) keeps transformers' forward, which its twin prices at four (``mlp_multipliers``)."""
    import transformers as hf

    from hybridpar.plan.hf.twin import TWIN_MODEL_TYPES

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    built = {}
    for model_type in ("llama", "mistral", "qwen2", "qwen3"):
        config = hf.AutoConfig.for_model(model_type, **small)
        with torch.device("meta"):
            built[model_type] = hf.AutoModelForCausalLM.from_config(config)
    built["bamba"] = build_hybrid("bamba")
    # relu2; fused gate_up (GraniteMoeHybrid, Zamba2's shared block: plan/hf/moe.fused_mlp_saved); Falcon-H1 below
    assert set(built) | {"nemotron_h", "granitemoehybrid", "zamba2", "falcon_h1"} == set(TWIN_MODEL_TYPES)
    for model_type, model in built.items():
        mlps = sum(type(m).__name__.endswith("MLP") for m in model.modules())
        assert mlps and use_lean_gated_mlps(model) == mlps, model_type
    falcon = build_hybrid("falcon_h1")
    assert sum(type(m).__name__.endswith("MLP") for m in falcon.modules()) and use_lean_gated_mlps(falcon) == 0
    from hybridpar.plan.planner import planned_shape

    assert planned_shape(falcon.config)[0].mlp_multipliers


def test_llama_form_rms_norms_run_ours_with_the_same_values_and_keep_one_product_less():
    """In float64 (transformers' float32 casts kept float64, as ``check`` runs): the loss bitwise, every
    gradient to rounding (ours differentiates by formula), and per norm one ``[T, D]`` product less kept."""
    from hybridpar.models.hf.float64 import keep_float64

    model = keep_float64(_llama("silu"))
    for p in model.parameters():
        if p.dim() == 1:
            p.data.normal_(1.0, 0.3)  # norm weights away from one
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    before = _loss_grads_and_kept(model, ids)
    assert use_lean_rms_norms(model) == 5 and use_lean_rms_norms(model) == 5  # two per layer, the final norm
    after = _loss_grads_and_kept(model, ids)
    assert torch.equal(after[0], before[0])
    for name, grad in before[1].items():
        torch.testing.assert_close(after[1][name], grad, rtol=1e-13, atol=1e-15, msg=name)
    assert before[2] - after[2] == 5 * 20 * 32 * 8  # x * rstd [T, D] float64, per norm
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # float32 under autocast: bitwise too
        fp32 = _llama("silu").float()
        want = fp32(ids).logits
        use_lean_rms_norms(fp32)
        assert torch.equal(fp32(ids).logits, want)


def test_other_norms_and_sequence_parallel_inputs_keep_transformers_forward():
    """Per-head norms (Qwen3's q/k), other forwards (NemotronH's), and DTensor inputs (sequence
    parallelism) keep transformers' norm; ``install_cores`` makes the swap."""
    import transformers as hf

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        qwen3 = hf.AutoModelForCausalLM.from_config(hf.AutoConfig.for_model("qwen3", **small))
    assert len(lean_rms_norms(qwen3)) == 5 and all(n.weight.shape == (32,) for n in lean_rms_norms(qwen3))
    assert lean_rms_norms(build_hybrid("nemotron_h")) == []
    assert len(lean_rms_norms(build_hybrid("bamba"))) > 0
    model = install_cores(_llama("silu"))
    norm = model.model.norm
    assert getattr(norm, LEAN_NORM_MARK)

    class Wrapped(torch.Tensor):  # any tensor subclass stands for a DTensor here
        pass

    x = torch.randn(3, 32, dtype=torch.float64)
    plain, wrapped = norm(x.requires_grad_()), norm(x.as_subclass(Wrapped))
    assert plain.grad_fn.name() == "_RMSNormFunctionBackward"
    assert type(wrapped) is Wrapped and torch.equal(wrapped.as_subclass(torch.Tensor), type(norm).forward(norm, x))


@pytest.mark.parametrize("name", ["bamba", "nemotron_h", "granite", "zamba2"])
def test_gated_norms_of_bambas_form_run_ours_with_the_same_loss_and_keep_less(name):
    """Each Mamba2 hybrid on hybridpar's core (``install_cores``), float64 as ``check`` runs it: with
    its gated norms (and Llama-form norms) on ours, the loss bitwise, every gradient to rounding, and
    less kept for backward (transformers' gated norm keeps three float32 ``[T, d_inner]``)."""
    import copy

    from hybridpar.models.hf.float64 import keep_float64

    base = build_hybrid(name).double()
    lean = install_cores(keep_float64(copy.deepcopy(base)))
    theirs = install_cores(keep_float64(copy.deepcopy(base)))
    gated = lean_gated_norms(theirs)
    assert gated and all(getattr(n, LEAN_NORM_MARK) == "gated" for n in gated)
    for norm in gated + lean_rms_norms(theirs):  # back to transformers' forward
        del norm.forward
        delattr(norm, LEAN_NORM_MARK)
    ids = torch.randint(0, base.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    want, got = _loss_grads_and_kept(theirs, ids), _loss_grads_and_kept(lean, ids)
    assert torch.equal(got[0], want[0])
    for param, grad in want[1].items():
        if grad is not None:
            torch.testing.assert_close(got[1][param], grad, rtol=1e-12, atol=1e-15, msg=param)
    assert got[2] < want[2]


def test_falcon_h1_gated_norm_keeps_its_own_forward():
    """Falcon-H1's gated norm multiplies its weight inside float32 and may gate after the norm."""
    model = install_cores(build_hybrid("falcon_h1"))
    assert lean_gated_norms(model) == [] and len(lean_rms_norms(model)) > 0
