"""Context-parallel Mamba2: two strategies for the ``Mamba2Mixer.core`` seam.

Each rank holds ``L/P`` tokens of every row (``P`` = CP size, zigzag order, see
``zigzag.py``) and calls ``core(mixer, xBC, dt, packed)`` with the conv input
``xBC [B, L/P, H*p + 2*G*N]`` (channels ``[x | B | C]``), the raw ``dt [B, L/P, H]`` and its
localized ``PackedSeqParams``; the core returns the scan output ``y [B, L/P, H*p]`` (D skip
included). The gate ``z``, the grouped norm and ``out_proj`` stay in the mixer, on the full
width, so ``z`` never travels. A strategy owns no parameters: it reads ``conv1d``,
``dt_bias``, ``A_log`` and ``D`` from the mixer at every call, so gradients land on the
mixer's (or FSDP's unsharded) parameters. Head and group counts are read from the tensors,
so a tensor-parallel shard of the mixer runs the same code.

``"a2a"`` (``HiddenParallelMamba``, seed ``000_*``): one fused all-to-all turns
sequence-sharded ``x, B, C, dt`` into head-sharded ones over the whole sequence,
``[B, L/P, W] -> [B, L, W/P]`` per tensor; ``cp.gathered_to_sequence`` puts the tokens in
sequence order, the rank runs the single-process conv + scan on its ``H/P`` heads (with the
global document boundaries, so packed documents reset), ``cp.gathered_indices`` restores the
gathered order and a second all-to-all returns ``y [B, L/P, H*p]``. Rank ``r`` owns heads
``[r H/P, (r+1) H/P)``. Groups: if ``P | G`` it receives groups ``[r G/P, (r+1) G/P)``; if
``G | P`` and ``G < P`` every group is repeated ``R = P/G`` times before the exchange
(``G_eff = P`` groups travel) and rank ``r`` receives group ``r // R``, the one all its heads
read. The conv weights of those channels are sliced in the forward pass.

Bytes each rank sends per Mamba layer (``e`` bytes per activation element, counted as
``comm.CommStats`` does: all-to-all ``(P-1)/P`` x the rank's buffer)::

    a2a  forward   (P-1)/P * e * B * (L/P) * (d_inner + 2*G_eff*N + H)   x, B, C, dt out
                 + (P-1)/P * e * B * (L/P) *  d_inner                    y back
                 = e * B * (L/P) * (P-1)/P * (2*d_inner + 2*G_eff*N + H)
         backward  the same two all-to-alls transposed: the forward count

with ``G_eff = max(G, P)``. The seed's layout also sends ``z`` (``3*d_inner`` instead of
``2*d_inner``). ``"state"`` (``StatePassingMamba``, ``context/mamba_state.py``) sends bytes that do
not grow with ``L``; see that module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.mixers.mamba2 import MARK
from hybridpar.models.mamba.mixer import Mamba2Mixer, local_conv_scan
from hybridpar.models.mamba.core import mamba_conv_scan, shared_row_documents
from hybridpar.parallel.comm.collectives import hidden_to_seq, seq_to_hidden
from hybridpar.parallel.context.recurrent.mamba_state import SegmentPlan, segment_plan, state_passing_conv_scan
from hybridpar.parallel.context.core import ContextParallelCore, prepare_batch_plans

__all__ = [
    "MambaContextParallelCore",
    "HiddenParallelMamba",
    "StatePassingMamba",
    "STRATEGIES",
    "apply_mamba_cp",
    "a2a_bytes_per_layer",
    "local_tensor",
    "mixer_local_sizes",
]


def local_tensor(t: Tensor | None) -> Tensor | None:
    """The rank-local tensor of a parameter (``to_local()`` of a DTensor, differentiable)."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def mixer_local_sizes(mixer: Mamba2Mixer) -> tuple[int, int]:
    """``(heads, groups)`` of the parameters this rank holds (a tensor-parallel shard or all)."""
    heads = local_tensor(mixer.dt_bias).shape[0]
    conv_channels = local_tensor(mixer.conv1d.weight).shape[0]
    groups = (conv_channels - heads * mixer.head_dim) // (2 * mixer.ssm_state_size)
    return heads, groups


def a2a_bytes_per_layer(
    batch: int, seq_len: int, cp: int, d_inner: int, num_heads: int, n_groups: int, state_size: int,
    element_size: int, z_travels: bool = False,
) -> float:
    """Forward bytes one rank sends per Mamba layer with "a2a" (formula of the module docstring)."""
    if cp == 1:
        return 0.0
    groups_eff = max(n_groups, cp)
    width = (3 if z_travels else 2) * d_inner + 2 * groups_eff * state_size + num_heads
    return element_size * batch * (seq_len / cp) * (cp - 1) / cp * width


