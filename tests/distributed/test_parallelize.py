"""``parallelize()`` on 8 gloo ranks: a whole ``HybridLM`` under data, context, tensor and
sequence parallelism together, against the single-process model.

One 8-rank group runs three layouts, each for 2 AdamW steps: a step on dense batches (B=2 per
data-parallel rank), then one on packed rows, whose gradients and update see the first step's
AdamW state (every data-parallel rank reads its own batch; the reference trains on all of them
at once; one model per layout for both kinds halves the group's parallelize calls and steps):

- ``dp_shard=2, cp=2, tp=2``          FSDP over dp_shard x cp, TP, CP allgather + a2a;
- ``dp_replicate=2, cp=2, tp=2, SP``  HSDP, TP with sequence parallel, CP ulysses + state;
- ``dp_replicate=2, dp_shard=2, tp=2`` HSDP + TP, with activation checkpointing.

At every step the float64 loss and every full parameter gradient (``canonical_state_dict``)
equal the single-process model's to 1e-9, and after every step so do the parameters. The same
group checks that a head count that divides tp but not tp*cp raises ``ValueError`` before
anything is sharded. The reference runs in the pytest process, once per data-parallel size.
"""

from __future__ import annotations

import copy

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.context.test_model import KINDS, build_model, compare, distributed_run, make_batch, reference_run
from tests.distributed.tensor.test_hybrid import mamba_layout_problems

LR = 1e-2  # one step per batch kind (KINDS: dense, then packed); the second sees the first's AdamW state
# name -> (ParallelDims kwargs, parallelize kwargs)
LAYOUTS = {
    "dp_shard2-cp2-tp2": (dict(dp_shard=2, cp=2, tp=2), dict(cp_attention="allgather", cp_mamba="a2a")),
    "dp_rep2-cp2-tp2-sp": (dict(dp_replicate=2, cp=2, tp=2),
                           dict(cp_attention="ulysses", cp_mamba="state", sequence_parallel=True)),
    "dp_rep2-dp_shard2-tp2-ac": (dict(dp_replicate=2, dp_shard=2, tp=2), dict(activation_checkpointing=True)),
}


def data_parallel_size(dims: dict) -> int:
    return dims.get("dp_replicate", 1) * dims.get("dp_shard", 1)


def batches_for(dims: dict) -> list[list]:
    """Per step (one per batch kind), one batch per data-parallel rank."""
    return [[make_batch(kind, seed=20 + d) for d in range(data_parallel_size(dims))] for kind in KINDS]


def parallelize_worker(rank: int, world_size: int) -> dict | None:
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.data.fsdp import parameter_layouts
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict, load_canonical_state_dict

    base = build_model()
    results = {}
    for name, (dims_kwargs, options) in LAYOUTS.items():
        dims = ParallelDims(**dims_kwargs)
        mesh = dims.build_mesh()
        model = parallelize(copy.deepcopy(base), dims, mesh=mesh, **options)
        results[name] = distributed_run(model, mesh, batches_for(dims_kwargs), lr=LR,
                                        sequence_parallel=options.get("sequence_parallel", False))
        results[(name, "layouts")] = parameter_layouts(model)
        state = {n: p.detach() * 1.5 + 0.25 for n, p in build_model(seed=3).named_parameters()}
        load_canonical_state_dict(model, state)  # full tensors into FSDP x TP shards, read back
        back = canonical_state_dict(model)
        results[(name, "load")] = (set(back) == set(state), max((back[n] - state[n]).abs().max().item() for n in state))
        if name == "dp_shard2-cp2-tp2":  # 2 heads, 2 groups: divisible by tp=2, but a2a needs (heads/tp) % cp == 0
            bad = build_model(mamba_num_heads=2, mamba_n_groups=2)
            try:
                parallelize(bad, dims, mesh=mesh, cp_mamba="a2a")
                results["tp*cp error"] = None
            except ValueError as error:
                results["tp*cp error"] = (str(error), bad.backbone.layers[0].mixer.in_proj.__class__.__name__)
    return results if rank == 0 else None


@pytest.mark.timeout(900)
def test_parallelize_8_ranks_matches_single_process_over_adamw_steps():
    results = run_ranks(8, parallelize_worker, timeout_s=800)[0]
    failures, references = [], {}
    for name, (dims_kwargs, _) in LAYOUTS.items():
        assert len(results[name]) == len(KINDS), name
        dp = data_parallel_size(dims_kwargs)  # the same batches, model and steps: one reference per dp size
        if dp not in references:
            references[dp] = reference_run(build_model(), batches_for(dims_kwargs), lr=LR)
        reference = references[dp]
        failures += compare(f"{name} ({' then '.join(KINDS)})", results[name], reference)
    assert not failures, "\n".join(failures[:40])

    for name in LAYOUTS:  # TP layouts are read through FSDP's 2-D/3-D DTensors; full states load into shards
        assert not mamba_layout_problems(results[(name, "layouts")]), name
        assert results[(name, "load")] == (True, 0.0), name

    assert results["tp*cp error"] is not None, "mamba heads 2 at tp=2, cp=2 with a2a did not raise"
    message, in_proj_class = results["tp*cp error"]
    assert "not divisible by cp=2" in message and "tp=2" in message and "backbone.layers.0.mixer" in message
    assert in_proj_class == "Linear", "the model was changed before the error"
