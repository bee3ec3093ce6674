"""One gradient reduction per optimizer step, whatever FSDP's resharding: same gradients.

``Trainer.step_gradients`` accumulates over the packs of a rank; ``fsdp.set_micro_batch`` lets
FSDP reduce only after the last one. On 4 gloo ranks, float64, two packs per rank, for
dp_shard=4, HSDP 2x2, dp_shard=2 x tp=2 (sequence parallel) and dp_shard=2 x cp=2 with
``reshard_after_forward`` true, false and 2:

- the loss and every gradient equal the single-process step's (``train/proof/layout.reference_step``,
  run once per distinct set of step packs) to 1e-9 and the previous behaviour's (FSDP reducing
  after every pack) to 1e-12;
- FSDP reduce-scatters once per parameter group per step (before: once per pack), HSDP
  all-reduces once per group per step; with ``reshard_after_forward=false`` every unit is
  all-gathered once per step, otherwise blocks twice per pack (counted with ``CommStats``).

``reshard_after_forward`` and ``compile`` values that cannot work raise ``ValueError`` first.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks

DEFAULT = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")
BASE = ["model.preset=tiny", "model.dtype=float64", "data.pack_size=64", "data.task_options.min_len=16", "data.task_options.max_len=48",
        "train.eval_every=0", "checkpoint.every=-1", "tensorboard=false", "plot=false", "output_dir=unused",
        "parallel.sequence_parallel=false", "parallel.reshard_after_forward=true"]
LAYOUTS = {
    "dp_shard4": ["parallel.dp_shard=4", "parallel.cp=1", "parallel.tp=1", "data.packs_per_step=8"],
    "hsdp2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.cp=1", "parallel.tp=1",
                "data.packs_per_step=8"],
    "dp_shard2_tp2_sp": ["parallel.dp_shard=2", "parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                         "data.packs_per_step=4"],
    "dp_shard2_cp2": ["parallel.dp_shard=2", "parallel.cp=2", "parallel.tp=1", "data.packs_per_step=4"],
    "dp_shard2_cp2_keep_gathered": ["parallel.dp_shard=2", "parallel.cp=2", "parallel.tp=1", "data.packs_per_step=4",
                                    "parallel.reshard_after_forward=false"],
    "dp_shard2_cp2_reshard_to_2": ["parallel.dp_shard=2", "parallel.cp=2", "parallel.tp=1", "data.packs_per_step=4",
                                   "parallel.reshard_after_forward=2"],
}
UNITS = 6  # five blocks and the root


def _per_pack_reduction(trainer, step: int) -> torch.Tensor:
    """The previous ``step_gradients``: FSDP reduces after every pack's backward."""
    from hybridpar.train.loss import global_sum, valid_token_count

    packs = trainer.train_data.rank_packs(step, trainer.layout.dp_rank, trainer.layout.dims.size("dp"))
    count = global_sum(sum(valid_token_count(p["labels"]) for p in packs), trainer.layout.dp_group)
    total = torch.zeros((), dtype=torch.float64)
    for pack in packs:
        loss_sum, _, _ = trainer.forward_loss_sum(pack)
        (loss_sum / count).backward()
        total += loss_sum.detach().double()
    return global_sum(total, trainer.layout.dp_cp_group) / count


def _gradients_and_counts(overrides: list, per_pack: bool) -> dict:
    from hybridpar.config import load_config
    from hybridpar.parallel.comm.stats import CommStats
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.trainer import Trainer

    trainer = Trainer(load_config(DEFAULT, BASE + overrides), torch.device("cpu"))
    with CommStats(trainer.layout.mesh) as stats:
        loss = _per_pack_reduction(trainer, 0) if per_pack else trainer.step_gradients(0)
    packs = trainer.train_data.rank_packs(0, trainer.layout.dp_rank, trainer.layout.dims.size("dp"))
    return {"loss": loss, "grads": canonical_state_dict(trainer.model, grads=True), "calls": stats.calls_by_dim(),
            "ops": {r.op: sum(1 for q in stats.records if q.op == r.op) for r in stats.records},
            "packs": len(packs), "step_packs": trainer.train_data.step_packs(0)}


