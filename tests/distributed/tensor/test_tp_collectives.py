"""Tensor-parallel collectives of the whole hidden state per step, through the real plans (tp=2, with and without SP).

Without sequence parallelism a TP block reads the replicated ``[T, D]`` residual stream through its
column-parallel projections, whose input gradients are partial sums over TP. The ideal is one
all-reduce of that ``[T, D]`` gradient per norm output, however many projections, mixers and routers
read it (they add up as one ``Partial`` DTensor), plus the LM head's input: ``IDEAL``. The forward's
ideal is the same count: one all-reduce per norm's blocks (branches added in one layer are reduced once,
``SummedBranchesLayer``), plus the vocab-parallel embedding. Under sequence parallelism the same ideal
holds for the reduce-scatters (forward: one per norm's blocks, plus the embedding; backward: one per
all-gathered norm output, plus the LM head), with no whole all-reduce.

``measure(name)`` runs one row of two packed documents (13 and 24 tokens: ``T = 37``, a size no parameter
has; under SP 13 and 25, ``T = 38``) through ``parallelize`` at tp=2 on gloo, counts every collective with
``CommStats`` and keeps the all-reduces, reduce-scatters and all-gathers of the whole hidden state, forward
and backward apart. ``benchmarks/tp_collectives.py`` tabulates every model against the plans before; the
test holds one model per plan family to the ideal both ways without SP, and three layers with two added
branches under SP. Before: q, k, v, gate, up, a MoE block's experts and shared experts each all-reduced
their own ``[T, D]`` input gradient (Falcon-H1: 13 per step where 5 suffice, Qwen2-MoE 13, OLMo2 11 where
5); two branches added in one layer were reduced apart in the forward (Falcon-H1's attention and Mamba2:
7 where 5, Granite 4.0-H's MoE block and shared MLP: 10 where 7, Phi's attention and MLP: 5 where 3; under
SP as many reduce-scatters, and Granite's MoE blocks all-reduced theirs).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks

DOCS = [0, 13, 37]  # T = 37 tokens
DOCS_SP = [0, 13, 38]  # under SP T splits evenly over tp=2
# model -> (family, [T, D] all-reduces in backward at the ideal: one per norm feeding a TP block, + LM head)
IDEAL = {
    "llama": ("hf", 5), "olmo2": ("hf", 5), "olmo3": ("hf", 5), "exaone4": ("hf", 5),
    "unregistered_llama": ("hf", 5), "arcee": ("hf", 5), "phi": ("hf", 3), "cohere": ("hf", 3),  # default, hf plans
    "mixtral": ("hf", 5), "qwen2_moe": ("hf", 5), "qwen3_moe": ("hf", 5), "gpt_oss": ("hf", 5),
    "bamba": ("hybrid", 5), "nemotron_h": ("hybrid", 4), "nemotron_h_moe": ("hybrid", 4),
    "falcon_h1": ("hybrid", 5), "granite": ("hybrid", 7), "granite_moe": ("hybrid", 7), "zamba2": ("hybrid", 6),
    "qwen3_next": ("gdn", 7), "qwen3_5_moe": ("gdn", 7), "olmo_hybrid": ("gdn", 7),
    "lfm2": ("lfm", 7), "lfm2_moe": ("lfm", 7), "lfm3": ("lfm", 9),
    "mamba": ("mamba1", 3), "falcon_mamba": ("mamba1", 3), "jamba": ("mamba1", 9),
}


def build(name: str):
    """The tiny float64 model ``name`` of its family, on hybridpar's cores and attention."""
    from hybridpar.parallel.context.hf import use_hybridpar_attention

    family = IDEAL[name][0]
    if family == "hf":
        from tests.distributed.tensor.hf_models import build_model
        model = build_model(name)
    elif family == "hybrid":
        from hybridpar.models.hf.mixers.mamba2 import install_mamba_core
        from tests.models.hf.hybrid_models import build_hybrid
        model = build_hybrid(name)
        install_mamba_core(model)
    elif family == "gdn":
        from hybridpar.models.hf.mixers.gdn import install_gdn_core
        from tests.models.hf.gdn_models import build_gdn
        model = build_gdn(name)
        install_gdn_core(model)
    elif family == "lfm":
        from hybridpar.models.hf.mixers.short_conv import install_short_conv
        from tests.models.hf.lfm_models import build_lfm
        model = build_lfm(name)
        install_short_conv(model)
    else:
        from hybridpar.models.hf.mixers.mamba1 import install_mamba1_core
        from tests.models.hf.mamba1_models import build_mamba1
        model = build_mamba1(name)
        install_mamba1_core(model)
    return use_hybridpar_attention(model)


WHOLE = ("all_reduce", "reduce_scatter", "all_gather")


