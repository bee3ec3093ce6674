"""Make a plan: validate a run as ``train`` does, then price its layout (``Plan``; a transformers
decoder through its HybridLM twin, ``plan/hf/twin.py``), or give any other transformers model its
parameter share (``TransformersPlan``)."""


from __future__ import annotations

import resource
from dataclasses import dataclass

from hybridpar.config import RunConfig, config_from_dict, to_dict
from hybridpar.config_rules import quoted
from hybridpar.models.arguments import python_number
from hybridpar.models.hybrid import HybridConfig
from hybridpar.plan.estimate import H100, DeviceFigures, TimeEstimate, estimate_time
from hybridpar.plan.layout import DTYPE_BYTES, Layout, adapter_bytes
from hybridpar.plan.memory import MemoryPlan, memory_plan
from hybridpar.plan.params import parameter_count
from hybridpar.plan.traffic import by_kind, by_kind_and_dim, step_traffic

__all__ = ["Plan", "TransformersPlan", "make_plan", "plan_layout", "planned_shape", "parameter_count", "DeviceFigures", "H100", "GPU_BASELINE_GIB"]

GPU_BASELINE_GIB = 1.0  # CUDA context + NCCL buffers per rank: an estimate, not measured here


@dataclass
class Plan:
    layout: Layout
    memory: MemoryPlan
    traffic: dict  # source -> Tally
    time: TimeEstimate
    device: DeviceFigures
    model_name: str = ""  # a transformers model planned through its twin: its class and twin ("": HybridLM)

    @property
    def traffic_by_kind(self) -> dict[str, int]:
        return by_kind(self.traffic)

    @property
    def traffic_by_kind_and_dim(self) -> dict[str, int]:
        return by_kind_and_dim(self.traffic)


