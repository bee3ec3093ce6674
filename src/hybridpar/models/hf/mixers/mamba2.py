"""hybridpar's Mamba core inside transformers' Mamba2-family mixers (Bamba, NemotronH, Falcon-H1,
GraniteMoeHybrid, Zamba2), recognised by structure, never by class name.

A transformers module is a *Mamba2 mixer* when it has ``in_proj`` / ``out_proj`` (``nn.Linear``),
a depthwise ``conv1d`` over ``x|B|C`` (``conv_dim = intermediate_size + 2 * n_groups * ssm_state_size``
channels), 1-D ``A_log``, ``dt_bias`` and ``D`` over ``num_heads``, ``in_proj`` of width
``intermediate_size + conv_dim + num_heads`` (``[z | xBC | dt]``) and a ``norm`` (a gated grouped
RMSNorm, or ``nn.Identity`` with a plain ``y * silu(z)`` gate: Falcon-H1 without ``mamba_rms_norm``).

``install_mamba_core(model)`` gives each such mixer a training forward::

    u [B, L, D] (* ssm_in_multiplier)  -> in_proj (* mup_vector)  -> [z | xBC | dt]
    xBC, dt -> mixer.core(mixer, xBC, dt, packed) -> y [B, L, H*P]   (conv + SSD, documents reset)
    y, z -> mixer.norm(y, z)  (or y * silu(z)) -> out_proj

``mixer.core`` is the same seam as ``HybridLM``'s ``Mamba2Mixer.core`` (default
``models.mamba.mixer.local_conv_scan``), so context-parallel strategies can replace it from
outside. The batch's ``PackedSeqParams`` arrive as ``packed_seq_params`` through the decoder
layer's ``**kwargs``. The per-architecture twists live in the module itself and are read from it:
Falcon-H1's ``ssm_in_multiplier`` and ``mup_vector`` and its norm variants (the module's own
``norm`` applies ``norm_before_gate``), NemotronH's and Zamba2's ``time_step_limit`` (dt clamped
at ``time_step_min``), Zamba2's conv bias and norm epsilon; Granite's multipliers sit outside the
mixer. Parameter names do not change. With a cache (generation) or a padding ``attention_mask``
the module's own transformers forward runs.

Single-device code (no process group).
"""

from __future__ import annotations

import types

from torch import Tensor, nn

from hybridpar.models.hf.mixers.documents import use_position_documents
from hybridpar.models.hf.mixers.fallback import takes_transformers_forward
from hybridpar.models.hf.versions import require_for_mixers
from hybridpar.models.mamba.mixer import local_conv_scan

__all__ = ["MARK", "is_mamba2_mixer", "mamba_mixer_problem", "install_mamba_core", "switch_forward", "switch_mixers", "bridged_mixers",
           "local_split_sizes", "mamba_training_forward"]

MARK = "hybridpar_mamba_core"  # set on a mixer whose forward runs hybridpar's core
_NEEDED = ("in_proj", "out_proj", "conv1d", "A_log", "dt_bias", "D", "norm", "num_heads", "head_dim", "n_groups",
           "ssm_state_size", "intermediate_size", "chunk_size", "time_step_limit")


def is_mamba2_mixer(module: nn.Module) -> bool:
    """Whether ``module`` has the structure of a Mamba2 mixer (module docstring); hybridpar's own
    ``Mamba2Mixer`` and non-transformers modules are not counted."""
    if type(module).__module__.startswith("hybridpar") or not all(hasattr(module, a) for a in _NEEDED):
        return False
    conv, in_proj = module.conv1d, module.in_proj
    if not isinstance(conv, nn.Conv1d) or not isinstance(in_proj, nn.Linear) or not isinstance(module.out_proj, nn.Linear):
        return False
    heads = module.num_heads
    conv_dim = module.intermediate_size + 2 * module.n_groups * module.ssm_state_size
    return (all(isinstance(p, Tensor) and p.dim() == 1 and p.numel() == heads for p in (module.A_log, module.dt_bias))
            and conv.in_channels == conv.out_channels == conv.groups == conv_dim
            and in_proj.out_features == module.intermediate_size + conv_dim + heads
            and module.intermediate_size == heads * module.head_dim)


def mamba_mixer_problem(name: str, module: nn.Module) -> str | None:
    """Why hybridpar's core cannot run Mamba2 mixer ``module`` exactly (None: it can)."""
    where = f"Mamba2 mixer {name!r} ({type(module).__name__})"
    activation = getattr(module, "activation", "silu")
    if activation not in ("silu", "swish"):
        return f"{where} uses activation {activation!r} after its conv; hybridpar's Mamba core applies SiLU only"
    if module.D.dim() != 1 or module.D.numel() != module.num_heads:
        return f"{where} has D of shape {tuple(module.D.shape)}; hybridpar's Mamba core takes one D per head"
    if module.num_heads % module.n_groups:
        return f"{where} has num_heads={module.num_heads} not divisible by n_groups={module.n_groups}"
    if not isinstance(module.norm, nn.Identity) and not hasattr(module.norm, "weight"):
        return f"{where} has a norm {type(module.norm).__name__} that is neither a gated RMSNorm nor Identity"
    return None


