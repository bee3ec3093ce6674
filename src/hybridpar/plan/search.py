"""``hybridpar plan --fit GIB``: every layout of the world size, the ones that fit, fastest first.

Candidates: every ``dp_replicate * dp_shard * cp * tp = world`` (sequence parallelism on when
``tp > 1``), every CP strategy pair when ``cp > 1`` (attention allgather/ulysses/ring x Mamba
a2a/state), every checkpointing policy (none/selective/full). Each is validated with the rules of
``train`` (``validate_layout``: a refused candidate shows train's message) and planned; it fits when
``peak + baseline <= GIB``. ``data.packs_per_step`` (and ``train.eval_packs``) are raised to a multiple
of the data-parallel size where needed (same tokens per rank per pack; each such line names the raised
key, which ``train`` needs too). The text lists the first ``SHOWN`` of each kind; ``--json`` lists all.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

from hybridpar.config import RULES, ConfigError, RunConfig
from hybridpar.models.hybrid import HybridConfig
from hybridpar.parallel.comm.units import mamba_layers
from hybridpar.plan.planner import GPU_BASELINE_GIB, Plan, plan_layout, planned_shape
from hybridpar.plan.estimate import H100, DeviceFigures
from hybridpar.plan.layout import Layout

__all__ = ["Candidate", "search_layouts", "divisor_layouts"]

MAX_FIT_LAYOUTS = 2000  # --world-size 2**20 has 1,771 (dp_replicate, dp_shard, cp, tp); 10**8 has 27,225
POLICIES = ("none", "selective", "full")
CP_ATTENTION = ("allgather", "ulysses", "ring")
CP_MAMBA = ("a2a", "state")


@dataclass
class Candidate:
    parallel: dict  # the parallel.* keys of this candidate
    plan: Plan | None = None
    refused: str | None = None  # train's message
    needs_gib: float | None = None  # peak + baseline
    data: dict = dataclasses.field(default_factory=dict)  # data.*/train.* keys raised to a multiple of dp

    def fits(self, budget_gib: float) -> bool:
        return self.plan is not None and self.needs_gib <= budget_gib

    def label(self) -> str:
        p = self.parallel
        text = f"dp_replicate={p['dp_replicate']} dp_shard={p['dp_shard']} cp={p['cp']} tp={p['tp']}"
        if p["cp"] > 1:
            text += f" cp_attention={p['cp_attention']} cp_mamba={p['cp_mamba']}"
        text += f" checkpointing={p['activation_checkpointing']}"
        return text + "".join(f" {key}={value}" for key, value in self.data.items())  # what train must be told too


def divisor_layouts(world: int) -> list[tuple[int, int, int, int]]:
    """``(dp_replicate, dp_shard, cp, tp)`` with product ``world``, tp and cp first-class."""
    small = [d for d in range(1, math.isqrt(world) + 1) if world % d == 0]  # not range(world): 2**31-1 took minutes
    divisors = sorted(set(small + [world // d for d in small]))
    out = []
    for tp in divisors:
        for cp in divisors:
            for rep in divisors:
                if world % (tp * cp * rep) == 0:
                    out.append((rep, world // (tp * cp * rep), cp, tp))
    return out


def _candidates(world: int, has_mamba: bool = True):
    """Every layout of ``world`` ranks, CP strategy pair and policy (one Mamba strategy without Mamba blocks)."""
    for rep, shard, cp, tp in divisor_layouts(world):
        pairs = [(a, m) for a in CP_ATTENTION for m in (CP_MAMBA if has_mamba else CP_MAMBA[:1])]
        strategies = pairs if cp > 1 else [("allgather", "a2a")]
        for attention, mamba in strategies:
            for policy in POLICIES:
                yield dict(dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, sequence_parallel=tp > 1,
                           cp_attention=attention, cp_mamba=mamba, activation_checkpointing=policy)


def _verdict(candidate: RunConfig, world: int, model, shape, verdicts: dict) -> str | None:
    """``train``'s refusal of ``candidate`` or None. The rules are ``validate_layout``'s; its TP plan
    check is the slow part and does not depend on the CP strategies, so once a layout's degrees
    passed with one strategy pair, other pairs need only the strategies' own head/group rules."""
    from hybridpar.train.preflight import cp_head_rules, validate_layout

    p = candidate.parallel
    degrees = (p.dp_replicate, p.dp_shard, p.cp, p.tp, p.sequence_parallel)
    if verdicts.get(("degrees",) + degrees, "unknown") is None:
        try:
            cp_head_rules(candidate, model)
            return None
        except ValueError as error:
            return str(error)
    try:
        validate_layout(candidate, world, model=model, shape=shape)
    except ValueError as error:
        return str(error)
    verdicts[("degrees",) + degrees] = None
    return None