def measure(name: str, mesh, sequence_parallel: bool = False) -> dict:
    """One step of ``name`` at tp=2: the whole-hidden-state all-reduces, reduce-scatters and all-gathers (and
    their bytes) over TP, forward and backward apart; every collective (any size) as ``*_all_collectives``."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.comm.stats import CommStats
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.train.trainer import pack_loss_sum

    docs = DOCS_SP if sequence_parallel else DOCS
    model = build(name)
    parallelize(model, ParallelDims(tp=2), mesh=mesh, sequence_parallel=sequence_parallel)
    vocab = model.get_input_embeddings().num_embeddings
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, vocab, (1, docs[-1]), generator=gen) for _ in range(2))
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(docs, dtype=torch.int32))
    inputs = shard_inputs(input_ids=ids, labels=labels, packed=packed, tp_group=ParallelDims.group(mesh, "tp"),
                          sequence_parallel=sequence_parallel)
    with CommStats(mesh) as forward:
        loss = pack_loss_sum(model, inputs)[0]
    with CommStats(mesh) as backward:
        loss.backward()
    # bytes one rank sends at P = 2 (CommStats): all-reduce of [T, D] T D 8; reduce-scatter of [T, D] and
    # all-gather of [T/2, D] T D 4, so [T/2, D] float64 is the unit (Zamba2's shared block: [T, 2D])
    unit = docs[-1] * hidden * 8 // (2 if sequence_parallel else 1)
    out = {"hidden": hidden, "tokens": docs[-1], "ideal": IDEAL[name][1], "sequence_parallel": sequence_parallel}
    for phase, stats in (("forward", forward), ("backward", backward)):
        whole = [r for r in stats.records if r.kind in WHOLE and r.dim == "tp" and r.nbytes % unit == 0]
        out[phase] = {kind: sum(r.kind == kind for r in whole) for kind in WHOLE}
        out[f"{phase}_bytes"] = sum(r.nbytes for r in whole)
        out[f"{phase}_all_collectives"] = len(stats.records)
        out[f"{phase}_all_bytes"] = stats.total_bytes
    return out


def _run(rank: int, world_size: int, names: list[str], sequence_parallel: bool) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    mesh = ParallelDims(tp=2).build_mesh()
    out = {}
    for name in names:
        try:
            out[name] = measure(name, mesh, sequence_parallel)
        except ValueError as err:  # a plan that refuses the layout (Hugging Face's own has no SP), before any collective
            out[name] = {"refused": str(err)[:200]}
    return out


def counts(names: list[str], timeout_s: int = 600, sequence_parallel: bool = False) -> dict:
    """``measure`` of every model in ``names`` on 2 gloo ranks (rank 0's counts)."""
    return run_ranks(2, _run, names, sequence_parallel, timeout_s=timeout_s)[0]


# one model per plan family (backward before: 9, 13, 11, 13, 12, 5, 8, 12, 10, 13, 3 against 5, 5, 5, 5, 7, 4, 6, 7, 7,
# 9, 3; forward before: Qwen2-MoE 7, Falcon-H1 7, Granite 4.0-H MoE 10, NemotronH-MoE 5, Phi 5)
HELD = ["mixtral", "qwen2_moe", "olmo2", "falcon_h1", "granite_moe", "nemotron_h_moe", "zamba2", "qwen3_next",
        "lfm2_moe", "jamba", "phi"]
# layers whose two branches are added (SummedBranchesLayer), under SP (forward reduce-scatters before: 5, 7, 7; Granite's
# MoE blocks all-reduced 3 more); MoE blocks reduce-scattered at their exit (reduce-scatters / all-reduces before, forward:
# Mixtral 3/2, Qwen2-MoE 3/4, Jamba 7/2; backward: Mixtral 3/2, Qwen2-MoE 3/6, Jamba 7/2)
HELD_SP = ["phi", "falcon_h1", "granite_moe", "mixtral", "qwen2_moe", "jamba"]


@pytest.fixture(scope="module")
def held_counts():
    return counts(HELD, timeout_s=300)


@pytest.fixture(scope="module")
def held_sp_counts():
    return counts(HELD_SP, timeout_s=300, sequence_parallel=True)


@pytest.mark.parametrize("name", HELD)
def test_one_whole_hidden_all_reduce_per_norm_output_each_way(held_counts, name):
    got = held_counts[name]
    assert "refused" not in got, got
    assert got["backward"]["all_reduce"] == got["ideal"], (name, got)
    # forward: one per norm's blocks (branches added in one layer, a MoE block's experts and shared experts are
    # summed first), plus the embedding
    assert got["forward"]["all_reduce"] == got["ideal"], (name, got)


@pytest.mark.parametrize("name", HELD_SP)
def test_one_reduce_scatter_per_norm_output_under_sequence_parallelism(held_sp_counts, name):
    got = held_sp_counts[name]
    assert "refused" not in got, got
    assert got["forward"] == {**got["forward"], "all_reduce": 0, "reduce_scatter": got["ideal"]}, (name, got)
    assert got["backward"]["all_reduce"] == 0 and got["backward"]["reduce_scatter"] == got["ideal"], (name, got)
