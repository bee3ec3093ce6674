"""Context parallelism (cp=2) of transformers' Kimi Linear against one process, float64.

The tiny Kimi Linear of ``tests/models/hf/kda_models.py`` (KDA, MLA + MoE, KDA + MoE; 4 linear heads)
with hybridpar's KDA core (``install_kda_core``); ``parallelize(cp=2)`` installs the all-to-all core
(``parallel/context/recurrent/kda.py``) or the state-passing one (``cp_mamba=state``) and an attention
strategy for the MLA layer. Two rows of three packed documents (4, 12 and 16 tokens, cut across the
ranks in zigzag order); the one-process reference runs the same cores at cp=1
(``tests/models/hf/test_kda_mixers.py`` proves it equals one document per row). The loss and every
parameter gradient agree to 1e-9. Refused in one line before any collective: tp=2 (no plan shards
KDA heads), "a2a" over heads cp does not divide. The bytes both cores send (``comm.CommStats``) are
their formulas.
"""

from __future__ import annotations

import torch

from tests.distributed.context.mixer_cp import cp_case
from tests.distributed.harness import run_ranks

TOL = 1e-9
DOCS = [0, 4, 16, 32]
# (attention strategy for the MLA layer, KDA strategy, chunk of the rule): chunks of 2 put segments across chunks
CASES = [("allgather", "a2a", 8), ("ulysses", "state", 8), ("ring", "state", 2)]


def _case(attention, strategy, chunk, mesh) -> dict:
    from hybridpar.models.hf.mixers.kda import install_kda_core, kda_layers
    from tests.models.hf.kda_models import VOCAB, build_kda

    return cp_case(lambda _: build_kda(chunk=chunk), install_kda_core, kda_layers, VOCAB, "kimi_linear", attention,
                   mesh, mamba=strategy, docs=DOCS)


def _refusals(mesh) -> dict:
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.models.hf.kda_models import build_kda

    found = {}
    for label, dims, kwargs, model in [("tp", ParallelDims(tp=2), {}, build_kda(heads=3)),
                                       ("heads", ParallelDims(cp=2), {"cp_mamba": "a2a"}, build_kda(heads=3))]:
        try:
            parallelize(model, dims, mesh=mesh, **kwargs)
            found[label] = None
        except ValueError as error:
            found[label] = str(error)
    return found


def _traffic(mesh) -> dict:
    """Bytes one rank sends through each core of one layer (forward; a2a also backward) and the formulas'."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mixers.kda import install_kda_core
    from hybridpar.parallel.comm.collectives import CommStats
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.context.recurrent.kda import (HiddenParallelKDA, StatePassingKDA, kda_a2a_bytes_per_layer,
                                                          kda_state_bytes_per_layer)
    from hybridpar.parallel.dims import ParallelDims
    from tests.models.hf.kda_models import build_kda

    model = build_kda()
    install_kda_core(model)
    layer, group = model.model.layers[0].self_attn, ParallelDims.group(mesh, "cp")
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    local = shard_inputs(inputs_embeds=torch.zeros(2, DOCS[-1], 1), packed=packed, cp_group=group).packed
    heads, d, length = layer.num_heads, layer.head_dim, DOCS[-1] // 2
    mixed, f = (torch.randn(2, length, n * heads * d, dtype=torch.float64, requires_grad=True) for n in (3, 1))
    b = torch.randn(2, length, heads, dtype=torch.float64, requires_grad=True)
    with CommStats() as forward:
        out = HiddenParallelKDA(group)(layer, mixed, f, b, local)
    with CommStats() as backward:
        out.sum().backward()
    with CommStats() as state_forward:
        StatePassingKDA(group)(layer, mixed, f, b, local)
    return {"forward": sum(forward.bytes_sent.values()), "backward": sum(backward.bytes_sent.values()),
            "formula": kda_a2a_bytes_per_layer(2, DOCS[-1], 2, heads, d, 8),
            "state": sum(state_forward.bytes_sent.values()),
            "state_formula": kda_state_bytes_per_layer(2, len(DOCS) - 1, 2, heads, d, layer.conv_kernel_size, 8, 8)}


def _run(rank, world_size) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    mesh = ParallelDims(cp=2).build_mesh()
    results = {case: _case(*case, mesh) for case in CASES}
    results["refused"] = _refusals(mesh)
    results["traffic"] = _traffic(mesh)
    return results


def test_cp2_of_kimi_linear_matches_one_process():
    for rank_results in run_ranks(2, _run, timeout_s=300):
        refused, traffic = rank_results.pop("refused"), rank_results.pop("traffic")
        assert traffic["forward"] == traffic["backward"] == traffic["formula"] > 0, traffic
        assert traffic["state"] == traffic["state_formula"] > 0, traffic
        assert "3 heads are not divisible by tp=2" in refused["tp"], refused  # tp by heads: tensor/hf/test_hf_kda_tp.py
        assert "splits its 3 heads over the CP group" in refused["heads"], refused
        assert all(message and "\n" not in message for message in refused.values())
        for (_, strategy, _), r in rank_results.items():
            assert r["params"] == r["expected"], strategy
            assert r["cores"] == {"HiddenParallelKDA" if strategy == "a2a" else "StatePassingKDA"}, r["cores"]
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (strategy, r)
