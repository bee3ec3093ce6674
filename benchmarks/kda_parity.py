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

import sys
import warnings

import torch
from gdn_parity import packed_row_rows, run, segment_rows  # sets TRITON_F32_DEFAULT=ieee; puts src/ on the path

FULL = dict(tokens=2048, docs=[0, 700, 1200, 1900, 2048], heads=4, head_dim=128, segments=[300, 17, 129, 64, 1, 250])
DRY = dict(tokens=48, docs=[0, 20, 25, 48], heads=2, head_dim=16, segments=[9, 1, 16])


def model_parity(device, sizes: dict, dry: bool) -> list[tuple[str, float]]:
    import transformers as hf

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
    return packed_row_rows(base, sizes, device, dry, "kda")


def state_parity(device, sizes: dict, dry: bool) -> list[tuple[str, float]]:
    from hybridpar.parallel.context.recurrent.kda import segment_kda_rule

    heads, d = sizes["heads"], sizes["head_dim"]

    def draw(gen, padded):  # q, k unit, v [H, d]; the log decay g [H, d] (one per key channel); beta [H]
        unit = lambda *s: torch.nn.functional.normalize(torch.randn(1, padded, *s, generator=gen), dim=-1)  # noqa: E731
        return dict(q=unit(heads, d), k=unit(heads, d), v=torch.randn(1, padded, heads, d, generator=gen),
                    g=-torch.rand(1, padded, heads, d, generator=gen), beta=torch.rand(1, padded, heads, generator=gen))

    return segment_rows(segment_kda_rule, draw, sizes, device, dry, "kda")


def _register_contract() -> None:
    from hybridpar.models.linear.kda_fused import register_kda_rule
    from tests.models.linear.kda_contract import kda_contract

    register_kda_rule("contract", kda_contract)


if __name__ == "__main__":
    sys.exit(run("kda_parity", "Fused KDA rule (FLA's chunk_kda) vs the pure-PyTorch core (float32, TF32 off)",
                 _register_contract, model_parity, state_parity))