def cpu_baseline_gib() -> float:
    """Resident memory of this process (the interpreter, torch and hybridpar imported): what a
    CPU rank holds before its first tensor."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def plan_layout(layout: Layout, device: DeviceFigures = H100, docs_per_pack: int = 1) -> Plan:
    """The plan of an already validated layout (used by the search)."""
    memory = memory_plan(layout)
    traffic = step_traffic(layout, docs_per_pack)
    time = estimate_time(layout, memory.saved_bytes, by_kind_and_dim(traffic), device)
    return Plan(layout, memory, traffic, time, device)


def make_plan(run: RunConfig, world_size: int | None = None, device: DeviceFigures = H100,
              docs_per_pack: int = 1) -> Plan | TransformersPlan:
    """Validate ``run`` as ``train`` does (``ValueError`` with train's message) and plan it; a
    transformers model through its HybridLM twin, or, without one, its parameter share only
    (``TransformersPlan``)."""
    from hybridpar.train.preflight import validate_layout

    world_size, docs_per_pack = python_number(world_size), python_number(docs_per_pack)  # np.int64(8) is 8
    if isinstance(run, RunConfig):  # one built or changed by hand gets load_config's checks (was an AttributeError)
        config_from_dict(to_dict(run))
    if not isinstance(device, DeviceFigures):  # device="h100" was "'str' object has no attribute 'bf16_tflops'"
        raise ValueError(f"device={quoted(device)} is not a DeviceFigures; pass hybridpar.plan.H100, or "
                         "dataclasses.replace(H100, name=..., memory_gib=...) for another device.")
    model = validate_layout(run, world_size)
    most = run.data.pack_size  # a document holds a token at least
    if not isinstance(docs_per_pack, int) or isinstance(docs_per_pack, bool) or not 1 <= docs_per_pack <= most:
        raise ValueError(f"docs_per_pack={docs_per_pack!r:.60} must be an integer in [1, data.pack_size={most}] "
                         "(documents in each pack: the plan's cp_mamba=state traffic is per document).")
    if isinstance(model, HybridConfig):
        return plan_layout(Layout.from_run(run, model), device, docs_per_pack)
    twin, why, name = planned_shape(model, run)
    if twin is None:
        return TransformersPlan.build(run, model, why)
    plan = plan_layout(Layout.from_run(run, twin, hf_decoder=True), device, docs_per_pack)
    plan.model_name = name
    return plan


def lora_mismatch(run: RunConfig, shape, twin: HybridConfig) -> str:
    """``""``, or why the twin cannot price this run's LoRA adapters: the model's adapters (``apply_peft``
    on the meta model) are not the twin's (``peft.target_modules`` naming a layer the twin does not hold)."""
    if run.peft.method != "lora":
        return ""
    from hybridpar.plan.params import parameter_memory
    from hybridpar.train.peft import apply_peft
    from hybridpar.train.hf_model import meta_model

    real = sum(p.numel() for p in apply_peft(run, meta_model(shape)).parameters() if p.requires_grad)
    planned = parameter_memory(Layout.from_run(run, twin, hf_decoder=True)).adapters
    if real == planned:
        return ""
    return (f"its {real:,} LoRA adapter parameters are not the {planned:,} its twin prices (peft.target_modules "
            f"{list(run.peft.target_modules or ())} matches layers the twin names differently or does not hold)")


def planned_shape(shape, run: RunConfig | None = None) -> tuple[HybridConfig | None, str, str]:
    """``(twin, why not, name)`` of a transformers config: the HybridLM twin the planner prices it
    as (``plan/hf/twin.py``), or None and the reason (with ``run``, also when it cannot price the run's
    LoRA adapters: ``lora_mismatch``)."""
    from hybridpar.plan.hf.twin import hybrid_twin
    from hybridpar.train.hf_model import meta_model

    from hybridpar.models.hf.activations import lean_gated_norms, lean_rms_norms
    from hybridpar.parallel.context.hf import attention_problem

    meta = meta_model(shape)
    twin, why = hybrid_twin(shape, sum(p.numel() for p in meta.parameters()))
    if twin is not None and (own := attention_problem(meta)):  # the twin's attention is the blockwise core
        twin, why = None, f"it keeps transformers' own attention, one document per row, because {own.rstrip('.')}"
    if twin is not None:
        twin.lean_norms, twin.lean_gated_norms = bool(lean_rms_norms(meta)), bool(lean_gated_norms(meta))
        why = lora_mismatch(run, shape, twin) if run is not None else ""
        twin = None if why else twin
    layers = getattr(shape, "num_hidden_layers", 0)
    pattern = f"'*-' x {layers}" if twin is None or twin.pattern == "*-" * layers else repr(twin.pattern)
    return twin, why, f"{type(meta).__name__} (transformers; planned as its HybridLM twin, pattern {pattern})"


@dataclass
class TransformersPlan:
    """What the planner says about a transformers model: its size, what trains, and each rank's
    parameters, gradients and AdamW state (elements split evenly over ``tp x dp_shard x cp``;
    activations and traffic are modelled for ``HybridLM`` and the decoders with a twin only)::

        weights  = N / (tp * dp_shard * cp) * e_p      e_p: model.dtype's bytes (fp32 masters under
        grads    = T / (tp * dp_shard * cp) * e_t           mixed_precision=bf16); T: trainable
        AdamW    = 2 * grads                                elements (LoRA: the adapters only, at
                                                            e_t = 4 on a bf16 base, else e_t = e_p)
    """

    name: str
    parameters: int
    trainable: int
    element_bytes: int
    layout: str
    split: int  # tp * dp_shard * cp
    trainable_bytes: int = 0  # e_t; 0: element_bytes
    unmodelled: str = "activations and traffic are modelled for HybridLM configs only"
    square_bytes: int = 0  # transformers' own attention's [S, S] tensors per rank (parallel/context/hf_own_memory)
    pack_size: int = 0
    logits_bytes: int = 0  # the logits path's [T/(cp*tp), V] logits per rank

    @classmethod
    def build(cls, run: RunConfig, shape, unmodelled: str = "") -> "TransformersPlan":
        from hybridpar.parallel.context.hf_own_memory import own_attention_bytes, own_logits_bytes
        from hybridpar.train.peft import apply_peft
        from hybridpar.train.hf_model import meta_model

        meta = apply_peft(run, meta_model(shape))  # peft.method=lora: the base frozen, adapters trainable
        p = run.parallel
        params = sum(t.numel() for t in meta.parameters())
        trainable = sum(t.numel() for t in meta.parameters() if t.requires_grad)
        element = DTYPE_BYTES[run.model.dtype]  # the stored weights (mixed precision: float32 masters)
        computed = 2 if p.mixed_precision == "bf16" else element
        return cls(type(meta).__name__, params, trainable, element,
                   f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp} "
                   f"sequence_parallel={p.sequence_parallel}", p.tp * p.dp_shard * p.cp,
                   adapter_bytes(run.model.dtype) if run.peft.method == "lora" else element,
                   unmodelled or cls.unmodelled, own_attention_bytes(meta, run.data.pack_size, computed, p.tp),
                   run.data.pack_size, own_logits_bytes(meta, run.data.pack_size, computed, p.tp, p.cp))

    @property
    def parameters_per_rank(self) -> int:
        return -(-self.parameters // self.split)

    @property
    def bytes_per_rank(self) -> dict[str, int]:
        grads = -(-self.trainable // self.split) * (self.trainable_bytes or self.element_bytes)
        return {"weights": self.parameters_per_rank * self.element_bytes, "gradients": grads, "adamw": 2 * grads}

    def as_dict(self) -> dict:
        return {"model": {"class": self.name, "parameters": self.parameters, "trainable": self.trainable},
                "layout": self.layout, "parameters_per_rank": self.parameters_per_rank,
                "bytes_per_rank": self.bytes_per_rank, "element_bytes": self.element_bytes,
                "note": f"activations and traffic not included: {self.unmodelled}",
                "square_attention_bytes": self.square_bytes, "logits_bytes": self.logits_bytes}

    def text(self) -> str:
        b = {k: v / 2**30 for k, v in self.bytes_per_rank.items()}
        trains = "all" if self.trainable == self.parameters else f"{self.trainable / 1e6:,.2f}M (LoRA adapters)"
        return (f"model: {self.name} (transformers), {self.parameters / 1e6:,.1f}M parameters, {trains} trainable\n"
                f"layout: {self.layout}\n"
                f"per rank: {self.parameters_per_rank / 1e6:,.1f}M parameters at {self.element_bytes} bytes: weights "
                f"{b['weights']:,.2f} GiB + gradients {b['gradients']:,.2f} GiB + AdamW {b['adamw']:,.2f} GiB = "
                f"{sum(b.values()):,.2f} GiB, activations not included ({self.unmodelled})" + self.square_text())

    def square_text(self) -> str:
        """The lines on transformers' own attention's ``[S, S]`` tensors and the logits path's logits."""
        text = ""
        if self.square_bytes:
            text += (f"\nattention: transformers' own keeps [S, S] tensors: at least {self.square_bytes / 2**30:,.2f} GiB "
                     f"per rank at data.pack_size={self.pack_size}, growing with its square (4x at twice the pack)")
        if self.logits_bytes:
            text += (f"\nloss: through the [tokens, vocabulary] logits: at least {self.logits_bytes / 2**30:,.2f} GiB per "
                     f"rank at data.pack_size={self.pack_size}")
        return text
