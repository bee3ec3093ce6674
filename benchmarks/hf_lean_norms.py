"""Bytes kept for backward by transformers models with their norms as transformers runs them, and as
hybridpar runs them in their place (``models/hf/activations.use_lean_rms_norms``).

The models of ``hf_hybrids.py`` (Granite 4.0-H MoE, Falcon-H1, Nemotron-H, Bamba, Zamba2: hidden 256,
one Mamba2 layer of 8 heads x 64, one attention layer) and a Llama of the same widths (two layers),
float32, each built as training builds it (``install_cores``, hybridpar's attention), on one packed
row of ``T`` tokens holding 4 documents. For each: the bytes autograd keeps over one forward
(``tests/op_outputs.kept_for_backward``, each storage once), once with every lean norm put back on
transformers' forward and once as trained. A count, not a time: it depends on the shapes only.

    python benchmarks/hf_lean_norms.py [--tokens 16384] [--archs bamba llama]

Writes ``hf_lean_norms.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts this checkout's src/ and root first on sys.path)
import hf_hybrids  # noqa: E402

from hybridpar.data.thd import PackedSeqParams  # noqa: E402
from hybridpar.models.hf.activations import LEAN_NORM_MARK, lean_gated_norms, lean_rms_norms  # noqa: E402
from hybridpar.parallel.context.hf import use_hybridpar_attention  # noqa: E402
from hybridpar.train.hf_model import install_cores  # noqa: E402
from tests.op_outputs import kept_for_backward  # noqa: E402

ARCHS = (*hf_hybrids.ARCHS, "llama")


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch != "llama":
        return hf_hybrids.build(arch)
    from transformers import LlamaConfig, LlamaForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LlamaForCausalLM(LlamaConfig(**hf_hybrids._C, num_hidden_layers=2)).train()


def kept_mib(arch: str, tokens: int, lean: bool) -> tuple[float, int, int]:
    """``(MiB kept over one forward, lean RMSNorms, lean gated norms)``."""
    model = install_cores(build(arch))
    use_hybridpar_attention(model)
    plain, gated = lean_rms_norms(model), lean_gated_norms(model)
    if not lean:
        for norm in plain + gated:  # transformers' forward again
            del norm.forward
            delattr(norm, LEAN_NORM_MARK)
    ids = torch.randint(0, hf_hybrids._C["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(1))
    packed = PackedSeqParams.from_cu_seqlens(torch.arange(0, tokens + 1, tokens // 4, dtype=torch.int32))
    with kept_for_backward() as kept:
        model(input_ids=ids, position_ids=packed.position_ids, use_cache=False, packed_seq_params=packed)
    return sum(kept.values()) / 2**20, len(plain), len(gated)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    meta = harness.environment(__file__, argv)
    rows = []
    for arch in args.archs:
        theirs, plain, gated = kept_mib(arch, args.tokens, lean=False)
        ours = kept_mib(arch, args.tokens, lean=True)[0]
        rows.append({"arch": arch, "tokens": args.tokens, "lean_rms_norms": plain, "lean_gated_norms": gated,
                     "transformers_norms_mib": theirs, "lean_norms_mib": ours})
        print(rows[-1], flush=True)
    lines = harness.header("Kept for backward: transformers' norms against hybridpar's lean norms", meta)
    lines += ["", "One forward of a packed row (4 documents), float32, the model as training builds it; MiB kept "
              "for backward (each storage once).", "",
              "| model | tokens | lean RMSNorms | lean gated norms | transformers' norms MiB | lean norms MiB | less |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['arch']} | {r['tokens']:,} | {r['lean_rms_norms']} | {r['lean_gated_norms']} | "
              f"{r['transformers_norms_mib']:,.1f} | {r['lean_norms_mib']:,.1f} | "
              f"{1 - r['lean_norms_mib'] / r['transformers_norms_mib']:.0%} |" for r in rows]
    harness.write_results("hf_lean_norms", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n", out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
