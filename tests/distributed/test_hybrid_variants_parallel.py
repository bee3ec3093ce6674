"""Documents told by ``position_ids`` alone under tensor and context parallelism (round 14b).

A transformers hybrid (Zamba2 with two hybrid layers on one shared block, per-layer adapters, RoPE;
Granite 4.0-H with RoPE and multipliers) with hybridpar's cores and attention, parallelized at tp=2 with
sequence parallelism, called with restarting ``position_ids`` and no ``packed_seq_params``: its logits
equal each document run alone on one process (float64 throughout, 1e-12). Before, the Mamba2 mixers
ran the row as one document (0.2-0.6 apart). At cp=2 such a call is refused in one line by the CP cores,
which need ``shard_inputs``' layout.
"""

from __future__ import annotations

import torch

from tests.distributed.harness import run_ranks

DOCS = (10, 14)
NAMES = ("zamba2_two_blocks_groups_eq_heads_bias", "granite_rope_multipliers_tied_kv1")


def _model(name):
    from hybridpar.models.hf.float64 import keep_float64
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.train.hf_model import install_cores
    from tests.models.hf.test_hybrid_variants import VARIANTS, _build

    kind, fields = VARIANTS[name]
    if name.startswith("granite"):  # tp=2 splits the KV heads: two here
        VARIANTS[name] = (kind, {**fields, "num_key_value_heads": 2})
    model = keep_float64(_build(name).eval())
    VARIANTS[name] = (kind, fields)
    install_cores(model)
    use_hybridpar_attention(model)
    return model


def _run(rank, world_size) -> dict:
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    ids = torch.randint(0, 97, (1, sum(DOCS)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(d) for d in DOCS])[None]
    results = {}
    for name in NAMES:
        reference = _model(name)
        with torch.no_grad():
            alone = torch.cat([reference(input_ids=ids[:, :DOCS[0]]).logits,
                               reference(input_ids=ids[:, DOCS[0]:]).logits], 1)
        dims = ParallelDims(tp=2)
        model = parallelize(_model(name), dims, mesh=dims.build_mesh(), sequence_parallel=True)
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        results[name] = float((logits - alone).abs().max() / alone.abs().max())
    dims = ParallelDims(cp=2)
    model = parallelize(_model(NAMES[0]), dims, mesh=dims.build_mesh(), cp_mamba="state")
    try:
        model(input_ids=ids[:, :12], position_ids=torch.cat([torch.arange(4), torch.arange(8)])[None], use_cache=False)
    except ValueError as error:
        results["cp2"] = str(error)
    return results


def test_documents_told_by_position_ids_alone_at_tp2_sp_equal_one_process_and_cp2_refuses():
    for results in run_ranks(2, _run, timeout_s=300):
        for name in NAMES:
            assert results[name] < 1e-12, (name, results[name])
        assert "without a CP layout" in results["cp2"] and "\n" not in results["cp2"], results["cp2"]
