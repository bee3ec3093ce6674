"""Memory in sequence length, family by family: the peak of live tensor bytes of one training
step (forward + backward of ``pack_loss_sum``, the trainer's loss) at T, 2T and 4T tokens.

Each family is a tiny transformers checkpoint (hidden 32-64, float32, ``save_pretrained`` to a
temporary folder) loaded as the trainer loads it (``build_model``, ``use_blockwise_attention``,
the packing rule), or a HybridLM preset. A pack is ``--docs`` documents of T/docs tokens each
(rows of one document each where the family trains one document per row, as the trainer's
``PackStream`` lays them out); ``--docs 1`` is one document of T tokens. The peak is
``TensorPeak``'s (the CPU allocator's events), parameters and gradients excluded; the exponent
``a`` of ``peak ~ T^a`` is the least-squares slope on log-log. Linear paths give a <= 1.1.

    python benchmarks/memory_growth.py [--tokens 1024 2048 4096] [--docs 1] [--families llama gpt2 ...]

Prints a table and writes benchmarks/results/memory_growth.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile

import harness

TOKENS = (1024, 2048, 4096)
VOCAB = 128
_C = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
          num_hidden_layers=2, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_WINDOWED = dict(sliding_window=64, layer_types=["sliding_attention", "full_attention"])
_MLA = dict(_C, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
            num_experts_per_tok=2, moe_intermediate_size=16)


def hf_builders(hf) -> dict:
    """Family name -> a function returning the tiny transformers model (float32, its own init)."""
    from tests.models.hf import gdn_models, hybrid_models, kda_models, lfm_models, mamba1_models

    return {
        "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**_C)),
        "mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(sliding_window=64, **_C)),
        "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(use_sliding_window=True, sliding_window=64,
                                                             max_window_layers=1, **_C)),
        "gemma2": lambda: hf.Gemma2ForCausalLM(hf.Gemma2Config(head_dim=16, attn_logit_softcapping=2.0,
                                                               final_logit_softcapping=3.0, **_WINDOWED, **_C)),
        "gemma3": lambda: hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(head_dim=16, **_WINDOWED, **_C)),
        "gpt2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_inner=32, vocab_size=VOCAB,
                                                         n_positions=16384, resid_pdrop=0.0, embd_pdrop=0.0,
                                                         attn_pdrop=0.0)),
        "bloom": lambda: hf.BloomForCausalLM(hf.BloomConfig(hidden_size=32, n_layer=2, n_head=2, vocab_size=VOCAB)),
        "falcon": lambda: hf.FalconForCausalLM(hf.FalconConfig(hidden_size=32, num_hidden_layers=2,
                                                               num_attention_heads=2, alibi=True, vocab_size=VOCAB)),
        "mpt": lambda: hf.MptForCausalLM(hf.MptConfig(d_model=32, n_heads=2, n_layers=2, vocab_size=VOCAB)),
        "opt": lambda: hf.OPTForCausalLM(hf.OPTConfig(hidden_size=32, num_hidden_layers=2, ffn_dim=32,
                                                      num_attention_heads=2, vocab_size=VOCAB, dropout=0.0,
                                                      max_position_embeddings=16384, word_embed_proj_dim=32)),
        "gpt_neo": lambda: hf.GPTNeoForCausalLM(hf.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=2,
                                                                attention_types=[[["global", "local"], 1]],
                                                                max_position_embeddings=16384, vocab_size=VOCAB,
                                                                embed_dropout=0.0, resid_dropout=0.0,
                                                                attention_dropout=0.0)),
        "llama_attention_dropout": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(attention_dropout=0.1, **_C)),
        "gpt_oss": lambda: hf.GptOssForCausalLM(hf.GptOssConfig(head_dim=16, num_local_experts=4,
                                                                num_experts_per_tok=2, **_WINDOWED, **_C)),
        "deepseek_v3": lambda: hf.DeepseekV3ForCausalLM(hf.DeepseekV3Config(**_MLA)),
        "qwen3_moe": lambda: hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(num_experts=4, head_dim=16, num_experts_per_tok=2,
                                                                      moe_intermediate_size=16, **_C)),
        "llama4": lambda: hf.Llama4ForCausalLM(hf.Llama4TextConfig(
            **_C, head_dim=16, intermediate_size_mlp=32, num_local_experts=2, num_experts_per_tok=1,
            attention_chunk_size=8192, no_rope_layers=[1, 0])),
        **{name: (lambda name=name: hybrid_models._builders(hf)[name]()) for name in
           ("granite", "falcon_h1", "zamba2", "bamba", "nemotron_h")},
        "jamba": lambda: hf.JambaForCausalLM(mamba1_models.mamba1_config("jamba")),
        "mamba": lambda: hf.MambaForCausalLM(mamba1_models.mamba1_config("mamba")),
        "qwen3_next": lambda: gdn_models._builders(hf, 2, 4)["qwen3_next"](),
        "lfm2": lambda: hf.AutoModelForCausalLM.from_config(lfm_models.lfm_config("lfm2")),
        "recurrent_gemma": lambda: _recurrent_gemma(hf),
        "kimi_linear": lambda: _kimi(hf),
    }


def _recurrent_gemma(hf):
    return hf.RecurrentGemmaForCausalLM(hf.RecurrentGemmaConfig(
        num_hidden_layers=3, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, lru_width=32, attention_window_size=64, conv1d_width=4,
        block_types=["recurrent", "attention", "recurrent"], use_cache=False))


def _kimi(hf):
    from tests.models.hf import kda_models

    return kda_models.build_kda().float()


def saved_checkpoint(name: str, folder: str) -> str:
    """``save_pretrained`` of the family's tiny float32 model under ``folder``; returns its path."""
    import torch
    import transformers as hf

    torch.manual_seed(0)
    path = f"{folder}/{name}"
    hf_builders(hf)[name]().float().save_pretrained(path)
    return path


