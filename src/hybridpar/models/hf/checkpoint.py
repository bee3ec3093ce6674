"""Hugging Face checkpoints <-> ``HybridLM``: Mamba2, Bamba and NemotronH causal LMs.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or the shards listed
in ``model.safetensors.index.json``). Loading maps config.json onto a ``HybridConfig`` and
renames every tensor; saving does the reverse. No transformers import is needed.

    architecture          pattern                       tensor names (ours -> theirs)
    Mamba2ForCausalLM     "M" * num_hidden_layers       identical (``backbone.*``)
    NemotronHForCausalLM  layers_block_type -> M * -    ``backbone.*`` (or ``model.*`` on disk)
    BambaForCausalLM      layer i -> blocks 2i, 2i+1:   ``backbone.layers.2i.{norm,mixer}`` ->
                          "M-" or "*-"                  ``model.layers.i.{input_layernorm, mamba|self_attn}``,
                                                        ``backbone.layers.2i+1.{norm,mixer}`` ->
                                                        ``model.layers.i.{pre_ff_layernorm, feed_forward}``

A model loaded here keeps the original config.json dict as ``model.hf_config`` so that
``save_hf`` writes it back unchanged; a model built from a ``HybridConfig`` needs an
``architecture`` and gets a config.json built from its shape.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridpar.models.hf.config import (  # noqa: F401  (the config API is also reached through this module)
    ARCHITECTURES, BAMBA, CONFIG_FILE, INDEX_FILE, MAMBA2, NEMOTRON_H, SHARD_FILE, WEIGHTS_FILE,
    _encode_floats, architecture_of, config_differences, config_from_hf, config_to_hf, read_hf_config,
)
from hybridpar.config_rules import Notice, as_path, quoted, shorten
from hybridpar.models.hf.files import copy_tokenizer_files
from hybridpar.models.hf.weights import _header, check_finite, check_floating, load_weight_file, weight_files
from hybridpar.models.hybrid import HybridLM
from hybridpar.models.lora import refuse_adapters


def hf_tensor_name(name: str, architecture: str, pattern: str, prefix: str = "backbone.") -> str:
    """The checkpoint name of our parameter ``name`` (``prefix`` replaces ``backbone.`` except for Bamba)."""
    if architecture != BAMBA:
        return prefix + name.removeprefix("backbone.") if name.startswith("backbone.") else name
    fixed = {"backbone.embeddings.weight": "model.embed_tokens.weight",
             "backbone.norm_f.weight": "model.final_layernorm.weight", "lm_head.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    match = re.fullmatch(r"backbone\.layers\.(\d+)\.(norm|mixer)\.(.+)", name)
    if match is None:
        raise ValueError(f"parameter {name!r} has no {BAMBA} name.")
    block, part, rest = int(match[1]), match[2], match[3]
    layer, is_mlp = divmod(block, 2)
    if part == "norm":
        module = "pre_ff_layernorm" if is_mlp else "input_layernorm"
    else:
        module = "feed_forward" if is_mlp else ("mamba" if pattern[block] == "M" else "self_attn")
    return f"model.layers.{layer}.{module}.{rest}"


def read_hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards its index lists; every file's
    structure is checked first (``models/hf/weights.py``: a truncated file is one ValueError)."""
    tensors = {}
    for file in weight_files(path, WEIGHTS_FILE, INDEX_FILE):
        tensors.update(load_weight_file(file))
    return tensors


def shape_problem(path: str | Path, say: bool = True) -> str | None:
    """A tensor whose stored shape (from the safetensors headers: no tensor is read) differs from the
    one config.json implies, as ``load_hf`` would find it; None if none does (missing or extra
    tensors are left to ``load_hf``)."""
    hf = read_hf_config(path)
    architecture, config = architecture_of(hf), config_from_hf(hf)
    shapes = stored_shapes(path, say)
    if "backbone.embedding.weight" in shapes:  # early mamba2 checkpoints
        shapes["backbone.embeddings.weight"] = shapes.pop("backbone.embedding.weight")
    prefix = "model." if architecture == NEMOTRON_H and "model.embeddings.weight" in shapes else "backbone."
    with torch.device("meta"):
        model = HybridLM(config)
    for ours, param in model.named_parameters():
        name = hf_tensor_name(ours, architecture, config.pattern, prefix)
        if name in shapes and list(shapes[name]) != list(param.shape):
            return (f"tensor {name} has shape {tuple(shapes[name])} but config.json implies {tuple(param.shape)}; the "
                    "config and weights disagree.")
    return None


