"""Packed tensor-parallel weights in a DCP checkpoint (``parallel/packed_checkpoint.py``).

A ``[4, 12, 6]`` weight packing three parts on dim 1 (``[q | k | v]``), sharded ``_StridedShard(1, 3)``
over tp=2 and ``Shard(0)`` over dp=2 (FSDP's dim), is saved with its optimizer-like state on 4 ranks.
It loads exactly at tp=4 (a different slicing of each part), on one process into plain tensors,
and a plain one-process save loads back into the strided layout: the checkpoint is the one one
process would write. FSDP2's own strided shard over TP's (``_StridedShard(0)`` then ``Shard(0)``)
is left to DCP. Values DCP sets in the state dict (a param group's ``lr``) stay set after the block.
"""

from __future__ import annotations

import torch

from tests.distributed.harness import run_ranks

SHAPE = (4, 12, 6)


def _full(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _state(mesh, placements, fill=None):
    from torch.distributed.tensor import distribute_tensor

    def tensor(seed):
        return distribute_tensor(_full(seed) if fill is None else torch.full(SHAPE, fill, dtype=torch.float64), mesh,
                                 placements)

    return {"model": {"w": tensor(0)}, "optim": {"state": {"w": {"exp_avg": tensor(1), "step": torch.tensor(3.0)}},
                                                  "param_groups": [{"lr": 0.5 if fill is None else 0.0, "params": ["w"]}]}}


def _ranks(rank, world_size, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from hybridpar.parallel.packed_checkpoint import PackedShards, _packing, packed_shards

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    packed = (Shard(0), _StridedShard(1, split_factor=3))
    state = _state(mesh, packed)
    with packed_shards(state):
        assert isinstance(state["model"]["w"], PackedShards) and len(state["model"]["w"]._boxes) == 3
        dcp.save(state, checkpoint_id=f"{root}/dp2_tp2")
    fsdp_over_tp = _state(mesh, (_StridedShard(0, split_factor=2), Shard(0)))["model"]["w"]
    out = {"restored": not isinstance(state["model"]["w"], PackedShards), "fsdp_left_to_dcp": _packing(fsdp_over_tp) is None}

    tp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    for name, mesh_, placements in (("tp4", tp4, (_StridedShard(1, split_factor=3),)), ("dp2_tp2", mesh, packed)):
        source = "dp2_tp2" if name == "tp4" else "one"
        loaded = _state(mesh_, placements, fill=0.0)
        with packed_shards(loaded):
            dcp.load(loaded, checkpoint_id=f"{root}/{source}")
        out[name] = (torch.equal(loaded["model"]["w"].full_tensor(), _full(0)),
                     torch.equal(loaded["optim"]["state"]["w"]["exp_avg"].full_tensor(), _full(1)),
                     loaded["optim"]["param_groups"][0]["lr"] == 0.5)
    return out


def test_packed_weights_checkpoint_as_one_process_and_load_at_any_layout(tmp_path):
    import torch.distributed.checkpoint as dcp

    one = {"model": {"w": _full(0)}, "optim": {"state": {"w": {"exp_avg": _full(1), "step": torch.tensor(3.0)}},
                                               "param_groups": [{"lr": 0.5, "params": ["w"]}]}}
    dcp.save(one, checkpoint_id=str(tmp_path / "one"), no_dist=True)
    results = run_ranks(4, _ranks, str(tmp_path), timeout_s=180)
    for result in results:
        assert result["restored"] and result["fsdp_left_to_dcp"], result
        assert result["tp4"] == (True, True, True) and result["dp2_tp2"] == (True, True, True), result
    plain = {"model": {"w": torch.zeros(SHAPE, dtype=torch.float64)}}
    dcp.load(plain, checkpoint_id=str(tmp_path / "dp2_tp2"), no_dist=True)
    assert torch.equal(plain["model"]["w"], _full(0))
