"""Every collective of a training step is counted, and each total equals its closed form.

One training step (forward and backward of every pack, clipping, AdamW) of the default job
(tiny model, float32) runs under ``CommStats`` on real gloo ranks for cp=2, tp=2 (sequence
parallel and not), dp_shard=2 (FSDP with two packs per rank), cp=2 with the other CP
strategies, and tp=2 x cp=2 on 4 ranks. Per layout:

- the calls and bytes per (kind, mesh dim) equal the sum of ``step_comm``'s sources, and a
  mismatch prints each source's share (``step_comm``'s docstring lists them);
- the number of collectives counted equals the number gloo ran (``torch.profiler``'s
  ``gloo:*`` events, an observer below the dispatcher, read from its raw kineto events), so
  none escapes the count;
- FSDP reduce-scatters once per parameter group per step although every rank runs 2 packs
  (counted directly at dp_shard=2, where FSDP's are the only reduce-scatters).
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks

DEFAULT = str(Path(__file__).resolve().parents[3] / "configs" / "tiny-hybrid.yaml")
BASE = ["model.preset=tiny", "data.pack_size=128", "train.eval_every=0", "checkpoint.every=-1", "tensorboard=false", "plot=false"]
LAYOUTS = {  # name -> (world size, overrides)
    "cp2": (2, ["parallel.cp=2", "parallel.tp=1", "data.packs_per_step=2"]),
    "cp2_ulysses_state": (2, ["parallel.cp=2", "parallel.tp=1", "data.packs_per_step=2",
                              "parallel.cp_attention=ulysses", "parallel.cp_mamba=state"]),
    "tp2": (2, ["parallel.cp=1", "parallel.tp=2", "data.packs_per_step=2"]),
    "tp2_no_sp": (2, ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=false", "data.packs_per_step=2"]),
    "dp_shard2": (2, ["parallel.cp=1", "parallel.tp=1", "parallel.dp_shard=2", "data.packs_per_step=4"]),
    "tp2_cp2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "data.packs_per_step=2"]),
}


def step_shape(trainer):
    """The closed forms' view of the trainer's first step."""
    from hybridpar.parallel.comm.step import StepShape
    from hybridpar.train.trainer import pack_tensors

    config, dims = trainer.config, trainer.layout.dims
    packs = trainer.train_data.rank_packs(0, trainer.layout.dp_rank, dims.size("dp"))
    docs = tuple(pack_tensors(p, torch.device("cpu"))[2].cu_seqlens_padded.numel() - 1 for p in packs)
    p = config.parallel
    return StepShape(trainer.model.config, dims, config.data.pack_size, len(packs), 4, p.sequence_parallel,
                     p.cp_attention, p.cp_mamba, p.reshard_after_forward, docs)


def counted_step(rank: int, world_size: int, overrides: list) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.profiler import ProfilerActivity, profile

    from hybridpar.config import load_config
    from hybridpar.parallel.comm.stats import CommStats
    from hybridpar.parallel.comm.step import step_collectives
    from hybridpar.train.trainer import Trainer

    trainer = Trainer(load_config(DEFAULT, BASE + overrides + ["output_dir=unused"]), torch.device("cpu"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with CommStats(trainer.layout.mesh) as stats:
            trainer.train_step(0)
    # The raw kineto events, as train/tensor_peak.py reads them: the same gloo:* events as
    # prof.events(), without building its FunctionEvent tree (3-6 s a layout on this machine).
    gloo = sum(1 for event in prof.profiler.kineto_results.events() if event.name().startswith("gloo:"))
    groups = sum(len(m._get_fsdp_state()._fsdp_param_groups) for m in trainer.model.modules() if isinstance(m, FSDPModule))
    return {
        "calls": stats.calls_by_dim(), "bytes": stats.by_dim(), "counted": len(stats.records), "gloo": gloo,
        "ops": collections.Counter(r.op for r in stats.records),
        "sources": {name: dict(t) for name, t in step_collectives(step_shape(trainer)).items()},
        "fsdp_groups": groups, "packs": step_shape(trainer).packs_per_rank,
    }


def run_layouts(rank: int, world_size: int, names: list) -> dict:
    return {name: counted_step(rank, world_size, LAYOUTS[name][1]) for name in names}


@pytest.fixture(scope="module")
def measured() -> dict:
    out = {}
    for world_size in sorted({w for w, _ in LAYOUTS.values()}):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world_size]
        for rank, result in enumerate(run_ranks(world_size, run_layouts, names, timeout_s=900)):
            for name, value in result.items():
                out[name, rank] = value
    return out


def _expected(sources: dict) -> tuple[dict, dict]:
    calls, nbytes = collections.Counter(), collections.Counter()
    for tally in sources.values():
        for key, (c, b) in tally.items():
            calls[key] += c
            nbytes[key] += b
    return dict(calls), dict(nbytes)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_step_collectives_equal_their_closed_forms(measured, name):
    for rank in range(LAYOUTS[name][0]):
        got = measured[name, rank]
        calls, nbytes = _expected(got["sources"])
        shares = "\n".join(f"  {source}: {dict(tally)}" for source, tally in got["sources"].items() if tally)
        assert got["calls"] == calls, f"rank {rank} calls {got['calls']} != {calls}; closed forms by source:\n{shares}"
        assert got["bytes"] == nbytes, f"rank {rank} bytes {got['bytes']} != {nbytes}; closed forms by source:\n{shares}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_collective_gloo_runs_is_counted(measured, name):
    for rank in range(LAYOUTS[name][0]):
        got = measured[name, rank]
        assert got["counted"] == got["gloo"] > 0, (rank, got["ops"])


def test_fsdp_reduces_once_per_parameter_group_per_step(measured):
    """dp_shard=2, two packs per rank: FSDP is the only reduce-scatter, one per group."""
    for rank in range(2):
        got = measured["dp_shard2", rank]
        assert got["packs"] == 2 and got["fsdp_groups"] == 6  # 5 blocks and the root
        assert got["ops"]["c10d::_reduce_scatter_base_"] == got["fsdp_groups"], got["ops"]
        assert got["calls"]["reduce_scatter", "dp_shard"] == got["fsdp_groups"]


def test_tp2_x_cp2_step_uses_every_kind_on_both_dims(measured):
    """The layout the issue names: DTensor's TP/SP traffic, FSDP's and CP's all appear."""
    kinds = set(measured["tp2_cp2", 0]["bytes"])
    assert {("all_gather", "tp"), ("reduce_scatter", "tp"), ("all_reduce", "tp"), ("all_gather", "cp"),
            ("reduce_scatter", "cp"), ("all_to_all", "cp"), ("all_reduce", "cp")} <= kinds, kinds


# ------------------------------------------------------------------- in-process (no ranks)


@pytest.mark.parametrize("overrides", [{}, dict(mlp_gated=True, mlp_bias=True, attention_bias=True, mamba_proj_bias=True,
                                                use_conv_bias=False, tie_word_embeddings=True)])
def test_closed_forms_list_every_parameter_of_the_model(overrides):
    """FSDP's and clipping's closed forms read the parameter list of ``unit_parameters``."""
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.parallel.comm.step import unit_parameters
    from hybridpar.parallel.tensor.hybrid import split_mamba_mixers

    config = HybridConfig.from_preset("tiny", **overrides)
    model = HybridLM(config)
    split_mamba_mixers(model)
    listed = {p.name: p.shape for params in unit_parameters(config).values() for p in params}
    assert listed == {name: tuple(p.shape) for name, p in model.named_parameters()}