def search_layouts(run: RunConfig, world: int, budget_gib: float, device: DeviceFigures = H100,
                   baseline_gib: float = GPU_BASELINE_GIB, docs_per_pack: int = 1) -> list[Candidate]:
    """Every candidate, planned or refused; fitting ones first, fastest estimate first."""
    from hybridpar.train.hf_model import meta_model
    from hybridpar.train.preflight import model_config

    if (count := len(divisor_layouts(world))) > MAX_FIT_LAYOUTS:  # each layout is validated and priced: hours
        raise ConfigError(f"plan --fit at --world-size {world} would price {count:,} layouts, more than the "
                          f"{MAX_FIT_LAYOUTS:,} it searches (minutes); search the ranks of one model replica (e.g. "
                          "--world-size 64) and multiply by parallel.dp_replicate, which leaves the memory per rank as it is.")
    shape = model_config(run)
    model = meta_model(shape)  # one shape-only model validates every candidate
    planned, hf_decoder = shape, False
    if not isinstance(shape, HybridConfig):  # a transformers decoder: priced through its twin, or refused
        planned, why, _ = planned_shape(shape, run)
        if planned is None:
            raise ConfigError(f"plan --fit needs every layout's activations, and for {type(model).__name__} {why}; "
                              "drop --fit to see its parameters, gradients and AdamW state per rank.")
        hf_decoder = True
    out, verdicts = [], {}
    for keys in _candidates(world, has_mamba=mamba_layers(planned.pattern) > 0):
        candidate = copy.deepcopy(run)
        candidate.parallel = dataclasses.replace(run.parallel, **keys)
        dp, raised = keys["dp_replicate"] * keys["dp_shard"], {}
        if candidate.data.packs_per_step % dp:
            candidate.data.packs_per_step = raised["data.packs_per_step"] = -(-candidate.data.packs_per_step // dp) * dp
        if candidate.train.eval_every and candidate.train.eval_packs % dp:  # evaluation costs no training memory
            candidate.train.eval_packs = raised["train.eval_packs"] = -(-candidate.train.eval_packs // dp) * dp
        if over := [f"{k}={v} is not {RULES[k].text}" for k, v in raised.items() if not RULES[k].holds(v)]:
            out.append(Candidate(keys, refused=f"dp={dp} needs {'; '.join(over)}", data=raised))  # train refuses it
            continue
        layout_key = tuple(v for k, v in keys.items() if k != "activation_checkpointing")  # policies share a verdict
        if layout_key not in verdicts:
            verdicts[layout_key] = _verdict(candidate, world, model, shape, verdicts)
        if verdicts[layout_key] is not None:
            out.append(Candidate(keys, refused=verdicts[layout_key], data=raised))
            continue
        layout = Layout.from_run(candidate, planned, hf_decoder)
        plan = plan_layout(layout, device, docs_per_pack)
        out.append(Candidate(keys, plan, needs_gib=plan.memory.peak_bytes / 2**30 + baseline_gib, data=raised))
    fitting = sorted((c for c in out if c.fits(budget_gib)), key=lambda c: c.plan.time.step_s)
    others = sorted((c for c in out if not c.fits(budget_gib)),
                    key=lambda c: (c.plan is None, c.needs_gib or 0.0))
    return fitting + others
