"""The fused gated delta rule on CUDA against the pure-PyTorch core, float32 (TF32 off): the gated DeltaNet
half of issue 25's parity (``gpu_parity.py`` is the Mamba half).

Float32 means IEEE float32 on both sides: torch's TF32 is off and triton's default dot precision
is IEEE (``TRITON_F32_DEFAULT=ieee``, before triton compiles FLA's kernels). Each of FLA's Triton
kernels runs its first autotuning config only: every config computes the same function, and
tuning them all would take most of this script's 20 s (the throughput runs tune as usual).

- ``model``: a tiny Qwen3-Next (transformers' ``Qwen3NextForCausalLM``, hidden 256, two gated
  DeltaNet layers with Qwen3-Next's head dims: 2 key heads, 4 value heads, dk = dv = 128, conv 4;
  dense MLPs; no attention layer, whose kernels are not under test) on one packed row of 2,048
  tokens, 4 documents, through ``install_gdn_core``: the loss and every parameter gradient with
  ``use_mamba_kernel("fla")`` against ``use_mamba_kernel("pure")``;
- ``states``: the rule as the CP ``state`` strategy calls it (``parallel/context/recurrent/gdn.segment_rule``):
  6 chunk-padded segments, values ``[0 | v]`` (dk + dv = 256 columns), ``[I | 0]`` entering each,
  the final states read; outputs, final states and every input's gradient.

Each quantity passes when ``max |fused - pure| <= 1e-4 * max |pure|``. Exit status 1 on any
failure (or when the fused kernel cannot run here: the reason is printed).

    python benchmarks/gdn_parity.py [--out benchmarks/results] [--dry-run]

``--dry-run`` runs both sections on CPU at small shapes with FLA's contract written out in Python
(``tests/models/linear/gdn_contract.py``) standing in for the kernel, at ``DRY_TOLERANCE``: the
contract sums in another order than the pure core, and float32 on a CPU rounds by its kernels
(one host gave 1.01e-4 on a ``dt_bias`` gradient, another under 1e-4); a wrong mapping is off by
order 1. Writes ``gdn_parity.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # FLA's dots: IEEE float32 for parity

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts this checkout's src/ and root first on sys.path)

ROOT = harness.ROOT

from hybridpar.models.mamba.fused import use_mamba_kernel, use_stand_in  # noqa: E402
from hybridpar.parallel.precision import set_tf32  # noqa: E402

TOLERANCE = 1e-4
DRY_TOLERANCE = 1e-3  # the dry run checks the plumbing; float32 rounding differs between CPUs (docstring)
FULL = dict(tokens=2048, docs=[0, 700, 1200, 1900, 2048], heads=(2, 4), head_dim=128, segments=[300, 17, 129, 64, 1, 250])
DRY = dict(tokens=48, docs=[0, 20, 25, 48], heads=(1, 2), head_dim=16, segments=[9, 1, 16])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _modes(dry: bool, family: str):
    """``(mode, context)`` pairs: pure, then fused (FLA's kernel, or the contract in a dry run)."""
    return (("pure", use_mamba_kernel("pure")),
            ("fused", use_stand_in("contract", family=family) if dry else use_mamba_kernel("fla")))


def model_parity(device, sizes: dict, dry: bool) -> list[tuple[str, float]]:
    import transformers as hf

    from hybridpar.models.hf.mixers.gdn import install_gdn_core

    k_heads, v_heads = sizes["heads"]
    config = hf.Qwen3NextConfig(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        vocab_size=1024, use_cache=False, num_hidden_layers=2, layer_types=["linear_attention"] * 2,
        mlp_only_layers=[0, 1], linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
        linear_key_head_dim=sizes["head_dim"], linear_value_head_dim=sizes["head_dim"], linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = hf.Qwen3NextForCausalLM(config).float().train()
    with torch.no_grad():  # decay rates A = exp(A_log) in (0.2, 2), not transformers' init's (0, 16): see below
        for layer in install_gdn_core(base):
            base.get_submodule(layer).A_log.copy_(torch.empty(v_heads).uniform_(0.2, 2.0, generator=gen).log())
    return packed_row_rows(base, sizes, device, dry, "gdn")


def packed_row_rows(base, sizes: dict, device, dry: bool, family: str) -> list[tuple[str, float]]:
    """A copy of ``base`` per kernel on one packed row of ``sizes["docs"]``: the loss and every parameter
    gradient, fused against pure."""
    from hybridpar.data.thd import PackedSeqParams

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, base.config.vocab_size, (1, sizes["tokens"] + 1), generator=gen).to(device)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(sizes["docs"], dtype=torch.int32))
    packed.__dict__.update({k: v.to(device) for k, v in vars(packed).items() if isinstance(v, torch.Tensor)})
    results = {}
    for mode, context in _modes(dry, family):
        model = copy.deepcopy(base).to(device)
        with context:
            logits = model(input_ids=ids[:, :-1], position_ids=packed.position_ids, packed_seq_params=packed,
                           use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[0, 1:])
            loss.backward()
        results[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    rows = [("loss", rel(results["fused"][0], results["pure"][0]))]
    rows += [(f"grad {n}", rel(results["fused"][1][n], g)) for n, g in results["pure"][1].items()]
    return rows


def state_parity(device, sizes: dict, dry: bool) -> list[tuple[str, float]]:
    from hybridpar.parallel.context.recurrent.gdn import segment_rule

    (k_heads, v_heads), d = sizes["heads"], sizes["head_dim"]

    def draw(gen, padded):  # q, k unit [Hk, d]; v [Hv, d]; the log decay g and beta [Hv]
        unit = lambda *s: torch.nn.functional.normalize(torch.randn(1, padded, *s, generator=gen), dim=-1)  # noqa: E731
        return dict(q=unit(k_heads, d), k=unit(k_heads, d), v=torch.randn(1, padded, v_heads, d, generator=gen),
                    g=-torch.rand(1, padded, v_heads, generator=gen), beta=torch.rand(1, padded, v_heads, generator=gen))

    return segment_rows(segment_rule, draw, sizes, device, dry, "gdn")


def segment_rows(segment_call, draw, sizes: dict, device, dry: bool, family: str) -> list[tuple[str, float]]:
    """The ``state`` strategy's segment call on ``sizes["segments"]``, each chunk-padded with zeros as the
    strategy pads, values ``[0 | v]`` and ``[I | 0]`` entering each: outputs, final states and every
    input's gradient, fused against pure. ``draw(gen, padded)`` gives q, k, v, g, beta of ``padded`` tokens."""
    chunk = 64
    lengths = torch.tensor(sizes["segments"])
    chunks = (lengths + chunk - 1) // chunk
    ends_at = chunks.cumsum(0)
    starts, ends = (ends_at - chunks).tolist(), (ends_at - 1).tolist()
    padded = int(ends_at[-1]) * chunk
    chunk_segment = torch.repeat_interleave(torch.arange(len(lengths)), chunks).to(device)
    real = torch.zeros(padded, dtype=torch.bool)  # the segments' tokens; zeros after each
    for start, length in zip(starts, lengths.tolist()):
        real[start * chunk:start * chunk + length] = True
    inputs = {name: (t * real.view(1, -1, *[1] * (t.dim() - 2))).to(device).requires_grad_()
              for name, t in draw(torch.Generator().manual_seed(2), padded).items()}
    heads, d = inputs["v"].shape[2:]
    identity = torch.eye(d, 2 * d, device=device).expand(len(starts), heads, d, 2 * d)
    out = {}
    for mode, context in _modes(dry, family):
        kernel = "pure" if mode == "pure" else ("contract" if dry else "fla")
        with context:
            v = torch.cat([torch.zeros_like(inputs["v"]), inputs["v"]], dim=-1)  # values [0 | v]
            o, finals = segment_call(inputs["q"], inputs["k"], v, inputs["g"], inputs["beta"], identity, chunk_segment,
                                     starts, ends, chunk, kernel, torch.float32)
        probe = torch.Generator().manual_seed(3)
        loss = (o * torch.randn(o.shape, generator=probe).to(device)).sum() + \
            (finals * torch.randn(finals.shape, generator=probe).to(device)).sum()
        out[mode] = (o.detach(), finals.detach(), dict(zip(inputs, torch.autograd.grad(loss, list(inputs.values())))))
    rows = [("o", rel(out["fused"][0], out["pure"][0])), ("final states", rel(out["fused"][1], out["pure"][1]))]
    rows += [(f"grad {name}", rel(out["fused"][2][name], grad)) for name, grad in out["pure"][2].items()]
    return rows


def run(name: str, title: str, register_contract, model_parity, state_parity) -> int:
    """``benchmarks/<name>.py [--out DIR] [--dry-run]``: both sections, written as ``<name>.{json,md}``.
    ``register_contract()`` registers FLA's contract as the dry run's stand-in kernel."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--dry-run", action="store_true", help="CPU, small shapes, FLA's contract for the kernel")
    parser.add_argument("--lift-fla-640", action="store_true",
                        help="run FLA's gated backward where it refuses (Hopper, triton < 3.7.1), to check it")
    args = parser.parse_args()
    module = sys.modules[model_parity.__module__]
    if args.dry_run:
        register_contract()
        device, sizes, device_name = torch.device("cpu"), module.DRY, "CPU dry run, FLA's contract for the kernel"
    elif not torch.cuda.is_available():
        print(f"{name}: no CUDA device here; run it on a GPU machine (or --dry-run).", file=sys.stderr)
        return 2
    else:
        device, sizes = torch.device("cuda"), module.FULL
        device_name = torch.cuda.get_device_name(device)
        set_tf32(False)
        with contextlib.suppress(ImportError):
            harness.limit_autotune(1)  # the first config, untimed: parity, not speed
        if args.lift_fla_640 and harness.lift_fla_640_guard():
            device_name += ", FLA's #640 guard lifted"
    tolerance = DRY_TOLERANCE if args.dry_run else TOLERANCE
    meta = {"device": device_name, "torch": torch.__version__, "tolerance": tolerance,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": f"python benchmarks/{name}.py" + (" --dry-run" if args.dry_run else "")}
    sections = harness.parity_sections({"model": lambda: model_parity(device, sizes, args.dry_run),
                                        "states": lambda: state_parity(device, sizes, args.dry_run)}, tolerance)
    return harness.write_parity(name, title, meta, sections, out=args.out)


def _register_contract() -> None:
    from hybridpar.models.linear.gdn_fused import register_rule
    from tests.models.linear.gdn_contract import gated_delta_contract

    register_rule("contract", gated_delta_contract)


if __name__ == "__main__":
    sys.exit(run("gdn_parity", "Fused gated delta rule vs the pure-PyTorch core (float32, TF32 off)",
                 _register_contract, model_parity, state_parity))
