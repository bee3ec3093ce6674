"""The fused Mamba path on CUDA against the pure-PyTorch core, float32 (TF32 off): issue 25's parity.

Float32 means IEEE float32 on both sides: torch's TF32 is off and triton's default dot
precision is set to IEEE (``TRITON_F32_DEFAULT=ieee``, before triton compiles FLA's kernels).

- ``model``: the ``small`` preset on one packed row (4,096 tokens, 5 documents): loss and every
  parameter gradient with ``use_mamba_kernel("fla")`` against ``use_mamba_kernel("pure")`` (the
  fused norms of ``models/norm_kernels.py`` too: torch's RMSNorm and FLA's gated norm);
- ``states``: the core as the CP ``state`` strategy calls it (``small``'s Mamba shapes, 4
  documents): conv histories and SSM states entering every document (one entry -1), final
  states at every document end; outputs, final states and the gradient of every input.

Each quantity passes when ``max |fused - pure| <= 1e-4 * max |pure|``. Exit status 1 on any
failure (or when the fused kernel cannot run here: the reason is printed).

- ``saturated`` (a report, not a gate: its own ``gpu_saturated.{json,md}``, outside the exit status):
  round 28's spike, one token whose ``dt`` saturates the softplus (``dt_bias`` 1e6 there) among
  steps of ``dt * A`` ~ -7e-3, on ``small``'s Mamba shapes; the pure core and the fused one in
  float32 against the pure core in float64. The pure core keeps its within-chunk cumsum in float64
  (1e-7 on CPU); a kernel taking differences of float32 cumsums loses every later step of the chunk.

    python benchmarks/gpu_parity.py [--out benchmarks/results]

Writes ``gpu_parity.json`` and ``gpu_parity.md``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
from pathlib import Path

# FLA's kernels use triton's default dot precision, TF32 for float32 inputs: IEEE for parity.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts this checkout's src/ first on sys.path)

ROOT = harness.ROOT

from hybridpar.data.thd import PackedSeqParams  # noqa: E402
from hybridpar.models.hybrid import HybridConfig, HybridLM  # noqa: E402
from hybridpar.models.mamba.core import mamba_conv_scan  # noqa: E402
from hybridpar.models.mamba.fused import use_mamba_kernel  # noqa: E402
from hybridpar.parallel.precision import set_tf32  # noqa: E402

TOLERANCE = 1e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def model_parity(device) -> list[tuple[str, float]]:
    torch.manual_seed(0)
    reference = HybridLM(HybridConfig.from_preset("small")).to(device)
    fused = copy.deepcopy(reference)
    ids = torch.randint(0, reference.config.vocab_size, (1, 4097), generator=torch.Generator().manual_seed(1)).to(device)
    cu = torch.tensor([0, 1000, 1800, 2600, 3100, 4096], dtype=torch.int32)
    packed = PackedSeqParams.from_cu_seqlens(cu)
    packed.__dict__.update({k: v.to(device) for k, v in vars(packed).items() if isinstance(v, torch.Tensor)})
    results = {}
    for mode, model in (("pure", reference), ("fla", fused)):
        with use_mamba_kernel(mode):
            loss, count = model(ids[:, :-1], packed=packed, labels=ids[:, 1:])
            (loss / count).backward()
        results[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    rows = [("loss", rel(results["fla"][0], results["pure"][0]))]
    rows += [(f"grad {n}", rel(results["fla"][1][n], g)) for n, g in results["pure"][1].items()]
    return rows


def state_parity(device) -> list[tuple[str, float]]:
    c = HybridConfig.from_preset("small")
    heads, p, n, g, k = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.mamba_n_groups, c.conv_kernel
    width = heads * p + 2 * g * n
    gen = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 700, 1500, 2300, 3072])
    docs, tokens = cu.shape[0] - 1, int(cu[-1])

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device).requires_grad_()

    inputs = dict(xBC=leaf(1, tokens, width), dt=leaf(1, tokens, heads), conv_weight=leaf(width, k, scale=0.5),
                  conv_bias=leaf(width, scale=0.1), dt_bias=leaf(heads, scale=0.5),
                  A_log=(torch.rand(heads, generator=gen) * 2).log().to(device).requires_grad_(), D=leaf(heads),
                  conv_history=leaf(docs, k - 1, width), init_states=leaf(docs, heads, p, n, scale=0.1))
    init_at = cu[:-1].clone()
    init_at[2] = -1
    options = dict(head_dim=p, state_size=n, chunk_size=c.chunk_size, cu_docs=cu.to(device), dt_limit=c.time_step_limit,
                   init_at=init_at.to(device), final_at=(cu[1:] - 1).to(device))
    weights = torch.Generator().manual_seed(3)
    out = {}
    for mode in ("pure", "fla"):
        with use_mamba_kernel(mode):
            y, final = mamba_conv_scan(*list(inputs.values())[:7], conv_history=inputs["conv_history"],
                                       init_states=inputs["init_states"], **options)
        probe_y = torch.randn(y.shape, generator=weights.manual_seed(4)).to(device)
        probe_f = torch.randn(final.shape, generator=weights.manual_seed(5)).to(device)
        grads = torch.autograd.grad((y * probe_y).sum() + (final * probe_f).sum(), list(inputs.values()))
        out[mode] = (y.detach(), final.detach(), dict(zip(inputs, grads)))
    rows = [("y", rel(out["fla"][0], out["pure"][0])), ("final states", rel(out["fla"][1], out["pure"][1]))]
    rows += [(f"grad {name}", rel(out["fla"][2][name], grad)) for name, grad in out["pure"][2].items()]
    return rows


def saturated_precision(device) -> list[tuple[str, float]]:
    """Round 28's saturated ``dt`` on CUDA: ``y``, the final states and the gradients of ``dt_bias`` and
    ``A_log``, per kernel in float32, relative to the pure core in float64."""
    c = HybridConfig.from_preset("small")
    heads, p, n, g, k = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.mamba_n_groups, c.conv_kernel
    gen = torch.Generator().manual_seed(6)
    cu = torch.tensor([0, 1000, 2048])
    tokens = int(cu[-1])
    base = dict(xBC=torch.randn(1, tokens, heads * p + 2 * g * n, generator=gen),
                dt=torch.full((1, tokens, heads), -5.0).index_fill_(1, torch.tensor([37, 1100]), 1e6),
                conv_weight=torch.randn(heads * p + 2 * g * n, k, generator=gen) * 0.5,
                conv_bias=torch.randn(heads * p + 2 * g * n, generator=gen) * 0.1, dt_bias=torch.zeros(heads),
                A_log=torch.full((heads,), 2.0), D=torch.randn(heads, generator=gen))
    options = dict(head_dim=p, state_size=n, chunk_size=c.chunk_size, cu_docs=cu.to(device), dt_limit=(0.0, float("inf")),
                   final_at=(cu[1:] - 1).to(device))
    probe = torch.Generator().manual_seed(7)
    out = {}
    for mode, dtype in (("pure", torch.float64), ("pure", torch.float32), ("fla", torch.float32)):
        inputs = {name: t.to(device, dtype).requires_grad_() for name, t in base.items()}
        with use_mamba_kernel(mode):
            y, final = mamba_conv_scan(*inputs.values(), **options)
        probe_y = torch.randn(y.shape, generator=probe.manual_seed(8)).to(device, dtype)
        d_bias, d_a = torch.autograd.grad((y * probe_y).sum() + final.sum(), [inputs["dt_bias"], inputs["A_log"]])
        out[mode, dtype] = dict(y=y.detach(), final=final.detach(), dt_bias=d_bias, A_log=d_a)
    reference = out["pure", torch.float64]
    return [(f"{mode} float32 {name}", rel(out[mode, torch.float32][name].double(), ref))
            for mode in ("pure", "fla") for name, ref in reference.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--autotune-keep", type=int, default=0,
                        help="Triton autotuners time at most this many configs each (0: all; a short lease: 3)")
    parser.add_argument("--lift-fla-640", action="store_true",
                        help="run FLA's gated backward where it refuses (Hopper, triton < 3.7.1), to check or time it")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_parity: no CUDA device here; run it on a GPU machine.", file=sys.stderr)
        return 2
    harness.limit_autotune(args.autotune_keep)
    lifted = harness.lift_fla_640_guard() if args.lift_fla_640 else None
    device = torch.device("cuda")
    set_tf32(False)
    meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python benchmarks/gpu_parity.py" + (" --lift-fla-640" if args.lift_fla_640 else ""),
            "tolerance": TOLERANCE, "fla_guard_lifted": lifted}
    sections = harness.parity_sections({"model": lambda: model_parity(device), "states": lambda: state_parity(device)},
                                       TOLERANCE)
    status = harness.write_parity("gpu_parity", "Fused Mamba path vs the pure-PyTorch core on CUDA (float32, TF32 off)",
                                  meta, sections, out=args.out)
    saturated = harness.parity_sections({"saturated": lambda: saturated_precision(device)}, TOLERANCE)
    harness.write_parity("gpu_saturated", "A saturated dt on CUDA: each kernel in float32 vs the pure core in float64",
                         meta, saturated, out=args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
