"""transformers' Mamba2 hybrids on CPU at cp=1: hybridpar's cores against transformers' own torch path.

Five architectures (Granite 4.0-H MoE, Falcon-H1, Nemotron-H, Bamba, Zamba2), each a small
random float32 model built from transformers' config classes: hidden 256, one Mamba2 layer
(8 heads x 64, 1 group, state 64, chunk 256) and one attention layer (4 heads, 2 KV heads),
vocab 1024. ``--archs lfm2``: LFM2 at the same width, one gated short-convolution layer (kernel 3)
and one attention layer, ours through hybridpar's document-resetting conv (``install_short_conv``).
``--archs recurrent_gemma``: RecurrentGemma at the same width, one RG-LRU block (lru width 256, 4 heads)
and one local MQA layer (window 512), ours through ``install_rglru_core``. One packed row of ``T`` tokens
holding 4 equal documents; forward + backward of the summed logits:

- ``ours``: ``install_cores`` (as training builds the model: hybridpar's Mamba core, its lean MLPs and
  norms) + hybridpar's blockwise attention, documents from ``packed_seq_params`` (exact per document);
- ``transformers``: the model as transformers runs it without mamba_ssm (its torch SSD, SDPA
  with the per-document mask built from position ids). Its Mamba mixers do not reset at the
  document starts: the timing is of the same amount of work, not of a correct packed step.

Wall time: median of ``--repeats`` runs after one warm-up, one torch thread (the machine is
shared). Peak memory: one forward+backward in a fresh process per (architecture, path, T)
(``paths.time_and_peak``: peak RSS over the RSS just before the call), in MiB.

    python benchmarks/hf_hybrids.py [--lengths 4096 16384] [--repeats 3] [--long-paths ours]

Prints a table and writes benchmarks/results/hf_hybrids.{json,md}.
"""

from __future__ import annotations

import argparse
import warnings

import paths  # puts this checkout's src/ first on sys.path (through harness)
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
        "recurrent_gemma": lambda: hf.RecurrentGemmaForCausalLM(hf.RecurrentGemmaConfig(
            num_hidden_layers=2, block_types=["recurrent", "attention"], lru_width=256, attention_window_size=512,
            **{**_C, "num_key_value_heads": 1})),
    }
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return builders[name]().train()


def step_fn(name: str, path: str, tokens: int):
    """A closure running one forward + backward of ``name`` on a packed row of ``tokens``."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.train.hf_model import install_cores

    model = build(name)
    ids = torch.randint(0, _C["vocab_size"], (1, tokens))
    cu = torch.arange(0, tokens + 1, tokens // 4, dtype=torch.int32)
    packed = PackedSeqParams.from_cu_seqlens(cu)
    inputs = {"input_ids": ids, "position_ids": packed.position_ids, "use_cache": False}
    if path == "ours":
        install_cores(model)  # as training builds it: the mixers' cores, the lean MLPs and norms
        use_hybridpar_attention(model)
        inputs["packed_seq_params"] = packed

    def step():
        model.zero_grad(set_to_none=True)
        model(**inputs).logits.sum().backward()

    return step


NOTES = ["One packed row of 4 equal documents, small random float32 models (module docstring), forward +",
         "backward of the summed logits. transformers' path does not reset its Mamba state (or short conv) at document starts:",
         "the same amount of work, not a correct packed step. 'not run': the path was not asked for at that length."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    paths.add_grid_arguments(parser, lengths=[4096, 16384], archs=list(ARCHS), out="hf_hybrids",
                             archs_help=f"of {ARCHS}, lfm2 and recurrent_gemma")
    parser.add_argument("--long-paths", nargs="+", default=None,
                        help="paths run at lengths above 4096 (default: --paths)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = paths.run_grid(args, lambda arch, path, tokens: paths.time_and_peak(
        step_fn, arch, path, tokens, args.repeats, args.threads),
        paths_at=lambda tokens: args.paths if tokens <= 4096 or args.long_paths is None else args.long_paths)
    paths.write_report(__file__, __doc__.splitlines()[0], args, rows, "ours", "transformers", NOTES)


if __name__ == "__main__":
    main()
