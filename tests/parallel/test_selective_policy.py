"""The selective checkpointing policy keeps what each block's sequence mixer reads.

One process, the tiny preset: after a block's first forward the policy knows how many matmuls
precede its last mixing kernel (Mamba2: ``in_proj``; attention: ``q, k, v``; MLP: none), and
the bytes a block keeps follow: an MLP block keeps only its input, a Mamba2 block its input and
the ``in_proj`` output. Gradients equal those without checkpointing (float64).
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hybrid import HybridConfig, build_block
from hybridpar.parallel.checkpointing import apply_activation_checkpointing, selective_policy

KEPT_MATMULS = {"M": 1, "*": 3, "-": 0}


def _holder(kind: str, policy: str) -> torch.nn.Module:
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([build_block(HybridConfig.from_preset("tiny"), kind)]).double()
    return apply_activation_checkpointing(holder, policy)


class _Storages(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                self.refs.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return out


def _kept_bytes(block, x, packed) -> int:
    """Bytes of the storages a forward creates that are still alive after it, but its output and
    the parameters: what backward keeps (selective caches included)."""
    with _Storages() as tracker:
        out = block(x, packed)
    gc.collect()
    skip = {t.untyped_storage()._cdata for t in (out, x, *block.parameters())}
    kept = sum(n for key, (ref, n) in tracker.refs.items() if not ref.expired() and key not in skip)
    out.sum().backward()
    return kept


@pytest.mark.parametrize("kind", ["M", "*", "-"])
def test_selective_learns_the_matmuls_before_the_mixing_kernel_and_keeps_gradients(kind):
    config = HybridConfig.from_preset("tiny")
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 24, 64], dtype=torch.int32))
    x = torch.randn(1, 64, config.hidden_size, dtype=torch.float64, requires_grad=True)
    plain, selective = _holder(kind, "none"), _holder(kind, "selective")
    policy = selective_policy(selective.layers[0])
    grads = []
    for holder in (plain, selective, selective):  # the policy learns in its first forward
        x.grad = None
        holder.zero_grad()
        holder.layers[0](x, packed).square().sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in holder.parameters()])
    policy()  # folds the last forward in, as the next forward would
    assert policy.kept_matmuls == KEPT_MATMULS[kind]
    for reference, got in zip(grads[0], grads[2]):
        torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)


def test_selective_mlp_keeps_nothing_but_its_input_and_mamba_its_in_proj_output():
    config = HybridConfig.from_preset("tiny")
    x = torch.randn(1, 64, config.hidden_size, dtype=torch.float64, requires_grad=True)
    token_bytes = 64 * 8
    for kind, kept_width in (("-", 0),
                             ("M", 2 * config.mamba_intermediate_size
                              + 2 * config.mamba_n_groups * config.ssm_state_size + config.mamba_num_heads)):
        holder = _holder(kind, "selective")
        _kept_bytes(holder.layers[0], x, None)  # learn
        selective = _kept_bytes(holder.layers[0], x, None)
        assert selective == kept_width * token_bytes, (kind, selective / token_bytes, kept_width)
