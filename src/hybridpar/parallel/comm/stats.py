"""Count every collective a rank runs: hybridpar's, DTensor's (TP/SP) and FSDP2's.

``CommStats`` is a ``TorchDispatchMode`` (the mechanism of torch's ``CommDebugMode``): every
collective reaches the dispatcher as an op, whoever issues it,

    torch.distributed.*  (hybridpar's comm.py, FSDP2, the loss)  ->  c10d::allreduce_, _allgather_base_, ...
    DTensor redistribution, funcol, compiled graphs               ->  _c10d_functional::all_reduce, ...

so one mode sees them all, including those inside hybridpar's own custom ops (the
vocab-parallel loss), which run with the mode still on. DTensor ops are passed on (``NotImplemented``) and come back as
the functional collectives they lower to, so nothing is counted twice; ops a collective runs
inside itself are not seen again either (a mode is off while it handles an op).

Bytes are what this rank SENDS, as ring/pairwise algorithms put them on the wire, with n =
bytes of this rank's input buffer and P the group size (integer division):

    all_gather       (P-1) * n       its shard reaches the P-1 other ranks
    reduce_scatter   (P-1)/P * n     ring: P-1 steps of n/P
    all_reduce       2(P-1)/P * n    ring reduce-scatter + ring all-gather
    all_to_all       n - own part    (P-1)/P * n for equal splits
    broadcast        (P-1) * n on the root, 0 elsewhere (flat);  send n;  recv 0;  barrier 0

These are algorithm volumes, not what a backend does (gloo runs reduce-scatter as an
all-reduce). A group of one sends nothing and torch issues no collective for it, so nothing
is counted. Each collective is recorded with its kind, bytes, group size and the mesh dims its
group spans: with ``mesh`` (the root mesh from ``ParallelDims.build_mesh``) the dims whose
coordinate varies over the group's ranks, joined by ``+`` (``"tp"``, ``"cp"``,
``"dp_shard+cp"``); without one, ``"world"`` or ``"group_of_<P>"``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommStats", "Collective", "COLLECTIVE_KINDS"]

_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")

# op name (c10d and functional collectives) -> kind
COLLECTIVE_KINDS: dict[str, str] = {
    **dict.fromkeys(("allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
                     "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"),
                    "all_gather"),
    **dict.fromkeys(("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
                     "reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"),
                    "reduce_scatter"),
    **dict.fromkeys(("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
                     "all_reduce_coalesced_"), "all_reduce"),
    **dict.fromkeys(("alltoall_", "alltoall_base_", "all_to_all_single"), "all_to_all"),
    **dict.fromkeys(("broadcast_", "broadcast"), "broadcast"),
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "barrier": "barrier", "monitored_barrier_": "barrier",
    "gather_": "gather", "scatter_": "scatter", "reduce_": "reduce",
}
# schema argument holding the tensors this rank contributes, first match wins
_INPUT_ARGS = ("input", "inputs", "input_tensor", "input_tensors", "tensors")


@dataclass(frozen=True)
class Collective:
    """One collective as this rank saw it."""

    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | broadcast | ...
    dim: str  # mesh dims the group spans ("tp", "dp_shard+cp"), or "world" / "group_of_<P>"
    nbytes: int  # bytes this rank sends (module docstring)
    group_size: int
    op: str  # the dispatcher op, e.g. "c10d::_allgather_base_"


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _process_group(bound: dict):
    """The registered ProcessGroup of a c10d op (ScriptObject) or a functional collective (name)."""
    group = bound.get("process_group")
    if isinstance(group, torch.ScriptObject):
        name = dist.ProcessGroup.unbox(group).group_name
    else:
        name = bound.get("group_name")
    if isinstance(name, dist.ProcessGroup):
        return name
    return dist.distributed_c10d._resolve_process_group(name)


def _bytes_sent(kind: str, bound: dict, size: int, rank: int) -> int:
    inputs = next((bound[a] for a in _INPUT_ARGS if a in bound), None)
    n = _tensor_bytes(inputs)
    if kind == "all_gather":
        return (size - 1) * n
    if kind == "reduce_scatter":
        return (size - 1) * n // size
    if kind == "all_reduce":
        return 2 * (size - 1) * n // size
    if kind == "all_to_all":
        if isinstance(inputs, (list, tuple)):  # one tensor per destination
            return n - _tensor_bytes(inputs[rank])
        splits = list(bound.get("input_split_sizes") or [])
        if not splits or inputs.shape[0] == 0:
            return (size - 1) * n // size
        return n - splits[rank] * (n // inputs.shape[0])
    if kind == "broadcast":
        root = bound.get("root_rank", bound.get("src"))
        return (size - 1) * n if root == rank else 0
    if kind == "send":
        return n
    if kind in ("gather", "reduce"):
        return 0 if bound.get("root_rank", bound.get("root")) == rank else n
    if kind == "scatter":
        return n - _tensor_bytes(inputs[0][rank]) if inputs and inputs[0] else 0
    return 0  # recv, barrier


class CommStats(TorchDispatchMode):
    """Context manager recording every collective this rank runs (see the module docstring).

    ``with CommStats(mesh) as stats: ...``, then ``stats.bytes_sent["all_gather"]`` and
    ``stats.calls[...]`` (by kind), ``stats.by_dim()`` (``{(kind, dim): bytes}``),
    ``stats.calls_by_dim()`` and ``stats.records`` (one ``Collective`` each). Recorders nest:
    an outer one also counts what inner ones count. With none active nothing is intercepted.
    """

    def __init__(self, mesh=None) -> None:
        super().__init__()
        self.records: list[Collective] = []
        self._labels: dict[str, str] = {}
        self._coords: dict[int, tuple[int, ...]] | None = None
        self._dim_names: tuple[str, ...] = ()
        if mesh is not None:
            grid = mesh.mesh.tolist() if mesh.mesh.ndim else [mesh.mesh.item()]
            self._dim_names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
            self._coords = {}
            self._index(grid, ())

    def _index(self, grid, prefix: tuple[int, ...]) -> None:
        for i, item in enumerate(grid):
            if isinstance(item, list):
                self._index(item, (*prefix, i))
            else:
                self._coords[item] = (*prefix, i)

    # -- reading --------------------------------------------------------------------------
    @property
    def bytes_sent(self) -> dict[str, int]:
        """Bytes sent per kind."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            out[r.kind] += r.nbytes
        return dict(out)

    @property
    def calls(self) -> dict[str, int]:
        """Collectives run per kind."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            out[r.kind] += 1
        return dict(out)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def by_dim(self) -> dict[tuple[str, str], int]:
        """Bytes sent per ``(kind, mesh dim)``."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for r in self.records:
            out[r.kind, r.dim] += r.nbytes
        return dict(out)

    def calls_by_dim(self) -> dict[tuple[str, str], int]:
        """Collectives run per ``(kind, mesh dim)``."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for r in self.records:
            out[r.kind, r.dim] += 1
        return dict(out)

    def __repr__(self) -> str:
        return f"CommStats(bytes_sent={self.bytes_sent}, calls={self.calls})"

    # -- recording ------------------------------------------------------------------------
    def _label(self, group) -> str:
        name = group.group_name
        if name not in self._labels:
            ranks = dist.get_process_group_ranks(group)
            if self._coords is not None and all(r in self._coords for r in ranks):
                coords = [self._coords[r] for r in ranks]
                varying = [n for d, n in enumerate(self._dim_names) if len({c[d] for c in coords}) > 1]
                self._labels[name] = "+".join(varying) or "self"
            else:
                self._labels[name] = "world" if len(ranks) == dist.get_world_size() else f"group_of_{len(ranks)}"
        return self._labels[name]

    def _record(self, func, kind: str, args, kwargs) -> None:
        names = [a.name for a in func._schema.arguments]
        bound = {**dict(zip(names, args)), **kwargs}
        group = _process_group(bound)
        size, rank = group.size(), group.rank()
        self.records.append(Collective(kind, self._label(group), _bytes_sent(kind, bound, size, rank), size,
                                       func._schema.name))

    def _run_inside(self, func, args, kwargs):
        """Run a custom op's device kernel (past this mode's dispatch key) with the mode on again,
        so the collectives it issues reach ``__torch_dispatch__``."""
        tensor = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        keys = torch._C.DispatchKeySet(torch._C._dispatch_key_for_device(tensor.device.type))
        with self:
            return func.redispatch(keys, *args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor lowers the op to local ops and collectives, which come back here
        if func.namespace == "hybridpar":  # our custom ops run collectives inside: keep counting there
            return self._run_inside(func, args, kwargs)
        out = func(*args, **kwargs)
        if func.namespace in _NAMESPACES:
            kind = COLLECTIVE_KINDS.get(func._schema.name.split("::", 1)[1])
            if kind is not None:
                self._record(func, kind, args, kwargs)
        return out