class MambaContextParallelCore(ContextParallelCore):
    """Common part of the Mamba2 strategies: head/group checks read from the tensors."""

    def validate(self, num_heads: int, n_groups: int) -> None:
        """Raise ``ValueError`` if this strategy cannot run these (rank-local) head/group counts."""
        if n_groups < 1 or num_heads % n_groups:
            raise ValueError(f"mamba heads {num_heads} must be a positive multiple of groups {n_groups}.")

    def _sizes(self, mixer: Mamba2Mixer, xBC: Tensor, dt: Tensor) -> tuple[int, int, int]:
        """``(heads, groups, d_inner)`` read from the tensors; checks them (no communication)."""
        if xBC.dim() != 3 or dt.dim() != 3 or xBC.shape[:2] != dt.shape[:2]:
            raise ValueError(
                f"{self.name} mamba core expects xBC [B, L/cp, H*P + 2*G*N] and dt [B, L/cp, H], got "
                f"{tuple(xBC.shape)} and {tuple(dt.shape)}."
            )
        heads = dt.shape[-1]
        d_inner = heads * mixer.head_dim
        groups, remainder = divmod(xBC.shape[-1] - d_inner, 2 * mixer.ssm_state_size)
        if remainder or groups < 1:
            raise ValueError(
                f"xBC width {xBC.shape[-1]} is not H*P + 2*G*N for H={heads}, P={mixer.head_dim}, "
                f"N={mixer.ssm_state_size}; pass the conv input of this mixer."
            )
        self.validate(heads, groups)
        return heads, groups, d_inner


