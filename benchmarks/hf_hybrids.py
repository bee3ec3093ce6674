"""transformers' Mamba2 hybrids on CPU at cp=1: hybridpar's cores against transformers' own torch path.

Five architectures (Granite 4.0-H MoE, Falcon-H1, Nemotron-H, Bamba, Zamba2), each a small
random float32 model built from transformers' config classes: hidden 256, one Mamba2 layer
(8 heads x 64, 1 group, state 64, chunk 256) and one attention layer (4 heads, 2 KV heads),
vocab 1024. ``--archs lfm2``: LFM2 at the same width, one gated short-convolution layer (kernel 3)
and one attention layer, ours through hybridpar's document-resetting conv (``install_short_conv``). One packed row of ``T`` tokens holding 4 equal documents; forward + backward of
the summed logits:

- ``ours``: ``install_mamba_core`` + hybridpar's blockwise attention, documents from
  ``packed_seq_params`` (exact per document);
- ``transformers``: the model as transformers runs it without mamba_ssm (its torch SSD, SDPA
  with the per-document mask built from position ids). Its Mamba mixers do not reset at the
  document starts: the timing is of the same amount of work, not of a correct packed step.

Wall time: median of ``--repeats`` runs after one warm-up, one torch thread (the machine is
shared). Peak memory: one forward+backward in a fresh process per (architecture, path, T)
(``harness.run_fresh`` + ``harness.measure_peak``: peak RSS over the RSS just before the call), in MiB.

    python benchmarks/hf_hybrids.py [--lengths 4096 16384] [--repeats 3] [--long-paths ours]

Prints a table and writes benchmarks/results/hf_hybrids.{json,md}.
"""

from __future__ import annotations

import argparse
import warnings

import harness
import torch

ARCHS = ("granite_moe", "falcon_h1", "nemotron_h", "bamba", "zamba2")
_C = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
          use_cache=False)
_M = dict(mamba_d_state=64, mamba_n_groups=1, mamba_chunk_size=256)


def build(name: str):
    import transformers as hf

    builders = {
        "granite_moe": lambda: hf.GraniteMoeHybridForCausalLM(hf.GraniteMoeHybridConfig(
            num_hidden_layers=2, layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=64, mamba_expand=2,
            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=512, **_M, **_C)),
        "falcon_h1": lambda: hf.FalconH1ForCausalLM(hf.FalconH1Config(
            num_hidden_layers=2, mamba_n_heads=8, mamba_d_head=64, mamba_d_ssm=512, **_M, **_C)),
        "nemotron_h": lambda: hf.NemotronHForCausalLM(hf.NemotronHConfig(
            layers_block_type=["mamba", "attention"], head_dim=64, mamba_num_heads=8, mamba_head_dim=64,
            ssm_state_size=64, n_groups=1, chunk_size=256, **_C)),
        "bamba": lambda: hf.BambaForCausalLM(hf.BambaConfig(
            num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=64, **_M, **_C)),
        "zamba2": lambda: hf.Zamba2ForCausalLM(hf.Zamba2Config(
            num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_d_state=64, n_mamba_heads=8,
            mamba_ngroups=1, chunk_size=256, **_C)),
        "lfm2": lambda: hf.Lfm2ForCausalLM(hf.Lfm2Config(
            num_hidden_layers=2, layer_types=["conv", "full_attention"], block_ff_dim=512, conv_L_cache=3, **_C)),
    }
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return builders[name]().train()


def step_fn(name: str, path: str, tokens: int):
    """A closure running one forward + backward of ``name`` on a packed row of ``tokens``."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mamba_mixers import install_mamba_core
    from hybridpar.models.hf.short_conv import install_short_conv
    from hybridpar.parallel.context.hf import use_hybridpar_attention

    model = build(name)
    ids = torch.randint(0, _C["vocab_size"], (1, tokens))
    cu = torch.arange(0, tokens + 1, tokens // 4, dtype=torch.int32)
    packed = PackedSeqParams.from_cu_seqlens(cu)
    inputs = {"input_ids": ids, "position_ids": packed.position_ids, "use_cache": False}
    if path == "ours":
        install_mamba_core(model)
        install_short_conv(model)
        use_hybridpar_attention(model)
        inputs["packed_seq_params"] = packed

    def step():
        model.zero_grad(set_to_none=True)
        model(**inputs).logits.sum().backward()

    return step


def peak_case(name: str, path: str, tokens: int, threads: int) -> dict:
    """(in a fresh process) the peak RSS one step adds, MiB: imports and the model build do not count."""
    torch.set_num_threads(threads)
    step = step_fn(name, path, tokens)
    return {"peak_mib": harness.measure_peak(step)["peak_bytes"] / 2**20}


def measure(name: str, path: str, tokens: int, repeats: int, threads: int) -> dict:
    seconds = harness.timed(step_fn(name, path, tokens), repeats=repeats, warmup=1)["median_s"]
    try:
        peak, error = harness.run_fresh(peak_case, name, path, tokens, threads, threads=threads)["peak_mib"], None
    except harness.CaseError as failure:
        peak, error = None, str(failure)[:200]
    return {"arch": name, "path": path, "tokens": tokens, "seconds": seconds, "peak_mib": peak, "error": error}


def report(meta: dict, rows: list[dict], lengths, archs) -> str:
    fmt = lambda v, f="{:.0f}": "not run" if v is None else f.format(v)  # noqa: E731
    lines = harness.header(__doc__.splitlines()[0], meta) + [
        "", "| arch | T | ours s | transformers s | ours peak MiB | transformers peak MiB |", "| --- | --- | --- | --- | --- | --- |"]
    for tokens in lengths:
        for name in archs:
            found = {r["path"]: r for r in rows if (r["arch"], r["tokens"]) == (name, tokens)}
            ours, theirs = found.get("ours", {}), found.get("transformers", {})
            lines.append(f"| {name} | {tokens} | {fmt(ours.get('seconds'), '{:.2f}')} | "
                         f"{fmt(theirs.get('seconds'), '{:.2f}')} | {fmt(ours.get('peak_mib'))} | {fmt(theirs.get('peak_mib'))} |")
    lines += ["", "One packed row of 4 equal documents, small random float32 models (module docstring), forward +",
              "backward of the summed logits. transformers' path does not reset its Mamba state (or short conv) at document starts:",
              "the same amount of work, not a correct packed step. 'not run': the path was not asked for at that length."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), help=f"of {ARCHS} and lfm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--paths", nargs="+", default=["ours", "transformers"])
    parser.add_argument("--long-paths", nargs="+", default=None,
                        help="paths run at lengths above 4096 (default: --paths)")
    parser.add_argument("--out", default="hf_hybrids")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for tokens in args.lengths:
        for name in args.archs:
            for path in (args.paths if tokens <= 4096 or args.long_paths is None else args.long_paths):
                row = measure(name, path, tokens, args.repeats, args.threads)
                rows.append(row)
                print(f"{name:<12} {path:<13} T={tokens:>6}  {row['seconds']:8.2f} s  peak {row['peak_mib']} MiB",
                      flush=True)
    meta = {**harness.environment(__file__), "threads": args.threads}
    harness.write_results(args.out, {"meta": meta, "rows": rows}, report(meta, rows, args.lengths, args.archs))


if __name__ == "__main__":
    main()