def accumulation_checks(rank: int, world_size: int) -> dict:
    from hybridpar.config import load_config
    from hybridpar.train.proof.layout import reference_step
    from hybridpar.train.trainer import build_model

    results, references = {}, {}
    for name, overrides in LAYOUTS.items():
        new = _gradients_and_counts(overrides, per_pack=False)
        old = _gradients_and_counts(overrides, per_pack=True)
        packs_key = pickle.dumps(new["step_packs"])  # the same model and packs: the same single-process step
        if packs_key not in references:
            reference = build_model(load_config(DEFAULT, BASE + overrides))
            references[packs_key] = (reference_step(reference, new["step_packs"], torch.device("cpu")),
                                     {n: p.grad for n, p in reference.named_parameters()})
        ref_loss, ref_grads = references[packs_key]

        def error(grads, want):
            return max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1.0)).item() for n, g in want.items())

        results[name] = {
            "vs_reference": max(error(new["grads"], ref_grads), abs(float(new["loss"] - ref_loss))),
            "vs_per_pack": max(error(new["grads"], old["grads"]), abs(float(new["loss"] - old["loss"]))),
            "per_pack_vs_reference": error(old["grads"], ref_grads),
            "packs": new["packs"], "calls": new["calls"], "calls_per_pack": old["calls"],
        }
    return results


@pytest.fixture(scope="module")
def accumulation():
    return run_ranks(4, accumulation_checks, timeout_s=900)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gradients_equal_single_process_and_per_pack_reduction(accumulation, name):
    for rank, results in enumerate(accumulation):
        got = results[name]
        assert got["packs"] == 2, got["packs"]
        assert got["vs_reference"] < 1e-9, (rank, got)
        assert got["per_pack_vs_reference"] < 1e-9, (rank, got)
        assert got["vs_per_pack"] < 1e-12, (rank, got)


def _fsdp_dim(name: str) -> str:
    return {"dp_shard4": "dp_shard", "hsdp2x2": "dp_shard", "dp_shard2_tp2_sp": "dp_shard"}.get(name, "dp_shard+cp")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_reduce_scatter_per_group_and_step(accumulation, name):
    """Counted on FSDP's own dim: no other source reduce-scatters there (CP's are on cp alone)."""
    for results in accumulation:
        got = results[name]
        assert got["calls"][("reduce_scatter", _fsdp_dim(name))] == UNITS, got["calls"]
        assert got["calls_per_pack"][("reduce_scatter", _fsdp_dim(name))] == UNITS * got["packs"]


def test_hsdp_all_reduces_once_per_group_and_step(accumulation):
    for results in accumulation:
        assert results["hsdp2x2"]["calls"][("all_reduce", "dp_replicate")] == UNITS
        assert results["hsdp2x2"]["calls_per_pack"][("all_reduce", "dp_replicate")] == UNITS * 2


def test_reshard_after_forward_sets_the_all_gathers(accumulation):
    """Blocks: 2 per pack when resharding (to the whole group, or to groups of 2 for the
    backward's gather) and the root 1 per pack; every unit once per step when kept gathered."""
    blocks, packs = UNITS - 1, 2
    for results in accumulation:
        assert results["dp_shard2_cp2"]["calls"][("all_gather", "dp_shard+cp")] == 2 * packs * blocks + packs
        assert results["dp_shard2_cp2_keep_gathered"]["calls"][("all_gather", "dp_shard+cp")] == UNITS
        resharded = results["dp_shard2_cp2_reshard_to_2"]["calls"]
        assert resharded[("all_gather", "dp_shard+cp")] == packs * blocks + packs
        # groups of 2 along cp; CP attention's all-gather of k, v (one layer) runs there too
        assert resharded[("all_gather", "cp")] == packs * blocks + packs * 1, resharded


# ------------------------------------------------------------------- in-process (no ranks)


@pytest.mark.parametrize("value, dims, message", [
    (3, dict(dp_shard=2, cp=2), "neither a bool nor a divisor of the FSDP shard size dp_shard*cp = 4"),
    (0, dict(dp_shard=2), "one of [1, 2]"),
    ("yes", dict(dp_shard=2), "reshard_after_forward='yes'"),
    (2, dict(tp=2), "does not use FSDP"),
])
def test_bad_reshard_after_forward_is_refused_before_anything_runs(value, dims, message):
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import validate_parallelize

    with pytest.raises(ValueError) as error:
        validate_parallelize(HybridLM(HybridConfig()), ParallelDims(**dims), reshard_after_forward=value)
    assert message in str(error.value)


def test_reshard_after_forward_values_fsdp_takes():
    from hybridpar.parallel.data.fsdp import check_reshard_after_forward

    assert [check_reshard_after_forward(v, 4) for v in (True, False, 1, 2, 4)] == [True, False, False, 2, True]


def test_bad_compile_settings_are_refused():
    import torch.nn as nn

    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import validate_parallelize

    with pytest.raises(ValueError, match="compile backend 'fast' is unknown"):
        validate_parallelize(HybridLM(HybridConfig()), ParallelDims(), compile="fast")
    with pytest.raises(ValueError, match="compile=3 must be"):
        validate_parallelize(HybridLM(HybridConfig()), ParallelDims(), compile=3)
    with pytest.raises(ValueError, match="module list of blocks; compile works on those"):
        validate_parallelize(nn.Linear(2, 2), ParallelDims(), compile=True)
