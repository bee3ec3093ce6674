"""Tensor-parallel all-reduces of the whole hidden state per step, through the real plans (tp=2, no SP).

Without sequence parallelism a TP block reads the replicated ``[T, D]`` residual stream through its
column-parallel projections, whose input gradients are partial sums over TP. The ideal is one
all-reduce of that ``[T, D]`` gradient per norm output, however many projections, mixers and routers
read it (they add up as one ``Partial`` DTensor), plus the LM head's input: ``IDEAL`` (= the forward's
count: one row-parallel exit per block, plus the vocab-parallel embedding). ``measure(name)`` runs one
row of two packed documents (13 and 24 tokens: ``T = 37``, a size no parameter has) through
``parallelize`` at tp=2 on gloo, counts every collective with ``CommStats`` and keeps the all-reduces of
``T x D`` elements, forward and backward apart. ``benchmarks/tp_collectives.py`` tabulates every model
against the plans before; the test holds one model per plan family to the ideal in backward, and the
forward to its count. Before, only the Llama-family plans, Bamba and dense NemotronH were there: q, k,
v, gate, up, a MoE block's experts and shared experts each all-reduced their own ``[T, D]`` input
gradient (Falcon-H1: 13 per step where 5 suffice, Qwen2-MoE 13, OLMo2 11 where 5), and a MoE block's
experts and shared experts their own output (Qwen2-MoE: 7 forward where 5).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks

DOCS = [0, 13, 37]  # T = 37 tokens
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


def measure(name: str, mesh) -> dict:
    """One step of ``name`` at tp=2 without SP: ``[T, D]`` all-reduces (and their bytes) forward and backward."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.comm.stats import CommStats
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.train.trainer import pack_loss_sum

    model = build(name)
    parallelize(model, ParallelDims(tp=2), mesh=mesh, sequence_parallel=False)
    vocab = model.get_input_embeddings().num_embeddings
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, vocab, (1, DOCS[-1]), generator=gen) for _ in range(2))
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    inputs = shard_inputs(input_ids=ids, labels=labels, packed=packed, tp_group=ParallelDims.group(mesh, "tp"))
    with CommStats(mesh) as forward:
        loss = pack_loss_sum(model, inputs)[0]
    with CommStats(mesh) as backward:
        loss.backward()
    size = DOCS[-1] * hidden * 8  # float64 [T, D]; an all-reduce over 2 ranks sends 2(P-1)/P x its buffer
    out = {"hidden": hidden, "tokens": DOCS[-1], "ideal": IDEAL[name][1]}
    for phase, stats in (("forward", forward), ("backward", backward)):  # [T, D] (Zamba2's block: [T, 2D])
        whole = [r for r in stats.records if r.kind == "all_reduce" and r.dim == "tp" and r.nbytes % size == 0]
        out[phase] = len(whole)
        out[f"{phase}_bytes"] = sum(r.nbytes for r in whole)
        out[f"{phase}_all_collectives"] = len(stats.records)
        out[f"{phase}_all_bytes"] = stats.total_bytes
    return out


def _run(rank: int, world_size: int, names: list[str]) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    mesh = ParallelDims(tp=2).build_mesh()
    return {name: measure(name, mesh) for name in names}


def counts(names: list[str], timeout_s: int = 600) -> dict:
    """``measure`` of every model in ``names`` on 2 gloo ranks (rank 0's counts)."""
    return run_ranks(2, _run, names, timeout_s=timeout_s)[0]


# one model per plan family (before: 9, 13, 11, 13, 12, 5, 8, 12, 10, 13 against 5, 5, 5, 5, 7, 4, 6, 7, 7, 9)
HELD = ["mixtral", "qwen2_moe", "olmo2", "falcon_h1", "granite_moe", "nemotron_h_moe", "zamba2", "qwen3_next",
        "lfm2_moe", "jamba"]


@pytest.fixture(scope="module")
def held_counts():
    return counts(HELD, timeout_s=300)


# the forward's all-reduces past the ideal: two branches of one norm that leave their layer apart (Falcon-H1's
# attention and Mamba2, Granite 4.0-H's MoE block and shared MLP), one each per layer
FORWARD_APART = {"falcon_h1": 2, "granite_moe": 3}


@pytest.mark.parametrize("name", HELD)
def test_one_whole_hidden_all_reduce_per_norm_output_in_backward(held_counts, name):
    got = held_counts[name]
    assert got["backward"] == got["ideal"], (name, got)
    # forward: one per block exit (a MoE block sums its experts' and shared experts' partial terms first)
    assert got["forward"] == got["ideal"] + FORWARD_APART.get(name, 0), (name, got)
