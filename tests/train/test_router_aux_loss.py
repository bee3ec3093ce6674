"""transformers' router auxiliary loss (``output_router_logits``) in hybridpar's objective.

hybridpar computes the token loss itself, so a MoE checkpoint's load-balancing loss, which
transformers adds only when given labels, was silently left out of training. Now the trainer adds
``router_aux_loss_coef * aux_loss`` per pack, averaged over the step's packs
(``models/hf/router_aux.py``): on one pack the objective and every gradient equal transformers' own
``model(ids, labels=ids).loss`` (float64); ``hybridpar check`` holds it exact under FSDP, tensor
parallelism with and without SP, and context parallelism, where a pack's ranks sum Switch's counts
before each adds its share; a model whose term is not Switch's form is refused at cp > 1.
"""

import contextlib
import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from hybridpar.config import ConfigError, load_config
from tests.distributed.harness import run_ranks

DEFAULT = "configs/tiny-hybrid.yaml"
JOB = ["model.dtype=float64", "data.pack_size=128", "data.packs_per_step=2", "train.eval_every=0", "plot=false",
       "tensorboard=false", "data.task_options={min_len: 32, max_len: 64, num_kv_pairs: [2, 4]}", "output_dir=unused"]
COMMON = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, num_hidden_layers=2,
              output_router_logits=True, router_aux_loss_coef=0.7)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import transformers as hf

    root = tmp_path_factory.mktemp("router_aux")
    torch.manual_seed(0)
    hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(num_experts=4, head_dim=16, num_experts_per_tok=2, moe_intermediate_size=32,
                                             intermediate_size=64, **COMMON)).save_pretrained(root / "qwen3_moe")
    hf.GraniteMoeHybridForCausalLM(hf.GraniteMoeHybridConfig(
        num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope", intermediate_size=32,
        shared_intermediate_size=64, layers_block_type=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8, mamba_expand=2, **COMMON)).save_pretrained(root / "granite_moe")
    hf.NemotronHForCausalLM(hf.NemotronHConfig(  # returns router logits but no aux_loss: transformers adds no term
        layers_block_type=["mamba", "attention", "moe"], n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, head_dim=16, mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=8, **{**COMMON, "num_hidden_layers": 3},
    )).save_pretrained(root / "nemotron_h_moe")
    return {name: str(root / name) for name in ("qwen3_moe", "granite_moe", "nemotron_h_moe")}


@pytest.mark.parametrize("name, padding", [("qwen3_moe", 0), ("granite_moe", 0), ("nemotron_h_moe", 0),
                                           ("qwen3_moe", 3), ("granite_moe", 5)])
