"""Parallel degrees and the device mesh they define.

Mesh dims, outer to inner: ``("dp_replicate", "dp_shard", "cp", "tp")``; all four are kept
even when their size is 1, so code can always ask for ``mesh["cp"]``. Flattened dims:

- ``"dp_shard_cp"`` = dp_shard x cp: what FSDP shards parameters over (CP ranks hold the
  same parameters and compute gradients over different tokens);
- ``"dp_cp"`` = dp_replicate x dp_shard x cp: where the loss's token count and sum are reduced;
- ``"dp"`` = dp_replicate x dp_shard: ranks that read different batches.

``ParallelDims.mesh(root, name)`` returns any of these (the flattened ones without slicing
the root, which torch deprecates); ``"hsdp"`` is the 2-D ``(dp_replicate, dp_shard_cp)`` mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
FLATTENED_DIMS = {
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp": ("dp_replicate", "dp_shard"),
}

__all__ = ["ParallelDims", "MESH_DIMS", "FLATTENED_DIMS"]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (replicate, shard), context and tensor parallelism."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self):
        from hybridpar.models.arguments import python_numbers

        python_numbers(self, MESH_DIMS)  # np.int64(2) is 2 (was "must be a positive integer")
        for name in MESH_DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims.{name}={value!r} must be a positive integer (1 disables it)")

    @property
    def world_size(self) -> int:
        """Number of ranks the mesh needs: dp_replicate * dp_shard * cp * tp."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    def size(self, name: str) -> int:
        """Size of a mesh dim or flattened dim (``"dp_shard_cp"``, ``"dp_cp"``, ``"dp"``)."""
        if name in MESH_DIMS:
            return getattr(self, name)
        if name in FLATTENED_DIMS:
            out = 1
            for dim in FLATTENED_DIMS[name]:
                out *= getattr(self, dim)
            return out
        raise ValueError(f"unknown mesh dim {name!r}; known: {list(MESH_DIMS) + list(FLATTENED_DIMS)}")

    @property
    def dp_enabled(self) -> bool:
        return self.size("dp") > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (over dp_shard x cp)."""
        return self.size("dp_shard_cp") > 1

    @property
    def hsdp_enabled(self) -> bool:
        """Replicated groups of sharded copies: dp_replicate > 1 and something to shard over."""
        return self.dp_replicate > 1 and self.fsdp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def validate(self, world_size: int) -> None:
        """Raise ValueError unless the degrees multiply to ``world_size``."""
        if self.world_size != world_size:
            raise ValueError(
                f"dp_replicate*dp_shard*cp*tp = {self.dp_replicate}*{self.dp_shard}*{self.cp}*{self.tp} = "
                f"{self.world_size}, but the world size is {world_size}; choose degrees whose product is "
                f"{world_size} (e.g. dp_shard={self._dp_shard_that_fits(world_size)})"
            )

    def _dp_shard_that_fits(self, world_size: int) -> str:
        rest = self.dp_replicate * self.cp * self.tp
        if world_size % rest == 0:
            return str(world_size // rest)
        return f"{world_size} with dp_replicate=cp=tp=1, as {world_size} is not divisible by dp_replicate*cp*tp={rest}"

    def build_mesh(self, device_type: str = "cpu"):
        """The 4-D ``DeviceMesh`` (all dims named, size-1 dims kept) with the flattened dims created.

        Needs an initialized default process group whose world size matches.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise ValueError("build_mesh needs an initialized process group; call dist.init_process_group first")
        self.validate(dist.get_world_size())
        shape = tuple(getattr(self, name) for name in MESH_DIMS)
        root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        for flat, dims in FLATTENED_DIMS.items():
            root[dims]._flatten(flat)
        return root

    @staticmethod
    def mesh(root, name: str):
        """The sub-mesh ``name`` of a mesh from ``build_mesh``: a mesh dim, a flattened dim or ``"hsdp"``."""
        from torch.distributed.device_mesh import DeviceMesh

        if name in MESH_DIMS:
            return root[name]
        if name in FLATTENED_DIMS:
            return root[FLATTENED_DIMS[name]]._flatten(name)  # idempotent: returns the existing one
        if name == "hsdp":
            return DeviceMesh._concatenate([root["dp_replicate"], ParallelDims.mesh(root, "dp_shard_cp")])
        raise ValueError(f"unknown mesh dim {name!r}; known: {list(MESH_DIMS) + list(FLATTENED_DIMS) + ['hsdp']}")

    @staticmethod
    def group(root, name: str):
        """The process group of this rank along mesh dim ``name`` (see ``mesh``)."""
        return ParallelDims.mesh(root, name).get_group()

    def fsdp_mesh(self, root):
        """FSDP's mesh: 1-D ``dp_shard_cp``, or 2-D HSDP ``(dp_replicate, dp_shard_cp)`` when dp_replicate > 1."""
        return self.mesh(root, "hsdp" if self.dp_replicate > 1 else "dp_shard_cp")