def local_split_sizes(mixer: nn.Module, width: int) -> list[int]:
    """Widths of ``[z | xBC | dt]`` in an ``in_proj`` output of ``width``: the whole mixer, or a
    tensor-parallel shard of ``H/tp`` heads and ``G/tp`` groups (one group: kept whole on every
    rank; ``parallel/tensor/hf_plans/moe_hybrid.py``)."""
    heads, n_groups, state = mixer.num_heads, mixer.n_groups, mixer.ssm_state_size
    for shards in (s for s in range(1, heads + 1) if heads % s == 0 and (n_groups % s == 0 or n_groups == 1)):
        d_inner, groups = mixer.intermediate_size // shards, max(1, n_groups // shards)
        if 2 * d_inner + 2 * groups * state + heads // shards == width:
            return [d_inner, d_inner + 2 * groups * state, heads // shards]
    raise ValueError(f"in_proj output width {width} is not a whole mixer or a shard by heads of one (heads {heads}, "
                     f"groups {n_groups}); shard the mixer by heads and groups.")


def mamba_training_forward(mixer: nn.Module, hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None,
                           packed_seq_params=None, **kwargs) -> Tensor:
    """The mixer's forward through ``mixer.core`` (module docstring); ``hidden_states [B, L, D]``."""
    sharded = "heads" if getattr(mixer, "_hybridpar_head_sharded", False) else None
    if takes_transformers_forward(mixer, cache, attention_mask, packed_seq_params, kwargs, sharded):
        return mixer._hybridpar_transformers_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    dtype = hidden_states.dtype
    multiplier = getattr(mixer, "ssm_in_multiplier", None)
    if multiplier is not None:
        hidden_states = hidden_states * multiplier
    projected = mixer.in_proj(hidden_states)  # [B, L, d_inner + conv_dim + H]
    mup = getattr(mixer, "mup_vector", None)
    if mup is not None:
        projected = projected * mup
    gate, xBC, dt = projected.split(local_split_sizes(mixer, projected.shape[-1]), dim=-1)
    y = mixer.core(mixer, xBC, dt, packed_seq_params)  # [B, L, d_inner]
    if isinstance(mixer.norm, nn.Identity):  # Falcon-H1 without mamba_rms_norm
        y = y * nn.functional.silu(gate)
    else:
        y = mixer.norm(y, gate)
    return mixer.out_proj(y.to(dtype))


def install_mamba_core(model: nn.Module) -> list[str]:
    """Give every Mamba2 mixer of ``model`` the training forward through ``mixer.core`` (idempotent);
    returns their names. Raises ``ValueError`` for a variant the core cannot run exactly."""
    return switch_mixers(model, is_mamba2_mixer, mamba_mixer_problem, MARK, mamba_training_forward, local_conv_scan,
                         "a Mamba2 variant the core runs (SiLU after the conv, one D per head, heads a multiple of "
                         "n_groups, a gated RMSNorm or none)")


def switch_mixers(model: nn.Module, is_mixer, problem_of, mark: str, forward, default_core, supported: str) -> list[str]:
    """``switch_forward`` on every module ``is_mixer`` names (or ``mark`` marks already: a switched
    module may no longer look like one, e.g. its projection split by ``parallelize``); returns their
    names. ``problem_of(name, module)``: why the core cannot run it exactly, raised as ``ValueError``
    ending with the fix (train with ``supported``). A model with switched mixers takes its documents
    from restarting ``position_ids`` when no ``packed_seq_params`` come (``use_position_documents``)."""
    names = []
    for name, module in model.named_modules():
        if not getattr(module, mark, False):
            if not is_mixer(module):
                continue
            require_for_mixers(f"{type(module).__name__} {name!r}")
            problem = problem_of(name, module)
            if problem:
                raise ValueError(f"{problem}; train this model with {supported}, or file it as a new mixer.")
            switch_forward(module, mark, forward, default_core)
        names.append(name)
    if names:  # documents told by position ids alone reach the mixers too (mixers/documents.py)
        use_position_documents(model)
    return names


def switch_forward(module: nn.Module, mark: str, forward, default_core) -> None:
    """Run ``forward`` (through ``module.core``, ``default_core`` unless one is installed) as the
    module's forward and set ``mark``; transformers' own stays as ``_hybridpar_transformers_forward``
    for calls with a cache or a padding mask. Idempotent. Shared by every switched token mixer."""
    if getattr(module, mark, False):
        return
    module._hybridpar_transformers_forward = module.forward
    module.forward = types.MethodType(forward, module)
    if getattr(module, "core", None) is None:
        module.core = default_core
    setattr(module, mark, True)


def bridged_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the mixers ``install_mamba_core`` switched to hybridpar's core."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, MARK, False)]