def loaded(path_or_preset: str, tokens: int, dtype: str = "float32"):
    """The model as the trainer builds it at ``data.pack_size=tokens``, its attention line and its
    packing problem (None: documents share a row)."""
    from hybridpar.config import load_config
    from hybridpar.models.hybrid import HybridLM
    from hybridpar.train.hf_model import use_blockwise_attention
    from hybridpar.train.packing_rule import packing_problem
    from hybridpar.train.trainer import build_model

    key = "model.hf_path" if "/" in path_or_preset else "model.preset"
    config = load_config(None, [f"{key}={path_or_preset}", f"model.dtype={dtype}", f"data.pack_size={tokens}"])
    with contextlib.redirect_stdout(io.StringIO()):
        model = build_model(config)
    line = "" if isinstance(model, HybridLM) else use_blockwise_attention(model)
    return model, line, packing_problem(model)


def pack(tokens: int, docs: int, one_per_row: bool, seed: int = 0):
    """``ShardedInputs`` of one ``[1, T]`` row: ``docs`` documents of ``T / docs`` tokens, or one
    document where the family trains one document per row (the packer pads each to ``pack_size``)."""
    import torch

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.inputs import shard_inputs

    length = tokens if one_per_row else tokens // docs
    ids = torch.randint(3, 97, (1, tokens), generator=torch.Generator().manual_seed(seed))
    labels = torch.roll(ids, -1, 1)
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32)
    labels[:, cu[1:].long() - 1] = -100
    return shard_inputs(input_ids=ids, labels=labels, packed=PackedSeqParams.from_cu_seqlens(cu))


def step_peak(model, sharded) -> int:
    """Peak live tensor bytes of one forward + backward of the trainer's loss (parameters excluded)."""
    from hybridpar.train.tensor_peak import TensorPeak
    from hybridpar.train.trainer import pack_loss_sum

    model.zero_grad(set_to_none=True)
    with TensorPeak() as peak:
        loss, _ = pack_loss_sum(model, sharded)
        loss.backward()
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return peak.bytes - grads


def case(name: str, tokens: list[int], docs: int) -> dict:
    """One family's peaks at each T (runs in a fresh process)."""
    with tempfile.TemporaryDirectory() as folder:
        path = name if name.startswith("preset:") else saved_checkpoint(name, folder)
        path = path.removeprefix("preset:")
        peaks, line, problem = [], "", None
        for t in tokens:
            model, line, problem = loaded(path, t)
            peaks.append(step_peak(model.train(), pack(t, docs, problem is not None)))
    return {"family": name, "tokens": tokens, "docs": docs, "peak_bytes": peaks,
            "exponent": harness.log_slope(list(zip(tokens, peaks))), "attention": line, "one_per_row": problem}


def main() -> None:
    import transformers as hf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--docs", type=int, default=1)
    parser.add_argument("--families", nargs="+", default=["preset:tiny", *hf_builders(hf)])
    args = parser.parse_args()
    meta = harness.environment(__file__)
    rows = []
    print(f"{'family':18} {'peaks MiB':40} exponent  path")
    for name in args.families:
        try:
            row = harness.run_fresh(case, name, args.tokens, args.docs)
        except harness.CaseError as error:
            row = {"family": name, "error": str(error)[-300:]}
        rows.append(row)
        if "error" in row:
            print(f"{name:18} error: {row['error'][-150:]}")
            continue
        mib = " ".join(f"{p / 2**20:8.1f}" for p in row["peak_bytes"])
        print(f"{name:18} {mib:40} {row['exponent']:6.2f}  {'1/row' if row['one_per_row'] else 'packed'}", flush=True)
    lines = harness.header("Memory growth in sequence length (one training step)", meta)
    lines += ["", f"docs per pack: {args.docs}; tokens: {args.tokens}", "",
              "| family | peak MiB per T | exponent | rows |", "|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['family']} | error | | |")
            continue
        mib = ", ".join(f"{p / 2**20:.1f}" for p in row["peak_bytes"])
        lines.append(f"| {row['family']} | {mib} | {row['exponent']:.2f} | "
                     f"{'one per row' if row['one_per_row'] else 'packed'} |")
    harness.write_results("memory_growth", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