class HiddenParallelMamba(MambaContextParallelCore):
    """All-to-all sequence -> heads, conv + scan on H/P heads over the whole sequence, back."""

    name = "a2a"

    def validate(self, num_heads: int, n_groups: int) -> None:
        super().validate(num_heads, n_groups)
        cp = self.cp_size
        if num_heads % cp:
            divisors = [p for p in range(1, num_heads + 1) if num_heads % p == 0]
            raise ValueError(
                f"mamba \"a2a\" context parallel splits heads over the CP group, but {num_heads} heads (per "
                f"tensor-parallel rank) are not divisible by cp={cp}; use the \"state\" strategy or a cp "
                f"that divides the heads (one of {divisors})."
            )
        if n_groups < cp and cp % n_groups:
            raise ValueError(
                f"mamba \"a2a\" needs cp % n_groups == 0 when n_groups < cp (groups are repeated), but "
                f"n_groups={n_groups} and cp={cp}; use a cp that is a multiple of {n_groups}, or \"state\"."
            )
        if n_groups >= cp and n_groups % cp:
            raise ValueError(
                f"mamba \"a2a\" needs n_groups % cp == 0 when n_groups >= cp, but n_groups={n_groups} and "
                f"cp={cp}; use a cp that divides {n_groups}, or the \"state\" strategy."
            )

    def local_parameters(self, mixer: Mamba2Mixer, heads: int, groups: int) -> tuple:
        """This rank's slices of conv weight ``[C/P', K]``, conv bias, dt_bias, A_log and D.

        Slicing runs in the forward pass, so autograd sends gradients to the full parameters.
        """
        cp, rank, state = self.cp_size, self.cp_rank, mixer.ssm_state_size
        heads_local = heads // cp
        d_local = heads_local * mixer.head_dim
        repeat = max(1, cp // groups)
        first_group, groups_local = (rank // repeat, 1) if repeat > 1 else (rank * groups // cp, groups // cp)
        d_inner = heads * mixer.head_dim

        def conv_channels(t: Tensor) -> Tensor:  # [C, ...] -> [d_local + 2*groups_local*N, ...]
            if t.shape[0] != d_inner + 2 * groups * state:
                raise ValueError(
                    f"conv1d has {t.shape[0]} channels but xBC has {d_inner + 2 * groups * state}; the mixer's "
                    "conv parameters and in_proj must be sharded alike."
                )
            x, B, C = t.split([d_inner, groups * state, groups * state], dim=0)
            bc = slice(first_group * state, (first_group + groups_local) * state)
            return torch.cat([x[rank * d_local : (rank + 1) * d_local], B[bc], C[bc]], dim=0)

        def per_head(t: Tensor) -> Tensor:  # [H, ...] -> [H/P, ...]
            return local_tensor(t)[rank * heads_local : (rank + 1) * heads_local]

        weight = conv_channels(local_tensor(mixer.conv1d.weight).squeeze(1))  # [C, 1, K] -> [C/P', K]
        bias = local_tensor(mixer.conv1d.bias)
        bias = None if bias is None else conv_channels(bias)
        return weight, bias, per_head(mixer.dt_bias), per_head(mixer.A_log), per_head(mixer.D)

    def __call__(self, mixer: Mamba2Mixer, xBC: Tensor, dt: Tensor, packed: PackedSeqParams | None = None) -> Tensor:
        heads, groups, d_inner = self._sizes(mixer, xBC, dt)
        if self.cp_size == 1:
            return local_conv_scan(mixer, xBC, dt, packed)
        layout = self.checked_layout(packed, xBC.shape[1])
        batch, local_len, _ = xBC.shape
        state = mixer.ssm_state_size
        x, B, C = xBC.split([d_inner, groups * state, groups * state], dim=-1)  # [B, L/P, d_inner | G*N | G*N]
        repeat = max(1, self.cp_size // groups)
        if repeat > 1:  # group g travels as copies g*R .. g*R+R-1: [B, L/P, G*N] -> [B, L/P, G*R*N]
            B, C = (t.unflatten(-1, (groups, 1, state)).expand(-1, -1, -1, repeat, -1).flatten(2) for t in (B, C))
        x, B, C, dt = seq_to_hidden([x, B, C, dt], self.cp_group, seq_dim=1, hidden_dim=-1)
        # [B, L/P, d_inner | G_eff*N | G_eff*N | H] -> [B, L, d_inner/P | G_eff*N/P | G_eff*N/P | H/P], rank-major
        device = xBC.device
        to_sequence = layout.gathered_to_sequence.to(device)  # [L]
        xBC_h = torch.cat([x, B, C], dim=-1).index_select(1, to_sequence)  # [B, L, C/P'], sequence order
        dt_h = dt.index_select(1, to_sequence)  # [B, L, H/P]
        cu_docs = shared_row_documents(packed, batch, to_sequence.numel(), device)  # global documents
        weight, bias, dt_bias, A_log, D = self.local_parameters(mixer, heads, groups)
        y = mamba_conv_scan(
            xBC_h, dt_h, weight, bias, dt_bias, A_log, D, head_dim=mixer.head_dim, state_size=state,
            chunk_size=mixer.chunk_size, cu_docs=cu_docs, dt_limit=mixer.time_step_limit,
        )  # [B, L, d_inner/P], sequence order
        y = y.index_select(1, layout.gathered_indices.to(device))  # -> gathered (rank-major) order
        (y,) = hidden_to_seq([y], self.cp_group, seq_dim=1, hidden_dim=-1)  # [B, L, d_inner/P] -> [B, L/P, d_inner]
        return y


class StatePassingMamba(MambaContextParallelCore):
    """Conv + scan on this rank's own segments, then exact state passing (``cp_mamba_state``)."""

    name = "state"

    def plan(self, packed: PackedSeqParams, batch: int, mixer: Mamba2Mixer, device) -> SegmentPlan:
        """The segment index plan of this batch (built once, reused by every Mamba layer)."""
        return segment_plan(packed, batch, self.cp_size, self.cp_rank, mixer.conv_kernel_size, device)

    def prepare(self, mixer: Mamba2Mixer, packed: PackedSeqParams, batch: int, device) -> None:
        self.plan(packed, batch, mixer, device)

    def __call__(self, mixer: Mamba2Mixer, xBC: Tensor, dt: Tensor, packed: PackedSeqParams | None = None) -> Tensor:
        self._sizes(mixer, xBC, dt)
        if self.cp_size == 1:
            return local_conv_scan(mixer, xBC, dt, packed)
        self.checked_layout(packed, xBC.shape[1])
        plan = self.plan(packed, xBC.shape[0], mixer, xBC.device)
        return state_passing_conv_scan(
            xBC, dt, local_tensor(mixer.conv1d.weight).squeeze(1), local_tensor(mixer.conv1d.bias),
            local_tensor(mixer.dt_bias), local_tensor(mixer.A_log), local_tensor(mixer.D),
            head_dim=mixer.head_dim, state_size=mixer.ssm_state_size, chunk_size=mixer.chunk_size,
            plan=plan, cp_group=self.cp_group, dt_limit=mixer.time_step_limit,
        )


STRATEGIES = {"a2a": HiddenParallelMamba, "state": StatePassingMamba}


def apply_mamba_cp(model: nn.Module, cp_group: dist.ProcessGroup | None, strategy: str = "a2a") -> nn.Module:
    """Install a CP strategy as ``core`` of every ``Mamba2Mixer`` in ``model`` (and of every transformers
    Mamba2 mixer ``models/hf/mixers/mamba2.install_mamba_core`` switched); returns ``model``.

    Head and group counts are checked on every mixer before any is changed, so a bad layout
    raises ``ValueError`` here, long before a collective could hang.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown mamba context-parallel strategy {strategy!r}; choose one of {sorted(STRATEGIES)}.")
    mixers = [(name, m) for name, m in model.named_modules() if isinstance(m, Mamba2Mixer) or getattr(m, MARK, False)]
    core = STRATEGIES[strategy](cp_group)
    for name, mixer in mixers:
        try:
            core.validate(*mixer_local_sizes(mixer))
        except ValueError as error:
            raise ValueError(f"mamba mixer {name or '<root>'!r}: {error}") from None
    for _, mixer in mixers:
        mixer.core = core
    prepare_batch_plans(model, core, [mixer for _, mixer in mixers])
    return model
