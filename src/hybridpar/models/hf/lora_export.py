"""LoRA adapters in the PEFT format: ``adapter_config.json`` + ``adapter_model.safetensors``.

``peft.PeftModel.from_pretrained(base, adapter_dir)`` loads what ``save_peft_adapter`` writes on
the Hugging Face base checkpoint: the config is peft's own ``LoraConfig`` (r, lora_alpha,
lora_dropout, the base's path, and ``target_modules`` / ``target_parameters`` as the full names
of the adapted modules: peft matches a name or its last atoms, so a leaf name such as ``q_proj``
would adapt every layer's, trained or not), the tensors are named
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` with transformers' module names
(a ``HybridLM`` maps them like its weights, ``checkpoint.hf_tensor_name``; NemotronH checkpoints
say ``backbone.`` where transformers' modules say ``model.``).
``merged_state`` merges ``W + (alpha/r) B A`` into full weights itself: peft refuses adapters on
a transformers Mamba mixer's ``out_proj`` (its fused CUDA path reads the weight directly), so
merging through peft would fail for the default targets; the tests hold our merge to peft's
``merge_and_unload`` where peft accepts the adapter. For the same reason an unmerged adapter on
a Mamba ``out_proj`` is refused (``mamba_out_proj_targets``): export it with ``peft.merge=true``.

Adapters on stacked MoE experts (``peft.target_parameters``, ``models/lora_experts.py``) are written
under peft's nested ``ParamWrapper`` names (``experts[.base_layer].lora_A.weight``) with
``target_parameters`` in the config; the merge adds each expert's ``(alpha/r) B_e A_e`` to the
stacked weight. ``merge_adapter_checkpoint`` refuses such an adapter (peft's ``merge_and_unload`` merges it).

Tensors come from ``parallel.state.canonical_state_dict`` (full, single-device names; the
Mamba ``in_proj``'s per-component ``B`` already fused back), so any layout exports alike.
"""

from __future__ import annotations

import os

import json
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from hybridpar.config_rules import quoted
from hybridpar.models.hf.checkpoint import NEMOTRON_H, architecture_of, hf_tensor_name
from hybridpar.models.hybrid import HybridLM
from hybridpar.models.lora import LORA_PARAMETERS, adapter_settings, is_lora_parameter, lora_modules
from hybridpar.models.lora_experts import (adapter_child, expert_delta, expert_lora_modules, peft_names,
                                           peft_target_parameters)
