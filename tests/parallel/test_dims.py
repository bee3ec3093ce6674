"""ParallelDims: validation messages, derived sizes, and the mesh it builds.

The mesh layout is checked in one process with torch's fake process group (rank 5 of 8):
group membership follows from the row-major (dp_replicate, dp_shard, cp, tp) layout, so
the expected ranks are computed here independently of torch.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch.distributed as dist

from hybridpar.parallel.dims import FLATTENED_DIMS, MESH_DIMS, ParallelDims


def test_world_size_mismatch_names_product_world_and_fix():
    dims = ParallelDims(dp_shard=2, cp=2, tp=2)
    with pytest.raises(ValueError) as err:
        dims.validate(4)
    message = str(err.value)
    assert "1*2*2*2 = 8" in message and "world size is 4" in message
    assert "dp_shard=" in message  # the fix


def test_world_size_mismatch_when_no_dp_shard_fits():
    with pytest.raises(ValueError, match="not divisible by dp_replicate\\*cp\\*tp=3"):
        ParallelDims(tp=3).validate(4)


def test_valid_world_size_passes():
    ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=2).validate(8)
    ParallelDims().validate(1)


@pytest.mark.parametrize("field,value", [("tp", 0), ("cp", -1), ("dp_shard", 1.5), ("dp_replicate", True)])
def test_degrees_must_be_positive_ints(field, value):
    with pytest.raises(ValueError, match=f"ParallelDims.{field}="):
        ParallelDims(**{field: value})


def test_sizes_and_flags():
    dims = ParallelDims(dp_replicate=2, dp_shard=3, cp=4, tp=5)
    assert dims.world_size == 120
    assert dims.size("dp_shard_cp") == 12
    assert dims.size("dp_cp") == 24
    assert dims.size("dp") == 6
    assert dims.size("tp") == 5
    assert dims.dp_enabled and dims.fsdp_enabled and dims.hsdp_enabled and dims.cp_enabled and dims.tp_enabled
    off = ParallelDims()
    assert not (off.dp_enabled or off.fsdp_enabled or off.hsdp_enabled or off.cp_enabled or off.tp_enabled)
    # dp_replicate alone is plain replication (no HSDP); cp alone still shards FSDP over cp
    assert not ParallelDims(dp_replicate=2).hsdp_enabled
    assert ParallelDims(cp=2).fsdp_enabled
    with pytest.raises(ValueError, match="unknown mesh dim 'pp'"):
        dims.size("pp")


def test_build_mesh_needs_a_process_group():
    if dist.is_initialized():
        pytest.fail("a default process group leaked into this test process")
    with pytest.raises(ValueError, match="init_process_group"):
        ParallelDims().build_mesh()


def _expected_group(shape, coord, varying):
    """Ranks sharing ``coord`` except along the ``varying`` mesh dims (row-major layout)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    ranks = []
    choices = [range(shape[i]) if MESH_DIMS[i] in varying else [coord[i]] for i in range(len(shape))]
    for point in itertools.product(*choices):
        ranks.append(sum(p * s for p, s in zip(point, strides)))
    return sorted(ranks)


@pytest.mark.parametrize("degrees", [(2, 1, 2, 2), (1, 2, 2, 2), (1, 1, 1, 8), (2, 2, 2, 1)])
def test_mesh_groups_on_fake_process_group(degrees):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = 5
    dims = ParallelDims(*degrees)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no deprecated root slicing of flattened dims
            root = dims.build_mesh("cpu")
            assert root.mesh_dim_names == MESH_DIMS and tuple(root.shape) == degrees
            coord = root.get_coordinate()
            for name in MESH_DIMS:
                got = sorted(dist.get_process_group_ranks(dims.group(root, name)))
                assert got == _expected_group(degrees, coord, {name}), name
            for name, parts in FLATTENED_DIMS.items():
                mesh = dims.mesh(root, name)
                assert mesh.size() == dims.size(name)
                expected = _expected_group(degrees, coord, set(parts))
                assert sorted(mesh.mesh.flatten().tolist()) == expected, name
                assert sorted(dist.get_process_group_ranks(dims.group(root, name))) == expected, name
            fsdp = dims.fsdp_mesh(root)
            if dims.dp_replicate > 1:
                assert fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
                assert tuple(fsdp.shape) == (dims.dp_replicate, dims.size("dp_shard_cp"))
            else:
                assert fsdp.mesh_dim_names == ("dp_shard_cp",)
        with pytest.raises(ValueError, match="unknown mesh dim 'pp'"):
            dims.mesh(root, "pp")
    finally:
        dist.destroy_process_group()


def test_build_mesh_validates_against_world_size():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(ValueError, match="world size is 4"):
            ParallelDims(tp=8).build_mesh()
    finally:
        dist.destroy_process_group()