def test_one_pack_trains_transformers_own_loss_with_its_load_balancing_term(checkpoints, name, padding):
    """NemotronH with ``output_router_logits`` returns its router logits but no ``aux_loss`` and adds no term to
    its own loss: nor does hybridpar (it raised a TypeError at cp=1 and was refused at cp > 1). A document padded
    (``data.pad_to_multiple_of``) trains what transformers computes on the document alone: the padded rows
    were counted in the term (1% at 24 of 256 rows), so it changed with the padding, and with it with cp."""
    import transformers as hf

    from hybridpar.models.hf.float64 import keep_float64
    from hybridpar.models.hf.router_aux import router_aux_term, switch_loss, switch_parts
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.train.hf_model import use_blockwise_attention
    from hybridpar.train.loss import real_token_mask
    from hybridpar.train.trainer import build_model, pack_loss_sum, pack_tensors

    model = build_model(load_config(DEFAULT, JOB + [f"model.hf_path={checkpoints[name]}", "parallel.cp=1",
                                                    "model.backend=transformers"]))
    use_blockwise_attention(model)
    reference = hf.AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float64)
    reference.set_experts_implementation("eager")
    keep_float64(reference.to(torch.float64))  # its router too (kept in float32 by from_pretrained)
    tokens = 48
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(1))
    pad = torch.full((padding,), -100)
    pack = {"input_ids": torch.cat([ids, torch.zeros(padding, dtype=ids.dtype)]),  # one document, padded
            "labels": torch.cat([ids[1:], torch.tensor([-100]), pad]), "position_ids": torch.arange(tokens + padding),
            "seq_lens": torch.tensor([tokens]), "seq_lens_padded": torch.tensor([tokens + padding])}
    input_ids, labels, packed = pack_tensors(pack, torch.device("cpu"))
    model.train(), reference.train()
    loss_sum, _ = pack_loss_sum(model, shard_inputs(input_ids=input_ids, labels=labels, packed=packed))
    aux = router_aux_term(model, 1, real=real_token_mask(pack))
    if name == "nemotron_h_moe":
        assert aux is None
    else:
        assert aux is not None and float(aux) > 0.1  # the term is there, and not small beside the token loss
    objective = loss_sum / (tokens - 1) + (0 if aux is None else aux)
    objective.backward()
    out = reference(input_ids=ids[None], labels=ids[None], use_cache=False)
    want = out.loss  # token loss + coef * aux_loss
    if padding:  # transformers' term in float64: its own counts C_e / R are float32 (expert_mask.float())
        coefficient = reference.config.router_aux_loss_coef
        assert abs(float(aux) - coefficient * float(out.aux_loss)) <= 1e-6 * float(aux)
        want = F.cross_entropy(out.logits[0, :-1], ids[1:]) + coefficient * switch_loss(*switch_parts(
            out.router_logits, reference.config.num_experts_per_tok))
    want.backward()
    assert abs(float(objective) - float(want)) <= 1e-12 * abs(float(want))
    ours = dict(model.named_parameters())
    for name_, param in reference.named_parameters():
        difference = (ours[name_].grad - param.grad).abs().max()
        assert difference <= 1e-12 * max(1.0, float(param.grad.abs().max())), (name_, float(difference))


def _check(rank, world_size, overrides):
    from hybridpar.train.proof.layout import run_check

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run_check(load_config(DEFAULT, JOB + overrides), torch.device("cpu"))
    return code, out.getvalue()


@pytest.mark.parametrize("name, layout", [
    ("granite_moe", ["parallel.cp=1", "parallel.tp=1", "parallel.dp_shard=2"]),
    ("granite_moe", ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("qwen3_moe", ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=false"]),
    ("qwen3_moe", ["parallel.cp=2", "parallel.tp=1", "parallel.cp_attention=allgather"]),
    ("granite_moe", ["parallel.cp=2", "parallel.tp=1", "parallel.cp_attention=ring", "parallel.cp_mamba=state"]),
    ("nemotron_h_moe", ["parallel.cp=2", "parallel.tp=1", "parallel.cp_mamba=state"]),
], ids=["granite-dp2", "granite-tp2-sp", "qwen3-tp2", "qwen3-cp2", "granite-cp2", "nemotron-cp2"])
def test_the_load_balancing_term_is_one_process_s_at_every_layout(checkpoints, name, layout):
    code, text = run_ranks(2, _check, [f"model.hf_path={checkpoints[name]}", "model.backend=transformers", *layout],
                           timeout_s=300)[0]
    assert code == 0 and "check exact" in text, text[-1500:]


def _refused(rank, world_size, overrides):
    import hybridpar.models.hf.router_aux as router_aux
    from hybridpar.train.trainer import Trainer

    switch_parts = router_aux.switch_parts  # a model whose term is not Switch's: its counts doubled
    router_aux.switch_parts = lambda *args: (lambda c, p, r: (2 * c, p, r))(*switch_parts(*args))
    try:
        Trainer(load_config(DEFAULT, JOB + overrides), torch.device("cpu"))
    except ConfigError as error:
        return str(error)
    return None


def test_at_cp_2_a_term_that_is_not_switch_s_form_is_refused_before_any_collective(checkpoints):
    message = run_ranks(2, _refused, [f"model.hf_path={checkpoints['qwen3_moe']}", "parallel.cp=2"], timeout_s=300)[0]
    assert message and message.startswith("parallel.cp=2: Qwen3MoeForCausalLM's router auxiliary loss cannot be split"), \
        message
    assert "is not Switch's load-balancing form" in message and '"output_router_logits": false in' in message, message
