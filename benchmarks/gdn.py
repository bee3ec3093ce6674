"""Gated DeltaNet hybrids on CPU at cp=1: a packed row through hybridpar's core against transformers' torch
path on one document per row.

Qwen3-Next and Qwen3.5, each a small random float32 model built from transformers' config classes:
hidden 256, one gated DeltaNet layer (4 key heads, 8 value heads, head dims 64, conv 4) and one
attention layer (4 heads, 2 KV heads, head dim 64), dense MLP 512, vocab 1024. ``T`` tokens as 4 equal
documents; forward + backward of the summed logits:

- ``ours``: one packed row of ``T`` tokens, ``install_gdn_core`` + hybridpar's blockwise attention,
  documents from ``packed_seq_params`` (exact per document);
- ``transformers``: the same 4 documents as 4 rows of ``T/4`` (one document per row, what these
  models trained as before: correct, and here without padding), transformers' torch path
  (``torch_chunk_gated_delta_rule``, chunk 64, SDPA).

- ``rule`` rows: the gated delta rule alone (8 value heads over 4 key heads, head dims 64, chunk 64),
  ours on the packed row with its 4 documents against transformers' ``torch_chunk_gated_delta_rule``
  on the 4 rows.

Wall time: median of ``--repeats`` runs after one warm-up, one torch thread (the machine is shared).
Peak memory: one forward+backward in a fresh process per (architecture, path, T)
(``paths.time_and_peak``), in MiB.

    python benchmarks/gdn.py [--lengths 2048 8192] [--repeats 3]

Prints a table and writes benchmarks/results/gdn.{json,md}.
"""

from __future__ import annotations

import argparse
import warnings

import paths  # puts this checkout's src/ first on sys.path (through harness)
import torch

ARCHS = ("qwen3_next", "qwen3_5")
DOCS = 4
_C = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
          vocab_size=1024, use_cache=False, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
          linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)


def build(name: str):
    import transformers as hf

    builders = {
        "qwen3_next": lambda: hf.Qwen3NextForCausalLM(hf.Qwen3NextConfig(mlp_only_layers=[0, 1], **_C)),
        "qwen3_5": lambda: hf.Qwen3_5ForCausalLM(hf.Qwen3_5TextConfig(**_C)),
    }
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return builders[name]().train()


def step_fn(name: str, path: str, tokens: int):
    """A closure running one forward + backward of ``name`` on ``tokens`` tokens (4 documents)."""
    if name == "rule":
        return rule_fn(path, tokens)
    from hybridpar.models.hf.mixers.gdn import install_gdn_core

    return paths.packed_or_rows_step(build(name), install_gdn_core, path, tokens, DOCS)


def rule_fn(path: str, tokens: int):
    """A closure running forward + backward of the gated delta rule alone (module docstring)."""
    from hybridpar.models.linear.gated_delta import chunk_gated_delta_rule
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    heads, dim = _C["linear_num_value_heads"], _C["linear_key_head_dim"]
    q = torch.randn(1, tokens, heads // 2, dim, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, tokens, heads // 2, dim, generator=gen), dim=-1)
    v = torch.randn(1, tokens, heads, dim, generator=gen)
    g, beta = -0.1 * torch.rand(1, tokens, heads, generator=gen), torch.rand(1, tokens, heads, generator=gen)
    return paths.rule_step(chunk_gated_delta_rule, torch_chunk_gated_delta_rule, [q, k, v, g, beta], path, tokens, DOCS)


NOTES = ["4 equal documents, small random float32 models (module docstring), forward + backward of the summed",
         "logits: ours packs them in one row, transformers runs them one per row (no padding here; real data",
         "pays the padding of one document per row on top). 'rule': the gated delta rule alone (peak not measured)."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    paths.add_grid_arguments(parser, lengths=[2048, 8192], archs=[*ARCHS, "rule"], out="gdn")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = paths.run_grid(args, lambda arch, path, tokens: paths.time_and_peak(
        step_fn, arch, path, tokens, args.repeats, args.threads, peak=arch != "rule"))
    paths.write_report(__file__, __doc__.splitlines()[0], args, rows, "ours (1 packed row)", "transformers (4 rows)", NOTES)


if __name__ == "__main__":
    main()
