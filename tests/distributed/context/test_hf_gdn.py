"""Context parallelism (cp=2) of transformers' gated DeltaNet models against one process, float64.

Tiny Qwen3-Next, Qwen3.5, Qwen3.5-MoE and OLMo-Hybrid models (``tests/models/hf/gdn_models.py``: 2 key heads, 4 value heads,
chunks of 8) with hybridpar's gated DeltaNet core (``install_gdn_core``); ``parallelize(cp=2)``
installs the all-to-all core (``parallel/context/recurrent/gdn.py``) or the state-passing one
(``cp_mamba=state``) and an attention strategy. Two rows of
three packed documents (4, 12 and 16 tokens: cut across the ranks in zigzag order); the one-process
reference runs the same cores at cp=1 (``tests/models/hf/test_gdn_mixers.py`` proves it equals one
document per row). The loss and every parameter gradient agree to 1e-9. A Qwen3-Next with one key
head runs at cp=2 with the key head repeated. Bad layouts are refused in one line before any collective:
one key head at tp=2, value heads "a2a" cannot split over cp. The bytes the all-to-all core sends
(``comm.CommStats``) are the formula of ``parallel/context/recurrent/gdn.py``, forward and backward, and the
state-passing core's its own formula.
"""

from __future__ import annotations

import torch

from tests.distributed.harness import run_ranks
from tests.distributed.context.mixer_cp import cp_case

TOL = 1e-9
DOCS = [0, 4, 16, 32]
# (model, attention, key heads, gated DeltaNet strategy, chunk of the rule): chunks of 2 put segments
# (1 to 4 tokens here) across several chunks of the rule
CASES = [("qwen3_next", "allgather", 2, "a2a", 8), ("qwen3_5", "ulysses", 2, "a2a", 8), ("qwen3_next", "ulysses", 1, "a2a", 8),
         ("olmo_hybrid", "ring", 2, "a2a", 8), ("qwen3_next", "allgather", 2, "state", 8), ("qwen3_5", "ring", 1, "state", 2),
         ("olmo_hybrid", "ulysses", 2, "state", 2), ("qwen3_5_moe", "allgather", 2, "state", 8)]


def _build(name: str, k_heads: int, chunk: int):
    from tests.models.hf.gdn_models import build_gdn

    return build_gdn(name, k_heads=k_heads, chunk=chunk)


def _case(name, attention, k_heads, strategy, chunk, mesh) -> dict:
    from hybridpar.models.hf.mixers.gdn import gdn_layers, install_gdn_core
    from tests.models.hf.gdn_models import VOCAB

    return cp_case(lambda model: _build(model, k_heads, chunk), install_gdn_core, gdn_layers, VOCAB, name, attention,
                   mesh, mamba=strategy, docs=DOCS)


def _refusals(mesh) -> dict:
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.models.hf.gdn_models import build_gdn

    found = {}
    for label, dims, kwargs, model in [
        ("tp", ParallelDims(tp=2), {}, build_gdn("qwen3_next", k_heads=1, v_heads=2)),  # TP: tensor/test_hf_gdn_tp.py
        ("heads", ParallelDims(cp=2), {}, build_gdn("qwen3_next", v_heads=3, k_heads=1)),
    ]:
        try:
            parallelize(model, dims, mesh=mesh, **kwargs)
            found[label] = None
        except ValueError as error:
            found[label] = str(error)
    return found


def _traffic(mesh) -> dict:
    """Bytes one rank sends through the all-to-all core of one layer (forward, backward) and the formula's."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mixers.gdn import install_gdn_core
    from hybridpar.parallel.comm.collectives import CommStats
    from hybridpar.parallel.context.recurrent.gdn import HiddenParallelGDN, gdn_a2a_bytes_per_layer
    from hybridpar.parallel.context.recurrent.gdn import StatePassingGDN, gdn_state_bytes_per_layer
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from tests.models.hf.gdn_models import build_gdn

    model = build_gdn("qwen3_next", k_heads=1)  # the key head travels twice (Hk_eff = cp)
    install_gdn_core(model)
    layer, group = model.model.layers[0].linear_attn, ParallelDims.group(mesh, "cp")
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    local = shard_inputs(inputs_embeds=torch.zeros(2, DOCS[-1], 1), packed=packed, cp_group=group).packed
    width = 2 * layer.head_k_dim + layer.num_v_heads * layer.head_v_dim
    mixed = torch.randn(2, DOCS[-1] // 2, width, dtype=torch.float64, requires_grad=True)
    a, b = (torch.randn(2, DOCS[-1] // 2, layer.num_v_heads, dtype=torch.float64, requires_grad=True) for _ in range(2))
    with CommStats() as forward:
        out = HiddenParallelGDN(group)(layer, mixed, a, b, local)
    with CommStats() as backward:
        out.sum().backward()
    formula = gdn_a2a_bytes_per_layer(2, DOCS[-1], 2, 1, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, 8)
    with CommStats() as state_forward:
        StatePassingGDN(group)(layer, mixed, a, b, local)
    state_formula = gdn_state_bytes_per_layer(2, len(DOCS) - 1, 2, 1, layer.num_v_heads, layer.head_k_dim,
                                              layer.head_v_dim, layer.conv_kernel_size, 8, 8)
    return {"forward": sum(forward.bytes_sent.values()), "backward": sum(backward.bytes_sent.values()),
            "formula": formula, "state": sum(state_forward.bytes_sent.values()), "state_formula": state_formula}


def _run(rank, world_size) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    mesh = ParallelDims(cp=2).build_mesh()
    results = {case: _case(*case, mesh) for case in CASES}
    results["refused"] = _refusals(mesh)
    results["traffic"] = _traffic(mesh)
    return results


def test_cp2_of_gated_deltanet_models_matches_one_process():
    for rank_results in run_ranks(2, _run, timeout_s=300):
        refused, traffic = rank_results.pop("refused"), rank_results.pop("traffic")
        assert traffic["forward"] == traffic["backward"] == traffic["formula"] > 0, traffic  # gdn.py's formula
        assert traffic["state"] == traffic["state_formula"] > 0, traffic  # gdn_state_bytes_per_layer
        assert "1 key heads (2 value heads) are not divisible by tp=2" in refused["tp"], refused
        assert "splits the 3 value heads" in refused["heads"], refused
        assert all(message and "\n" not in message for message in refused.values())
        for (name, _, _, strategy, _), r in rank_results.items():
            assert r["params"] == r["expected"], name
            assert r["cores"] == {"HiddenParallelGDN" if strategy == "a2a" else "StatePassingGDN"}, (name, r["cores"])
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (name, r)
