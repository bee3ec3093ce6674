"""A step-time ESTIMATE from stated device figures (H100 SXM defaults), not a measurement.

Per rank and step (``m`` packs of ``Tc`` tokens; widths TP-local)::

    matmul FLOPs   = m * Tc * 2 * N_matmul * (3 + r)     forward 1, backward 2, recompute r
                     (r = 1 for full, 0 otherwise; N_matmul = TP-local projection weights; under LoRA
                     backward 1 (dX only: frozen weights), none in the blocks no gradient reaches,
                     plus each adapter factor's forward, dX and dW: 3 x 2 Tc numel; a MoE block's
                     router and latent projections run whole on every TP rank: ``moe_replicated_elements``;
                     a router load-balancing term's softmax and sums, ~5 Tc E per layer, are left out)
    loss FLOPs     = m * Tc * 2 * V/tp * D * 4           logits in forward, recomputed + 2 in backward (LoRA: + 1)
    attention      = m * 4 * Tc * (T/2) * Hq/tp * Dh * (1 + 2.5 + r)   causal, one document (upper bound)
    SSD scan       = m * Tc * 2 * (H/tp) * (Q * (P + N) + 2 P N) * (3 + r)   chunked: intra + inter chunk
    compute_s      = FLOPs / (bf16_tflops * RATE[matmul precision] * efficiency)
    memory_s       = 3 * saved activation bytes * m / hbm_bandwidth    (written, read, gradient)
    comm_s         = sum over mesh dims of bytes / bandwidth(dim)      (no overlap assumed)

``bandwidth(dim)`` is ``link_gbps`` for dims inside a node (``gpus_per_node``) and ``network_gbps``
for data-parallel dims once the world spans nodes. The sum is a pessimistic serial bound; real
overlap makes steps faster, kernels below ``efficiency`` slower.

The matmul rate follows what the matmuls run in (``Layout.matmul_precision``), as a fraction of the
bf16 tensor-core peak: TF32 runs at half of it, float32 without TF32 and float64 on the vector or FP64
units at about 1/15 (H100 SXM: 989 bf16, 495 TF32, 67 FP32 and FP64 TFLOP/s; A100: 312, 156, 19.5, 19.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.plan.hf.moe import moe_matmul_elements, moe_replicated_elements
from hybridpar.plan.hf.zamba2 import zamba2_matmul_elements
from hybridpar.plan.layout import Layout
from hybridpar.plan.params import adapter_params, grad_flow

__all__ = ["DeviceFigures", "TimeEstimate", "estimate_time", "H100", "RATE"]

RATE = {"bf16": 1.0, "tf32": 0.5, "float32": 67 / 989, "float64": 67 / 989}  # of the bf16 dense peak


@dataclass(frozen=True)
class DeviceFigures:
    name: str = "H100 SXM 80GB (assumed)"
    memory_gib: float = 80.0
    bf16_tflops: float = 989.0  # dense bf16 tensor-core peak
    efficiency: float = 0.4  # fraction of peak the matmuls reach
    hbm_tbps: float = 3.35
    link_gbps: float = 450.0  # NVLink, per direction per GPU
    network_gbps: float = 50.0  # 400 Gb/s InfiniBand per GPU
    gpus_per_node: int = 8

    def __post_init__(self):
        import math

        for name in ("memory_gib", "bf16_tflops", "efficiency", "hbm_tbps", "link_gbps", "network_gbps", "gpus_per_node"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0) or \
                    (name == "efficiency" and value > 1):
                raise ValueError(f"DeviceFigures.{name}={value!r} is invalid: every device figure must be a finite "
                                 "number > 0 (efficiency at most 1).")


H100 = DeviceFigures()


@dataclass(frozen=True)
class TimeEstimate:
    flops: float
    compute_s: float
    memory_s: float
    comm_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.memory_s + self.comm_s

    def tokens_per_s(self, tokens_per_step: int) -> float:
        return tokens_per_step / self.step_s if self.step_s else float("inf")


def step_flops(layout: Layout) -> float:
    c, tp, tc = layout.model, layout.tp, layout.tokens
    r = 1 if layout.checkpointing == "full" else 0
    d, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    d_in = c.mamba_num_heads * c.mamba_head_dim
    w_in = 2 * d_in + 2 * c.mamba_n_groups * c.ssm_state_size + c.mamba_num_heads
    mlp = c.intermediate_size * d * (3 if c.mlp_gated else 2)
    per_kind = {"M": d * w_in + d_in * d, "*": d * (q + 2 * kv) + q * d, "-": mlp}
    per_kind["P"] = per_kind["M"] + per_kind["*"]  # a twin's parallel layer (Falcon-H1): both mixers
    replicated = 0
    if "E" in c.pattern:  # a transformers twin's MoE blocks: router, k experts, shared experts (latent projections);
        per_kind["E"], replicated = moe_matmul_elements(c), moe_replicated_elements(c)  # the router's, latents' whole
    shared = 0
    if "Z" in c.pattern:  # a Zamba2 shared block's use: attention on [T, 2D], fused MLP, adapters, linear
        per_kind["Z"], shared = zamba2_matmul_elements(c)
    heads = c.mamba_num_heads / tp
    ssd = 2 * heads * (c.chunk_size * (c.mamba_head_dim + c.ssm_state_size) + 2 * c.mamba_head_dim * c.ssm_state_size)
    attention = 4 * tc * (layout.pack_size / 2) * q / tp
    flow, frozen = grad_flow(layout), bool(layout.lora_rank)
    flops = 0.0
    for kind, reached in zip(c.pattern, flow.output):  # LoRA: no backward where no gradient reaches, and a
        passes = 1 + (((1 if frozen else 2) + r) if reached else 0)  # frozen weight's backward is dX only
        flops += tc * 2 * per_kind[kind] / tp * passes
        flops += (kind == "E") * tc * 2 * replicated * (1 - 1 / tp) * passes  # the router, latent projections
        flops += (kind == "Z") * tc * 2 * shared * (1 - 1 / tp) * passes  # the linear, the adapters' replicated factors
        flops += (kind in "*PZ") * attention * (1 + ((2.5 + r) if reached else 0))
        flops += (kind in "MP") * tc * ssd * passes
    adapters = adapter_params(layout) if frozen else {}  # each factor: forward, dX and dW
    flops += sum(tc * 2 * math.prod(p.shape) * 3 for unit in adapters.values() for p in unit)
    flops += tc * 2 * c.vocab_size / tp * d * (3 if frozen else 4)  # a frozen head: no weight gradient
    return flops * layout.packs_per_rank


def estimate_time(layout: Layout, saved_bytes: int, traffic_by_dim: dict[str, int],
                  device: DeviceFigures = H100) -> TimeEstimate:
    flops = step_flops(layout)
    compute = flops / (device.bf16_tflops * RATE[layout.matmul_precision] * 1e12 * device.efficiency)
    memory = 3 * saved_bytes * layout.packs_per_rank / (device.hbm_tbps * 1e12)
    multi_node = layout.dims.world_size > device.gpus_per_node
    comm = 0.0
    for key, nbytes in traffic_by_dim.items():
        dims = key.split("/")[1].split("+")
        slow = multi_node and any(dim.startswith("dp") for dim in dims)
        comm += nbytes / ((device.network_gbps if slow else device.link_gbps) * 1e9)
    return TimeEstimate(flops, compute, memory, comm)
