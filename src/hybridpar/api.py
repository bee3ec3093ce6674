"""The public API: everything a library user needs, importable from ``hybridpar`` itself.

    import hybridpar as hp

    model = hp.HybridLM(hp.HybridConfig(hidden_size=64, ...))  # or hp.load_causal_lm("ckpt/")
    dims = hp.ParallelDims(dp_shard=1, cp=2, tp=1)
    model = hp.parallelize(model, dims, cp_mamba="state")      # TP/SP -> CP -> checkpointing -> FSDP2
    batch = hp.collate_thd(hp.pack_documents(docs, pack_size, cp_size=dims.cp))  # documents padded to 2*cp
    local = hp.shard_inputs(..., cp_group=...)                 # this rank's zigzag slice + PackedSeqParams
    loss_sum, count = model(local.input_ids, packed=local.packed, labels=local.labels)

``examples/quickstart.py`` runs this end to end on two processes (a test runs it). The modules
behind each name are listed in ``docs/architecture.md``; deeper paths are internal and may move.
"""

from hybridpar.config import RunConfig, load_config
from hybridpar.data.packing import Document, collate_thd, pack_documents
from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.causal_lm import export_causal_lm, load_causal_lm
from hybridpar.models.hf.checkpoint import load_hf, save_hf
from hybridpar.models.hybrid import PRESETS, HybridConfig, HybridLM
from hybridpar.models.lm_head_loss import chunked_lm_head_loss
from hybridpar.models.lora import add_lora
from hybridpar.parallel.context.inputs import ShardedInputs, gather_outputs, shard_inputs
from hybridpar.parallel.dims import ParallelDims
from hybridpar.parallel.parallelize import parallelize
from hybridpar.parallel.state import canonical_state_dict, load_canonical_state_dict
from hybridpar.plan import make_plan
from hybridpar.train.loss import lm_head_loss
from hybridpar.models.hf.lora_export import export_lora

__all__ = [
    # models
    "HybridConfig", "HybridLM", "PRESETS", "load_causal_lm", "export_causal_lm", "load_hf", "save_hf",
    # data
    "Document", "pack_documents", "collate_thd", "PackedSeqParams",
    # parallelism
    "ParallelDims", "parallelize", "shard_inputs", "ShardedInputs", "gather_outputs",
    "canonical_state_dict", "load_canonical_state_dict",
    # loss
    "lm_head_loss", "chunked_lm_head_loss",
    # LoRA (docs/lora.md): adapters before parallelize, the PEFT-format export
    "add_lora", "export_lora",
    # runs and the planner
    "RunConfig", "load_config", "make_plan",
]