def stored_shapes(path: str | Path, say: bool = True) -> dict[str, list[int]]:
    """Every stored tensor's shape, from the safetensors headers (no tensor is read)."""
    shapes = {}
    for file in weight_files(path, WEIGHTS_FILE, INDEX_FILE, say):
        shapes.update({name: entry["shape"] for name, entry in _header(file).items() if name != "__metadata__"})
    return shapes


def transformers_shape_problem(path: str | Path, model: torch.nn.Module) -> str | None:
    """What transformers' load would find of ``model`` (the meta model config.json builds) against the stored
    shapes: tensors stored under one of its names (or renamed to one on load) with another shape (tensors a converter
    merges or splits on load are not compared; the load reports those)."""
    stored = _renamed_as_loaded(stored_shapes(path, say=False), model)
    wrong = [f"{name} (checkpoint {list(stored[name])}, config {list(tensor.shape)})"
             for name, tensor in model.state_dict().items() if name in stored and list(stored[name]) != list(tensor.shape)]
    if wrong:
        return (f"{len(wrong)} tensors disagree with config.json: {shorten(', '.join(wrong[:3]), 300)}; check config.json "
                "against the weights.")
    return None


def _renamed_as_loaded(stored: dict, model: torch.nn.Module) -> dict:
    """``stored`` under the names transformers' load gives them: the plain renamings it holds for the model's type
    (Nemotron-H is saved as ``backbone.``, loaded as ``model.``); a tensor a converter merges or splits (stacked
    experts) keeps its stored name. Unchanged where this transformers has no such table."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renamings = [t for t in get_checkpoint_conversion_mapping(model.config.model_type) or ()
                     if isinstance(t, WeightRenaming)]
    except (ImportError, AttributeError):
        return stored
    out = {}
    for name, shape in stored.items():
        for renaming in renamings:
            name = renaming.rename_source_key(name)[0]
        out[name] = shape
    return out


def untied_head_note(path: str | Path) -> str:
    """A checkpoint whose config.json ties the LM head to the embeddings but whose weights hold another head."""
    return (f"{Path(path) / CONFIG_FILE} sets tie_word_embeddings=true, but the checkpoint holds an lm_head.weight that "
            "differs from its embeddings: both are loaded and trained untied, as transformers loads them (tying would "
            "drop the stored head), and an export says tie_word_embeddings=false; set that in config.json to silence this")


def load_hf(path: str | Path, dtype: torch.dtype | None = None) -> HybridLM:
    """``HybridLM`` from a Mamba2/Bamba/NemotronH checkpoint directory.

    ``dtype=None`` keeps the dtype of the stored embedding tensor. The model keeps the
    original config dict as ``model.hf_config`` (and ``model.hf_prefix``) for ``save_hf``.
    """
    hf = read_hf_config(path)
    architecture, config = architecture_of(hf), config_from_hf(hf)  # fail before reading any weights
    tensors = read_hf_tensors(path)
    check_floating({name: tensor.dtype for name, tensor in tensors.items()}, tensors, f"checkpoint {path}")
    check_finite(tensors.items(), f"checkpoint {path}")  # before step 1, naming the tensor
    if "backbone.embedding.weight" in tensors:  # early mamba2 checkpoints
        tensors["backbone.embeddings.weight"] = tensors.pop("backbone.embedding.weight")
    prefix = "model." if architecture == NEMOTRON_H and "model.embeddings.weight" in tensors else "backbone."
    embedding_name = hf_tensor_name("backbone.embeddings.weight", architecture, "", prefix)
    if dtype is None:
        dtype = tensors[embedding_name].dtype if embedding_name in tensors else torch.float32
    head = tensors.get("lm_head.weight")
    if config.tie_word_embeddings and head is not None and not torch.equal(head, tensors.get(embedding_name, head)):
        warnings.warn(untied_head_note(path), Notice, stacklevel=2)  # transformers loads the two untied: so do we
        config, hf = dataclasses.replace(config, tie_word_embeddings=False), {**hf, "tie_word_embeddings": False}
    config = dataclasses.replace(config, dtype=dtype)
    with torch.device("meta"):
        model = HybridLM(config)
    model.to_empty(device="cpu")  # meta -> cpu makes new Parameters, so tie the head again
    if config.tie_word_embeddings:
        model.lm_head.weight = model.backbone.embeddings.weight
    names = {ours: hf_tensor_name(ours, architecture, config.pattern, prefix) for ours, _ in model.named_parameters()}
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(k for k in set(tensors) - set(names.values()) - ignorable if not k.endswith("rotary_emb.inv_freq"))
    missing = sorted(set(names.values()) - set(tensors))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its {architecture} config: missing tensors {missing[:8]}, "
                         f"unexpected tensors {unexpected[:8]}; check config.json against the weights.")
    with torch.no_grad():
        for ours, param in model.named_parameters():
            stored = tensors[names[ours]]
            if stored.shape != param.shape:
                raise ValueError(f"tensor {names[ours]} has shape {tuple(stored.shape)} but config.json implies "
                                 f"{tuple(param.shape)}; the config and weights disagree.")
            param.copy_(stored)
    model.hf_config, model.hf_prefix = hf, prefix
    return model


def save_hf(model: HybridLM, path: str | Path, architecture: str | None = None,
            max_shard_bytes: int | None = None, tokenizer_dir: str | Path | None = None) -> None:
    """Write ``config.json`` and safetensors weights that transformers and ``load_hf`` read.

    A model from ``load_hf`` writes its original config back (``architecture`` may be left
    out); any other model needs ``architecture``. ``max_shard_bytes`` splits the weights into
    ``model-0000k-of-0000n.safetensors`` shards with an index. ``tokenizer_dir``: copy the
    tokenizer, chat template and generation config from there (``hf_files.copy_tokenizer_files``).
    """
    if as_path(path, "path").exists() and not Path(path).is_dir():  # mkdir below: a raw FileExistsError
        raise ValueError(f"save_hf target {quoted(str(path))} is a file, not a directory: a checkpoint is a folder "
                         "(config.json, safetensors); pass a new or empty directory.")
    if not isinstance(model, HybridLM):  # a str was "'str' object has no attribute 'config'"
        raise ValueError(f"save_hf writes a HybridLM, got {quoted(model, 60)} (type {type(model).__name__}); a "
                         "transformers model: export_causal_lm or its save_pretrained.")
    refuse_adapters(model, None, "save_hf")
    stored = getattr(model, "hf_config", None)
    if stored is not None and architecture in (None, architecture_of(stored)):
        architecture, hf, prefix = architecture_of(stored), dict(stored), getattr(model, "hf_prefix", "backbone.")
        differences = config_differences(model.config, config_from_hf(hf, model.config.dtype))
        if differences:
            raise ValueError(f"the model no longer matches the config it was loaded with ({'; '.join(differences)}); "
                             "delete model.hf_config and pass architecture= to build a new config.")
    elif architecture is None:
        raise ValueError(f"this model was not loaded from Hugging Face, so pass architecture= one of {list(ARCHITECTURES)}.")
    else:
        hf, prefix = config_to_hf(model.config, architecture), "backbone."
    tensors = {hf_tensor_name(name, architecture, model.config.pattern, prefix): param.detach().cpu().contiguous()
               for name, param in model.named_parameters()}  # a tied lm_head is listed once, as the embedding
    shards = _split_shards(tensors, max_shard_bytes)
    dtype_name = str(model.lm_head.weight.dtype).removeprefix("torch.")
    for key in [k for k in ("dtype", "torch_dtype") if k in hf] or ["dtype"]:
        hf[key] = dtype_name  # the dtype the tensors are written in
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():  # stale weights would shadow or mix with the new ones
        if old.name in (WEIGHTS_FILE, INDEX_FILE) or SHARD_FILE.fullmatch(old.name):
            old.unlink()
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, path)
    (path / CONFIG_FILE).write_text(json.dumps(_encode_floats(hf), indent=2, sort_keys=True) + "\n")
    if len(shards) == 1:
        save_file(shards[0], path / WEIGHTS_FILE, metadata={"format": "pt"})
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _split_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    """Greedy split in order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes is None:
        return [tensors]
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive (or None for one file).")
    shards, size = [{}], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards, size = shards + [{}], 0
        shards[-1][name], size = tensor, size + nbytes
    return shards