from hybridpar.models.names import canonical_name
from hybridpar.strict_json import check_files, load_file as load_json

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "export_lora", "split_lora_state", "save_peft_adapter",
           "read_peft_adapter", "lora_settings", "merged_state", "expert_layouts", "mamba_out_proj_targets",
           "check_mergeable", "merge_adapter_checkpoint"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def split_lora_state(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(base tensors, adapter tensors)`` of a canonical state dict."""
    base = {n: t for n, t in state.items() if not is_lora_parameter(n)}
    return base, {n: t for n, t in state.items() if is_lora_parameter(n)}


def _check_adapter_state(model: nn.Module, state) -> dict:
    """``state`` when it is a dict holding every adapter tensor of ``model``: one without them (a state saved before
    ``add_lora``, the base weights alone) wrote an empty adapter file, or merged nothing, without a word."""
    if not isinstance(state, dict):  # a str was "'str' object has no attribute 'items'"
        raise ValueError(f"export_lora: state must be the model's canonical state (a dict of name -> tensor), got "
                         f"{type(state).__name__}; pass canonical_state_dict(model).")
    wanted = adapter_names(model)
    if wanted and not any(is_lora_parameter(name) for name in state):
        raise ValueError(f"export_lora: state holds none of the model's {len(wanted)} adapter tensors (e.g. {wanted[0]}), "
                         "so the export would hold no trained update; pass canonical_state_dict(model).")
    given = {name for name in state if is_lora_parameter(name)}
    missing, foreign = [n for n in wanted if n not in given], sorted(given.difference(wanted))
    if wanted and (missing or foreign):  # some adapters missing: merge=True was a KeyError, merge=False wrote them without
        said = [f"lacks {len(missing)} of them ({quoted(missing[:3], 300)})"] if missing else []
        said += [f"holds {len(foreign)} the model has not ({quoted(foreign[:3], 300)})"] if foreign else []
        raise ValueError(f"export_lora: state does not hold the model's {len(wanted)} adapter tensors: it "
                         f"{' and '.join(said)}; pass canonical_state_dict(model) of this model.")
    return state


def adapter_names(model: nn.Module) -> list[str]:
    """The canonical names of ``model``'s adapter tensors (``canonical_state_dict``'s): each adapted linear's
    ``lora_A.weight`` and ``lora_B.weight`` (a split Mamba ``in_proj``'s per-component ``B`` is one there) and
    each stacked expert parameter's factors."""
    linear = [f"{name}.{factor}.weight" for name in lora_modules(model) for factor in LORA_PARAMETERS]
    return sorted({canonical_name(name) for name in [*linear, *peft_names(model)]})


def lora_settings(model: nn.Module) -> dict:
    """``r``, ``alpha``, ``dropout``, the adapted modules and stacked parameters (full names) of a model with adapters."""
    settings = adapter_settings(model)
    if settings is None:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters; set peft.method=lora to train some.")
    return {"r": settings["r"], "alpha": settings["alpha"], "dropout": settings["dropout"],
            "modules": sorted(lora_modules(model)),
            "target_parameters": peft_target_parameters(model)}


def _hf_name(model: nn.Module, architecture: str | None):
    """Our parameter name -> the Hugging Face checkpoint's name (identity for transformers models)."""
    if not isinstance(model, HybridLM):
        return lambda name: name
    stored = getattr(model, "hf_config", None)
    if stored is not None and architecture in (None, architecture_of(stored)):
        architecture, prefix = architecture_of(stored), getattr(model, "hf_prefix", "backbone.")
    elif architecture is None:
        raise ValueError("this HybridLM was not loaded from Hugging Face; set model.export_architecture to export "
                         "its adapter.")
    else:
        prefix = "backbone."

    def name_of(name: str) -> str:
        module, _, leaf = name.rpartition(".lora_")  # "x.in_proj" + "A.weight"
        stored = hf_tensor_name(f"{module}.weight", architecture, model.config.pattern, prefix)[: -len(".weight")]
        if architecture == NEMOTRON_H and stored.startswith("backbone."):
            stored = "model." + stored.removeprefix("backbone.")  # transformers' module name (its loader renames)
        return f"{stored}.lora_{leaf}"

    return name_of


def _absolute(base_path: str | Path) -> str:
    """The base as an absolute path: a relative one (``model.hf_path=ckpt/llama``) is relative to the directory the
    run started in, so peft or ``generate --hf-path ADAPTER`` started elsewhere found no base, or another folder of
    that name and merged the adapter onto it without a word."""
    return os.path.abspath(os.path.expanduser(str(base_path)))


def save_peft_adapter(model: nn.Module, adapters: dict[str, Tensor], out_dir: str | Path, *,
                      base_path: str | Path | None = None, architecture: str | None = None) -> Path:
    """Write ``adapters`` (canonical adapter tensors of ``model``) in the PEFT format into ``out_dir``."""
    from peft import LoraConfig

    settings = lora_settings(model)
    refused = mamba_out_proj_targets(model)
    if refused:
        raise ValueError(f"peft cannot load a LoRA adapter on a Mamba mixer's out_proj ({refused[0]!r}, "
                         f"{len(refused)} in all); export merged weights (peft.merge=true) or leave out_proj out of "
                         "peft.target_modules.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name_of, experts = _hf_name(model, architecture), peft_names(model)
    targets = sorted(name_of(f"{module}.lora_A.weight").rpartition(".lora_")[0] for module in settings["modules"])
    config = LoraConfig(r=settings["r"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                        target_modules=targets, bias="none", task_type="CAUSAL_LM",
                        target_parameters=settings["target_parameters"] or None,
                        base_model_name_or_path=None if base_path is None else _absolute(base_path))
    config.save_pretrained(str(out_dir))
    tensors = {PEFT_PREFIX + (experts[n] if n in experts else name_of(n)): t.detach().cpu().contiguous()
               for n, t in adapters.items()}
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out_dir


def read_peft_adapter(adapter_dir: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """``(adapter_config.json, {module name without peft's prefix: tensor})``."""
    adapter_dir = Path(adapter_dir)
    check_files(adapter_dir)  # a FIFO or device adapter_model.safetensors: named as such, not as missing
    config = load_json(adapter_dir / ADAPTER_CONFIG)  # a key written twice: refused, naming the file
    if problem := _adapter_config_problem(config):
        raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: {problem}; restore the adapter's {ADAPTER_CONFIG} (peft "
                         "writes it with save_pretrained).")
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ValueError(f"adapter {str(adapter_dir)!r} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}; copy the whole "
                         "adapter folder (hybridpar reads safetensors adapters only).")
    try:
        stored = load_file(str(weights))
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
        raise ValueError(f"{weights} cannot be read ({type(error).__name__}: {str(error)[:160]}); it is damaged or "
                         "truncated: copy the adapter again.") from None
    return config, {n.removeprefix(PEFT_PREFIX): t for n, t in stored.items()}


def _adapter_config_problem(config) -> str | None:
    """What is wrong with an adapter config's fields the merge reads (``r``, ``lora_alpha``), or None."""
    import math

    if not isinstance(config, dict):
        return f"a JSON {type(config).__name__}, not an object of adapter fields"
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        return f"r={rank!r} must be an integer >= 1 (the adapter's rank)"
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        return f"lora_alpha={alpha!r} must be a finite number (the merge scales by lora_alpha / r)"
    return None


def expert_layouts(model: nn.Module) -> dict[str, tuple[int, bool]]:
    """``{"<experts>.lora_<parameter>": (experts, is_transposed)}`` of a model's expert adapters."""
    return {f"{path}.{adapter_child(p)}": (m._parameters[p].shape[0], getattr(m, adapter_child(p)).transposed)
            for path, m in expert_lora_modules(model).items() for p in m.lora_parameters}


def merged_state(state: dict[str, Tensor], scaling: float,
                 experts: dict[str, tuple[int, bool]] | None = None) -> dict[str, Tensor]:
    """Base tensors with every adapter merged: ``W + scaling * B @ A`` ([out, r] @ [r, in]); an expert
    adapter (``experts``: ``expert_layouts``) adds ``scaling * B_e @ A_e`` to each expert's slice. Each merged
    weight keeps its base's dtype (float32 adapters on a bfloat16 base: a bfloat16 checkpoint throughout)."""
    base, adapters = split_lora_state(state)
    merged = dict(base)
    for name, a in adapters.items():
        if ".lora_A." not in name:
            continue
        module = name.rpartition(".lora_A.")[0]
        b = adapters[f"{module}.lora_B.weight"]
        if experts and module in experts:  # "<experts>.lora_<parameter>": the stacked weight [E, d1, d2]
            path, _, child = module.rpartition(".")
            key = f"{path}.{child.removeprefix('lora_')}"
            merged[key] = base[key] + expert_delta(a, b, experts[module][0], scaling, experts[module][1]).to(base[key].dtype)
            continue
        weight = base[f"{module}.weight"]  # summed in float64, rounded once to its dtype (merge_adapter_checkpoint)
        merged[f"{module}.weight"] = (weight.double() + scaling * (b.double() @ a.double())).to(weight.dtype)
    return merged


def check_mergeable(model: nn.Module) -> None:
    """Refuse a merge where two adapted modules hold one base weight (Zamba2's shared block, used by several
    layers): each use trains its own adapter, but the merged checkpoint has one tied weight for all uses."""
    owners: dict[int, str] = {}
    for name, module in lora_modules(model).items():
        weight = getattr(module, "weight", None)
        if weight is None:
            continue
        first = owners.setdefault(id(weight), name)
        if first != name:
            raise ValueError(f"cannot merge the LoRA adapters of {first!r} and {name!r}: both adapt one shared base "
                             f"weight (e.g. Zamba2's shared block, used by several layers), and the merged checkpoint "
                             f"holds it once while each use trained its own adapter; export the adapter "
                             f"(peft.merge=false) or leave the shared block out of peft.target_modules.")


def mamba_out_proj_targets(model: nn.Module) -> list[str]:
    """Adapted ``out_proj`` modules of Mamba mixers (peft cannot load those adapters), by single-device name."""
    return [f"{canonical_name(name)}.out_proj" for name, module in model.named_modules()
            if _is_mamba(module) and getattr(getattr(module, "out_proj", None), "lora_scaling", None) is not None]


def _is_mamba(module) -> bool:
    return module is not None and hasattr(module, "A_log") and hasattr(module, "in_proj")


def merge_adapter_checkpoint(adapter_dir: str | Path, out_dir: str | Path, base_dir: str | Path | None = None) -> Path:
    """Write the base checkpoint of a PEFT adapter with the adapter merged into ``out_dir``.

    The base is ``base_dir`` or the adapter config's ``base_model_name_or_path``; each adapted
    weight becomes ``W + (lora_alpha / r) B A`` (a NemotronH checkpoint's ``backbone.`` names are
    found from transformers' ``model.`` module names). Files other than the weights are copied.
    """
    from hybridpar.models.hf.checkpoint import CONFIG_FILE, INDEX_FILE, SHARD_FILE, WEIGHTS_FILE, read_hf_tensors

    config, adapters = read_peft_adapter(adapter_dir)
    named = config.get("base_model_name_or_path")
    if base_dir is None and not (isinstance(named, str) and named.strip()):
        raise ValueError(f"adapter {str(adapter_dir)!r} names no base model (base_model_name_or_path is "
                         f"{json.dumps(named)} in its {ADAPTER_CONFIG}); set it to the base checkpoint's folder (an "
                         "adapter of a run without model.hf_path has none: export that run with peft.merge=true).")
    base_dir = Path(base_dir or named)
    if not (base_dir / CONFIG_FILE).is_file():
        raise ValueError(f"adapter {str(adapter_dir)!r} names base {str(base_dir)!r}, which holds no {CONFIG_FILE}; "
                         "put the base checkpoint there or edit base_model_name_or_path in adapter_config.json.")
    if config.get("target_parameters"):
        raise ValueError(f"adapter {str(adapter_dir)!r} adapts stacked expert weights (target_parameters), which "
                         "hybridpar merges only at export (peft.merge=true); merge it with peft's merge_and_unload.")
    if config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"adapter {str(adapter_dir)!r} uses rsLoRA/DoRA, which hybridpar does not merge; export a "
                         "plain LoRA adapter.")
    tensors = read_hf_tensors(base_dir)
    scaling = float(config["lora_alpha"]) / int(config["r"])
    for name, a in adapters.items():
        if ".lora_A." not in name:
            continue
        module = name.rpartition(".lora_A.")[0]
        b = adapters[f"{module}.lora_B.weight"]
        key = next((k for k in (f"{module}.weight", "backbone." + module.removeprefix("model.") + ".weight")
                    if k in tensors), None)
        if key is None:
            raise ValueError(f"adapter tensor {name!r} has no weight {module}.weight in base {str(base_dir)!r}; "
                             "the adapter was trained on another model.")
        tensors[key] = (tensors[key].double() + scaling * (b.double() @ a.double())).to(tensors[key].dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for extra in base_dir.iterdir():
        if extra.is_file() and extra.name not in (WEIGHTS_FILE, INDEX_FILE) and not SHARD_FILE.fullmatch(extra.name):
            (out_dir / extra.name).write_bytes(extra.read_bytes())
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def export_lora(model: nn.Module, out_dir: str | Path, state: dict, *, merge: bool = False,
                base_path: str | Path | None = None, tokenizer_dir: str | Path | None = None,
                architecture: str | None = None) -> None:
    """Write a LoRA model's export into ``out_dir`` (single process; ``state``: its canonical state).

    ``merge=False``: the adapter in the PEFT format (``adapter_config.json`` naming ``base_path``,
    ``adapter_model.safetensors``) plus the tokenizer files; ``merge=True``: full weights with the
    adapters merged, exported like a fully trained model.
    """
    from hybridpar.models.hf.causal_lm import export_causal_lm
    from hybridpar.models.hf.files import copy_tokenizer_files

    _, adapters = split_lora_state(_check_adapter_state(model, state))
    out_dir = Path(out_dir)
    if merge:  # W + (alpha/r) B A, then the usual export
        check_mergeable(model)
        export_causal_lm(model, out_dir, tokenizer_dir=tokenizer_dir, architecture=architecture,
                         state_dict=merged_state(state, lora_settings(model)["alpha"] / lora_settings(model)["r"],
                                                 expert_layouts(model)))
        return
    save_peft_adapter(model, adapters, out_dir, base_path=base_path, architecture=architecture)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out_dir)
