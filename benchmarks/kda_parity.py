"""FLA's fused ``chunk_kda`` on CUDA against the pure-PyTorch KDA core, float32 (TF32 off): the Kimi
Delta Attention row beside ``gdn_parity.py`` (the gated DeltaNet) and ``gpu_parity.py`` (Mamba2).

Float32 means IEEE float32 on both sides (torch's TF32 off, ``TRITON_F32_DEFAULT=ieee`` before triton
compiles FLA's kernels); each Triton kernel runs its first autotuning config only (``gdn_parity.py``).

- ``model``: a tiny Kimi Linear (transformers' ``KimiLinearForCausalLM``, hidden 256, two KDA layers
  with Kimi Linear's head dim 128, 4 heads, conv 4; dense MLPs; no MLA layer, whose kernels are not
  under test) on one packed row of 2,048 tokens, 4 documents, through ``install_kda_core``: the loss
  and every parameter gradient with ``use_mamba_kernel("fla")`` against ``use_mamba_kernel("pure")``;
- ``states``: the rule as the CP ``state`` strategy calls it
  (``parallel/context/recurrent/kda.segment_kda_rule``): 6 chunk-padded segments, values ``[0 | v]``
  (2 * 128 = 256 columns), ``[I | 0]`` entering each, the final states read; outputs, final states
  and every input's gradient (q, k, v, the per-channel log decay g, beta).

Each quantity passes when ``max |fused - pure| <= 1e-4 * max |pure|``. Exit status 1 on any failure
(or when the fused kernel cannot run here: the reason is printed).

    python benchmarks/kda_parity.py [--out benchmarks/results] [--dry-run]

``--dry-run`` runs both sections on CPU at small shapes with FLA's contract written out in Python
(``tests/models/linear/kda_contract.py``) standing in for the kernel. Writes ``kda_parity.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import warnings
from pathlib import Path

import gdn_parity  # noqa: F401  (sets TRITON_F32_DEFAULT=ieee before triton loads; puts src/ on the path)
import torch
from gdn_parity import ROOT, _copy, first_config_only, harness, rel

from hybridpar.models.mamba.fused import use_mamba_kernel, use_stand_in
from hybridpar.parallel.precision import set_tf32

TOLERANCE = 1e-4
FULL = dict(tokens=2048, docs=[0, 700, 1200, 1900, 2048], heads=4, head_dim=128, segments=[300, 17, 129, 64, 1, 250])
DRY = dict(tokens=48, docs=[0, 20, 25, 48], heads=2, head_dim=16, segments=[9, 1, 16])


def _modes(dry: bool):
    """``(mode, context)`` pairs: pure, then fused (FLA's kernel, or the contract in a dry run)."""
    return (("pure", use_mamba_kernel("pure")),
            ("fused", use_stand_in("contract", family="kda") if dry else use_mamba_kernel("fla")))


def model_parity(device, sizes: dict, dry: bool) -> list[tuple[str, float]]:
    import transformers as hf

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mixers.kda import install_kda_core

    heads, d = sizes["heads"], sizes["head_dim"]
    config = hf.KimiLinearConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, linear_head_dim=d, linear_num_heads=heads, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 2, mlp_layer_types=["dense"] * 2, use_cache=False, pad_token_id=0)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = hf.KimiLinearForCausalLM(config).float().train()
    with torch.no_grad():  # decay rates A = exp(A_log) in (0.2, 2), as gdn_parity.py (transformers' init: (1, 16))
        for layer in install_kda_core(base):
            A_log = base.get_submodule(layer).forget_gate.A_log
            A_log.copy_(torch.empty(A_log.shape).uniform_(0.2, 2.0, generator=gen).log())
    tokens = sizes["tokens"]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, tokens + 1), generator=gen).to(device)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(sizes["docs"], dtype=torch.int32))
    packed.__dict__.update({k: v.to(device) for k, v in vars(packed).items() if isinstance(v, torch.Tensor)})
    results = {}
    for mode, context in _modes(dry):
        model = _copy(base).to(device)
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
    from hybridpar.parallel.context.recurrent.kda import segment_kda_rule

    chunk, heads, d = 64, sizes["heads"], sizes["head_dim"]
    lengths = torch.tensor(sizes["segments"])
    chunks = (lengths + chunk - 1) // chunk
    ends_at = chunks.cumsum(0)
    starts, ends = (ends_at - chunks).tolist(), (ends_at - 1).tolist()
    padded = int(ends_at[-1]) * chunk
    chunk_segment = torch.repeat_interleave(torch.arange(len(lengths)), chunks).to(device)
    real = torch.zeros(padded, dtype=torch.bool)  # the segments' tokens; zeros after each, as the strategy pads
    for start, length in zip(starts, lengths.tolist()):
        real[start * chunk:start * chunk + length] = True
    gen = torch.Generator().manual_seed(2)

    def leaf(t):
        return (t * real.view(1, -1, *[1] * (t.dim() - 2))).to(device).requires_grad_()

    unit = lambda *s: torch.nn.functional.normalize(torch.randn(1, padded, *s, generator=gen), dim=-1)  # noqa: E731
    inputs = dict(q=leaf(unit(heads, d)), k=leaf(unit(heads, d)), v=leaf(torch.randn(1, padded, heads, d, generator=gen)),
                  g=leaf(-torch.rand(1, padded, heads, d, generator=gen)),
                  beta=leaf(torch.rand(1, padded, heads, generator=gen)))
    identity = torch.eye(d, 2 * d, device=device).expand(len(starts), heads, d, 2 * d)
    out = {}
    for mode, context in _modes(dry):
        kernel = "pure" if mode == "pure" else ("contract" if dry else "fla")
        with context:
            v = torch.cat([torch.zeros_like(inputs["v"]), inputs["v"]], dim=-1)  # values [0 | v]
            o, finals = segment_kda_rule(inputs["q"], inputs["k"], v, inputs["g"], inputs["beta"], identity,
                                         chunk_segment, starts, ends, chunk, kernel, torch.float32)
        probe = torch.Generator().manual_seed(3)
        loss = (o * torch.randn(o.shape, generator=probe).to(device)).sum() + \
            (finals * torch.randn(finals.shape, generator=probe).to(device)).sum()
        out[mode] = (o.detach(), finals.detach(), dict(zip(inputs, torch.autograd.grad(loss, list(inputs.values())))))
    rows = [("o", rel(out["fused"][0], out["pure"][0])), ("final states", rel(out["fused"][1], out["pure"][1]))]
    rows += [(f"grad {name}", rel(out["fused"][2][name], grad)) for name, grad in out["pure"][2].items()]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--dry-run", action="store_true", help="CPU, small shapes, FLA's contract for the kernel")
    args = parser.parse_args()
    if args.dry_run:
        from hybridpar.models.linear.kda_fused import register_kda_rule
        from tests.models.linear.kda_contract import kda_contract

        register_kda_rule("contract", kda_contract)
        device, sizes, name = torch.device("cpu"), DRY, "CPU dry run, FLA's contract for the kernel"
    elif not torch.cuda.is_available():
        print("kda_parity: no CUDA device here; run it on a GPU machine (or --dry-run).", file=sys.stderr)
        return 2
    else:
        device, sizes = torch.device("cuda"), FULL
        name = torch.cuda.get_device_name(device)
        set_tf32(False)
        with contextlib.suppress(ImportError):
            first_config_only()
    meta = {"device": name, "torch": torch.__version__, "tolerance": TOLERANCE,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python benchmarks/kda_parity.py" + (" --dry-run" if args.dry_run else "")}
    sections = harness.parity_sections({"model": lambda: model_parity(device, sizes, args.dry_run),
                                        "states": lambda: state_parity(device, sizes, args.dry_run)}, TOLERANCE)
    return harness.write_parity("kda_parity", "Fused KDA rule (FLA's chunk_kda) vs the pure-PyTorch core "
                                "(float32, TF32 off)", meta, sections, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
