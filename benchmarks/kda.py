"""Kimi Linear on CPU at cp=1: a packed row through hybridpar's KDA core against transformers' torch
path on one document per row.

A small random float32 Kimi Linear built from transformers' config class: hidden 256, one Kimi Delta
Attention layer (4 heads of 64, conv 4) and one MLA layer (4 heads, no RoPE, kv rank 64), dense MLPs
512, vocab 1024. ``T`` tokens as 4 equal documents; forward + backward of the summed logits:

- ``ours``: one packed row of ``T`` tokens, ``install_kda_core`` + hybridpar's blockwise attention,
  documents from ``packed_seq_params`` (exact per document);
- ``transformers``: the same 4 documents as 4 rows of ``T/4`` (one document per row, what Kimi Linear
  trained as before: correct, and here without padding), transformers' torch path
  (``chunk_kimi_delta_attention``, chunk 64, SDPA).

- ``rule`` rows: the KDA rule alone (4 heads of 64, chunk 64), ours on the packed row with its 4
  documents against transformers' ``chunk_kimi_delta_attention`` on the 4 rows.

Wall time: median of ``--repeats`` runs after one warm-up, one torch thread (the machine is shared).
Peak memory: one forward+backward in a fresh process per (architecture, path, T)
(``paths.time_and_peak``), in MiB.

    python benchmarks/kda.py [--lengths 2048 4096] [--repeats 3]

Prints a table and writes benchmarks/results/kda.{json,md}.
"""

from __future__ import annotations

import argparse
import warnings

import paths  # puts this checkout's src/ first on sys.path (through harness)
import torch

DOCS = 4
HEADS, DIM = 4, 64
_C = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
          use_cache=False, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
          mlp_layer_types=["dense", "dense"], kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=32,
          qk_nope_head_dim=32, v_head_dim=64, linear_head_dim=DIM, linear_num_heads=HEADS, linear_conv_kernel_dim=4,
          pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build():
    import transformers as hf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf.KimiLinearForCausalLM(hf.KimiLinearConfig(**_C)).train()


def step_fn(name: str, path: str, tokens: int):
    """A closure running one forward + backward of ``name`` on ``tokens`` tokens (4 documents)."""
    if name == "rule":
        return rule_fn(path, tokens)
    from hybridpar.models.hf.mixers.kda import install_kda_core

    return paths.packed_or_rows_step(build(), install_kda_core, path, tokens, DOCS)


def rule_fn(path: str, tokens: int):
    """A closure running forward + backward of the KDA rule alone (module docstring)."""
    from hybridpar.models.linear.kda import chunk_kda_rule
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, tokens, HEADS, DIM, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, tokens, HEADS, DIM, generator=gen), dim=-1)
    v = torch.randn(1, tokens, HEADS, DIM, generator=gen)
    g, beta = -0.1 * torch.rand(1, tokens, HEADS, DIM, generator=gen), torch.rand(1, tokens, HEADS, generator=gen)
    return paths.rule_step(chunk_kda_rule, chunk_kimi_delta_attention, [q, k, v, g, beta], path, tokens, DOCS)


NOTES = ["4 equal documents, a small random float32 Kimi Linear (module docstring), forward + backward of the",
         "summed logits: ours packs them in one row, transformers runs them one per row (no padding here; real",
         "data pays the padding of one document per row on top). 'rule': the KDA rule alone (peak not measured)."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    paths.add_grid_arguments(parser, lengths=[2048, 4096], archs=["kimi_linear", "rule"], out="kda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = paths.run_grid(args, lambda arch, path, tokens: paths.time_and_peak(
        step_fn, arch, path, tokens, args.repeats, args.threads, peak=arch != "rule"))
    paths.write_report(__file__, __doc__.splitlines()[0], args, rows, "ours (1 packed row)", "transformers (4 rows)", NOTES)


if __name__ == "__main__":
    main()
