"""The HF loss helper under FSDP at dp_shard=2 (real gloo, float64), and export from FSDP.

hybridpar's FSDP sums gradients over ranks (divide factor 1). Checked against one process:

- transformers' own ``model(ids, labels=ids).loss`` on each rank's half of the batch gives
  gradients exactly 2.0x the single-process gradient (each rank's mean is summed, not averaged);
- ``hf_causal_lm_loss`` (token-loss sum / global count), with some labels ignored so the ranks
  hold different counts, gives the single-process loss and gradients to 1e-9, through the
  logits and through the hidden-state ``loss_fn`` seam;
- ``export_causal_lm`` of the FSDP model's gathered state writes a checkpoint transformers
  loads with no missing or unexpected keys and the reference's logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.distributed.harness import run_ranks

TOL = 1e-9
BATCH, SEQ = 4, 12


def _relative(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _fsdp_loss_checks(rank: int, world_size: int, export_dir: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hybridpar.models.hf.causal_lm import export_causal_lm, hf_causal_lm_loss
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.data.fsdp import apply_fsdp
    from hybridpar.parallel.state import canonical_state_dict
    from tests.distributed.tensor.hf_models import build_model, exact_norm

    reference, model = build_model("llama"), build_model("llama")
    dims = ParallelDims(dp_shard=2)
    apply_fsdp(model, dims.build_mesh(), dims)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, reference.config.vocab_size, (BATCH, SEQ), generator=gen)
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)

    def grads(module):
        out = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for n, p in module.named_parameters()}
        module.zero_grad(set_to_none=True)
        return out

    # 1. transformers' mean loss, per rank: the gradient is dp_shard times too large
    reference(ids, labels=ids, use_cache=False).loss.backward()
    ref_mean_grads = grads(reference)
    model(ids[rows], labels=ids[rows], use_cache=False).loss.backward()
    hf_grads = grads(model)
    ratio_error = max(_relative(hf_grads[n], 2.0 * g) for n, g in ref_mean_grads.items())

    # 2. the helper: sum over this rank's tokens / global count; ranks hold different counts
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[torch.rand(BATCH, SEQ, generator=gen) < torch.tensor([0.0, 0.1, 0.5, 0.7])[:, None]] = -100
    count = (labels != -100).sum()
    ref_loss = hf_causal_lm_loss(reference, ids, labels, count)
    ref_loss.backward()
    ref_grads = grads(reference)
    local_count = (labels[rows] != -100).sum()
    global_count = local_count.clone()
    dist.all_reduce(global_count)

    def head_loss(hidden, weight, target):
        return F.cross_entropy((hidden @ weight.T).flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")

    errors = {}
    for route, loss_fn in (("logits", None), ("hidden", head_loss)):
        loss = hf_causal_lm_loss(model, ids[rows], labels[rows], global_count, loss_fn=loss_fn)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        got = grads(model)
        errors[route] = {"loss": _relative(total, ref_loss.detach()),
                         "grads": max(_relative(got[n], g) for n, g in ref_grads.items())}

    # 3. export the FSDP model's gathered weights (its class is FSDP<Llama...>: never saved as is)
    state = canonical_state_dict(model)
    if rank == 0:
        export_causal_lm(model, export_dir, state_dict=state)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    reloaded, info = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float64, output_loading_info=True,
                                                          local_files_only=True, attn_implementation="sdpa")
    problems = sum(len(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    for module in reloaded.modules():  # the reference's norms run in the input dtype (see test_tp_hf)
        if type(module).__name__.endswith("RMSNorm"):
            exact_norm(module)
    with torch.no_grad():
        logits_error = _relative(reloaded(ids, use_cache=False).logits, build_model("llama")(ids, use_cache=False).logits)
    return {"ratio_error": ratio_error, "local_count": int(local_count), "errors": errors,
            "load_problems": problems, "architecture": reloaded.config.architectures, "logits_error": logits_error}


def test_hf_loss_helper_is_exact_under_fsdp_and_transformers_loss_is_2x(tmp_path):
    results = run_ranks(2, _fsdp_loss_checks, str(tmp_path / "export"), timeout_s=240)
    assert results[0]["local_count"] != results[1]["local_count"]  # uneven: a plain mean would also be mis-weighted
    for result in results:
        assert result["ratio_error"] < TOL  # transformers' loss: exactly 2x the gradient at dp_shard=2
        for route in ("logits", "hidden"):
            assert result["errors"][route]["loss"] < TOL and result["errors"][route]["grads"] < TOL, route
        assert result["load_problems"] == 0 and result["architecture"] == ["LlamaForCausalLM"]
        assert result["logits_error"] < 1e-12


def _neox(seed: int = 0):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoXConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTNeoXForCausalLM(config).to(torch.float64).eval()


def _blocks_elsewhere(rank: int, world_size: int, root_only: bool) -> dict:
    """GPT-NeoX keeps its blocks in ``gpt_neox.layers``: the units are its ``_no_split_modules`` blocks
    (or, ``root_only``, the root alone), and the hidden-state loss seam is exact either way."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hybridpar.models.hf.causal_lm import hf_causal_lm_loss
    from hybridpar.parallel.data.fsdp import apply_fsdp, fsdp_units
    from hybridpar.parallel.dims import ParallelDims

    reference, model = _neox(), _neox()
    if root_only:
        model._fsdp_units = []
    units = [type(u).__name__ for u in fsdp_units(model)]
    dims = ParallelDims(dp_shard=2)
    apply_fsdp(model, dims.build_mesh(), dims)
    ids = torch.randint(0, 61, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100

    def head_loss(hidden, weight, target):
        return F.cross_entropy((hidden @ weight.T).flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")

    count = (labels != -100).sum()
    hf_causal_lm_loss(reference, ids, labels, count, loss_fn=head_loss).backward()
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    hf_causal_lm_loss(model, ids[rows], labels[rows], count, loss_fn=head_loss).backward()
    got = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    dist.barrier()
    return {"units": units, "grads": max(_relative(got[n], p.grad) for n, p in reference.named_parameters())}


def test_a_model_whose_blocks_are_not_model_layers_is_sharded_by_block_and_exact():
    """GPT-2, GPT-NeoX, OPT, Falcon keep their blocks elsewhere than ``model.layers``: they were one
    root FSDP unit, and the hidden-state loss seam left its output (one position's logits) out of the
    loss, so FSDP's pre-backward hook never ran and no gradient was reduced (each rank kept its own:
    0.47 on a gradient at dp_shard=2). Now the blocks come from ``_no_split_modules`` and the output
    joins the loss (times 0): both alone are exact."""
    for root_only in (False, True):
        result = run_ranks(2, _blocks_elsewhere, root_only, timeout_s=240)[0]
        assert result["units"] == ([] if root_only else ["GPTNeoXLayer", "GPTNeoXLayer"]), result["units"]
        assert result["grads"] < TOL, (root_only, result["grads"])
