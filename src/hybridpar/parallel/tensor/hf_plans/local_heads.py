"""A block of a transformers model that computes on its local heads under TP (``LocalHeadsBlock``).

The block's children split by heads hold ``Shard(0)`` parameters (their rows are heads), those every
rank's heads read are replicated with their gradient summed over TP once (``AllReduceGrad``), and the
exit projection is row-parallel::

    x [B, S, D] (SP: all-gathered) -> plain on entry (``local_mixer_input``; backward: partial -> one reduction)
      -> local heads on local parameters -> out rowwise: partial [B, S, D] -> all-reduce (SP: reduce-scatter)

Parameters are swapped for their local tensors for one forward and put back after it. RecurrentGemma's
RG-LRU blocks and MQA (``recurrent_gemma.py``) and Kimi Delta Attention (``kimi_linear.py``) use it.
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hybridpar.parallel.tensor.hybrid import MambaHeadParallel
from hybridpar.parallel.tensor.styles import AllReduceGrad, local_mixer_input, row_parallel_exit

__all__ = ["LocalHeadsBlock"]


class LocalHeadsBlock(MambaHeadParallel):
    """A block computing on its local heads: the parameters of the children named in ``sharded`` are
    ``Shard(0)`` (their rows are heads), those named in ``summed`` replicated with their gradient summed
    over TP (every rank's heads read them), ``out`` row-parallel; the input is made plain
    (``local_mixer_input``)."""

    marker = "_hybridpar_head_sharded"  # set on the block: models/hf/mixers/rglru.py refuses a cache then
    out = ""
    localized_children: tuple[str, ...] = ()  # sharded by the subclass's _apply: made local in forward only
    sharded_children: tuple[str, ...] = ()
    summed_children: tuple[str, ...] = ()
    lora_kinds: dict[str, str] = {}  # parallel/lora.py: how a LoRA on a child pairs (absent: refused)

    def __init__(self, *, sequence_parallel: bool = False):
        super().__init__(sequence_parallel=sequence_parallel)
        self.use_local_output = not sequence_parallel  # read by tp_check's SP rules

    def sharded(self, module: nn.Module) -> tuple[nn.Module, ...]:
        return tuple(module.get_submodule(name) for name in self.sharded_children)

    def summed(self, module: nn.Module) -> tuple[nn.Module, ...]:
        return tuple(module.get_submodule(name) for name in self.summed_children)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        for placement, subs in ((Shard(0), self.sharded(module)), (Replicate(), self.summed(module))):
            for sub in subs:
                for name in list(sub._parameters):
                    self._shard(sub, name, device_mesh, placement)
        row_parallel_exit(getattr(module, self.out), device_mesh, self.sequence_parallel)  # [B, S, W/tp] in
        module.register_forward_pre_hook(partial(self._enter_local, device_mesh), with_kwargs=True)
        module.register_forward_hook(self._exit, always_call=True)  # restore even if forward raises
        setattr(module, self.marker, True)
        return module

    def _enter_local(self, mesh: DeviceMesh, module: nn.Module, args, kwargs):
        args, kwargs = local_mixer_input(mesh, args, kwargs)  # [B, S, D] plain; backward: partial -> all-reduce
        summed, saved = self.summed(module), []
        localized = tuple(module.get_submodule(name) for name in self.localized_children)
        for sub in (*localized, *self.sharded(module), *summed):
            for name, param in list(sub._parameters.items()):
                if isinstance(param, DTensor):
                    saved.append((sub, name, param))
                    local = param.to_local()
                    sub._parameters[name] = AllReduceGrad.apply(local, mesh.get_group()) if sub in summed else local
        module.__dict__.setdefault("_tp_saved_parameters", []).append(saved)
        return args, kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_parallel={self.sequence_parallel})"
