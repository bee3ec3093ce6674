"""Any transformers causal LM: load it, compute its loss right under FSDP, export it.

**Loading** (``load_causal_lm``). ``backend`` picks the implementation:

    backend          Mamba2 / Bamba / NemotronH          any other causal LM
    "auto"           HybridLM (``HybridLM.from_hf``)     the transformers model
    "hybrid"         HybridLM                            ValueError (use "transformers" or "auto")
    "transformers"   the transformers model              the transformers model

A transformers model is built from the directory's ``config.json`` and its local safetensors
weights (``local_files_only=True``, never remote code, never pickled ``.bin`` files); a
checkpoint whose tensors do not match the architecture is refused.

**Loss** (``hf_causal_lm_loss``). hybridpar's FSDP sums gradients over the data-parallel ranks
(divide factor 1; gloo's AVG is wrong), so every rank's loss must already be divided by the
global number of target tokens:

    loss_rank = sum_{t on this rank, labels[t] != -100} CE(logits[t], labels[t]) / N_global

and the ranks' gradients add up to the single-process gradient of the mean loss.

**Generation** (``generate_causal_lm``): ``HybridLM.generate`` (cached, see
``models/generation.py``) or the transformers model's own ``generate``, with the same
arguments: greedy at temperature 0, else nucleus sampling seeded by ``seed``.

**Export** (``export_causal_lm``): ``config.json`` + safetensors that transformers loads, the
tokenizer files, chat template and ``generation_config.json``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.config_rules import Notice, as_path, quoted, shorten
from hybridpar.models.arguments import end_token_ids, python_number
from hybridpar.models.generation import GREEDY_BELOW, check_prompt_ids, check_sampling
from hybridpar.models.hf.config import ARCHITECTURES, INDEX_FILE, WEIGHTS_FILE, architecture_of, config_from_hf, read_hf_config
from hybridpar.models.hf.checkpoint import load_hf, save_hf, untied_head_note
from hybridpar.models.hf.files import copy_tokenizer_files
from hybridpar.models.hf.logit_transform import logit_transform, probe_finding, probe_logits_after_head  # noqa: F401
from hybridpar.models.hf.positions import learned_positions
from hybridpar.models.hf.weights import check_finite, check_floating, stored_dtypes, weight_files
from hybridpar.models.hf.versions import warn_if_old
from hybridpar.models.hybrid import HybridLM
from hybridpar.models.lora import refuse_adapters
from hybridpar.models.names import canonical_name

__all__ = ["BACKENDS", "causal_lm_backend", "load_causal_lm", "chunked_head", "hf_causal_lm_loss",
           "generate_causal_lm", "export_causal_lm"]

BACKENDS = ("auto", "hybrid", "transformers")
IGNORE_INDEX = -100

# ----------------------------------------------------------------------------- loading


def causal_lm_backend(path: str | Path, backend: str = "auto") -> str:
    """``"hybrid"`` or ``"transformers"``: which implementation ``load_causal_lm`` will use."""
    if backend not in BACKENDS:
        raise ValueError(f"model backend {quoted(backend)} is unknown; choose one of {list(BACKENDS)}.")
    hf = read_hf_config(path)
    try:
        architecture_of(hf)
        config_from_hf(hf)  # e.g. NemotronH with MoE or MTP layers: a transformers model under 'auto'
        supported, reason = True, ""
    except ValueError as error:
        supported, reason = False, f" ({str(error).rstrip('.')})"
    if backend == "hybrid" and not supported:
        given = hf.get("architectures") or hf.get("model_type")
        raise ValueError(f"backend 'hybrid' loads only {list(ARCHITECTURES)}, but {path} holds {quoted(given)}{reason}; "
                         "use backend 'transformers' (or 'auto') to train it as the transformers model.")
    return "hybrid" if backend in ("auto", "hybrid") and supported else "transformers"


def transformers_config(path: str | Path):
    """transformers' config of checkpoint ``path`` (config.json only); ValueError naming the file for a
    value its config class refuses (a string where a number goes, zero heads: any exception type)."""
    from transformers import AutoConfig

    try:
        with quiet_transformers():  # its log lines on the ids: read_hf_config and the preflight say them in one line
            return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - config classes raise TypeError, ZeroDivisionError, hub errors, ...
        text = shorten(" ".join(str(error).split()) or type(error).__name__, 300)
        raise ValueError(f"{Path(path) / 'config.json'} cannot be read by transformers ({type(error).__name__}: "
                         f"{text}); fix that field, or restore the checkpoint's config.json.") from None


def load_causal_lm(path: str | Path, backend: str = "auto", dtype: torch.dtype | None = None,
                   attn_implementation: str | None = None) -> nn.Module:
    """The causal LM in checkpoint directory ``path`` (see the module docstring).

    ``dtype=None`` keeps the stored dtype. A transformers model comes back as transformers
    returns it (eval mode); ``attn_implementation`` (None: transformers' default, SDPA where the
    model supports it) is passed to it.
    """
    dtype = model_dtype(dtype)
    if causal_lm_backend(path, backend) == "hybrid":
        return load_hf(path, dtype=dtype)
    path = Path(path)
    if not (path / WEIGHTS_FILE).is_file() and not (path / INDEX_FILE).is_file():
        raise ValueError(f"{path} has no {WEIGHTS_FILE} (nor {INDEX_FILE}); hybridpar loads safetensors weights only: "
                         "re-save the checkpoint with save_pretrained(safe_serialization=True).")
    files = weight_files(path, WEIGHTS_FILE, INDEX_FILE)  # a truncated or damaged file: one line naming it
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as error:
        raise ImportError("loading a transformers model needs transformers: pip install 'hybridpar[hf]'.") from error
    warn_if_old()
    with quiet_transformers():  # its progress bar and load report: what is wrong is said below, in one line
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), config=transformers_config(path), dtype=dtype or "auto", attn_implementation=attn_implementation,
            local_files_only=True, use_safetensors=True, trust_remote_code=False, output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below as one line (transformers raises with a traceback)
        )
    problems = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems["mismatched_keys"] = [f"{name} (checkpoint {list(stored)}, config {list(wanted)})"
                                   for name, stored, wanted in problems["mismatched_keys"]]
    if any(problems.values()):
        details = "; ".join(f"{len(v)} {k.replace('_', ' ')}: {shorten(', '.join(v[:3]), 300)}"
                            for k, v in problems.items() if v)
        raise ValueError(f"checkpoint {path} does not match its {type(model).__name__} config: {details}; "
                         "check config.json against the weights.")
    check_floating(stored_dtypes(files), dict(model.named_parameters()), f"checkpoint {path}")
    check_finite(model.named_parameters(), f"checkpoint {path}")
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None and embeddings is not None and \
            head.weight is not embeddings.weight and not torch.equal(head.weight, embeddings.weight):
        warnings.warn(untied_head_note(path), Notice, stacklevel=2)  # transformers did not tie them: said, and kept
        model.config.tie_word_embeddings = False  # so that no later tie_weights() (the export's) drops the stored head
    eager_experts_in_float64(model)
    return model


def eager_experts_in_float64(model: nn.Module) -> None:
    """A float64 transformers MoE on transformers' eager experts: its default ``torch._grouped_mm`` takes no
    float64 (a RuntimeError traceback at the first forward of ``generate --hf-path`` or ``load_causal_lm``)."""
    settable = getattr(type(model), "_can_set_experts_implementation", None)  # transformers' own test (private)
    if model.dtype == torch.float64 and settable is not None and settable():
        model.set_experts_implementation("eager")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def model_dtype(dtype) -> torch.dtype | None:
    """``dtype`` (None, a floating ``torch.dtype`` a model trains in, or its name) as a ``torch.dtype``;
    anything else (an int dtype, float8, ``"fp32"``) is one ``ValueError`` line, not transformers' or torch's."""
    if dtype is None or dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype={dtype!r} is invalid: a model loads in one of {', '.join(_DTYPES)} (a torch.dtype or its "
                     "name), or dtype=None for the stored dtype; e.g. dtype=torch.bfloat16.")


@contextlib.contextmanager
def quiet_transformers():
    """transformers' loading output (a progress bar, a table of missing and unexpected keys) held back."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------- loss

# (hidden [B, S, D], weight [V, D], labels [B, S]) -> loss sum; also scale=, softcap= for a model that transforms
LossFn = Callable[..., Tensor]


def _token_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def _own_head_computation(head: nn.Linear) -> str | None:
    """What a head module computes besides ``hidden @ weight.T``: its own ``forward`` or parameters other than
    ``weight`` (Dory's ``DoryLMHead`` multiplies by a learned per-token ``logit_scale``), which the chunked
    loss, reading ``weight`` alone, would leave out (None: a plain ``nn.Linear``)."""
    extra = [name for name, _ in head.named_parameters() if name not in ("weight", "bias")]
    if type(head).forward is not nn.Linear.forward or extra:
        return (f"its head {type(head).__name__} computes more than hidden @ weight.T (its own forward"
                f"{', parameters ' + ', '.join(extra) if extra else ''})")
    return None


def chunked_head(model: nn.Module) -> tuple[nn.Linear, float, float | None]:
    """``(lm_head, scale, softcap)``: the head whose ``hidden @ weight.T`` the model turns into its logits
    ``softcap * tanh(scale * z / softcap)`` (or ``scale * z``; ``models/hf/logit_transform.py``). ValueError
    for a head with a bias or not ``nn.Linear``, a transform nobody maps, or one the probe found otherwise."""
    head = model.get_output_embeddings()
    try:
        transform = logit_transform(model)
    except ValueError as error:
        transform, problem = None, str(error)
    else:
        problem = probe_finding(model)
    if not problem and isinstance(head, nn.Linear) and (own := _own_head_computation(head)):
        problem = own
    if not isinstance(head, nn.Linear) or head.bias is not None or problem:
        raise ValueError(f"{type(model).__name__}'s logits are not a known transform of hidden @ lm_head.weight.T "
                         f"(head {type(head).__name__}, bias {getattr(head, 'bias', None) is not None}"
                         f"{'; ' + problem if problem else ''}); compute its loss from logits (loss_fn=None).")
    return head, *transform


def hf_causal_lm_loss(model: nn.Module, input_ids: Tensor, labels: Tensor, global_count: int | Tensor, *,
                      loss_fn: LossFn | None = None, **model_inputs) -> Tensor:
    """This rank's share of the mean token loss of a transformers causal LM, exact under FSDP.

    ``labels [B, S]`` are hybridpar's shifted labels (``labels[t]`` is the target at position
    ``t``, -100 for none; ``pack_documents``/``collate_thd`` build them), ``global_count`` the
    number of labels != -100 over every data- and context-parallel rank (the caller sums it).
    Returns ``sum of per-token losses on this rank / global_count``; extra ``model_inputs``
    go to the model. For packed rows pass ``position_ids`` restarting at 0 per document:
    transformers then masks attention per document (it does so only without a KV cache, so
    ``use_cache`` defaults to False here).

    Why not ``model(ids, labels=ids).loss``: transformers averages over this rank's tokens,
    and hybridpar's FSDP *sums* the ranks' gradients (divide factor 1), so that loss gives
    ``dp_shard`` times the gradient when ranks hold equally many tokens (exactly 2x at
    dp_shard=2), and wrongly weighted ranks otherwise. Dividing by the global count is exact.

    ``loss_fn=None`` computes logits with the model's forward (any head). Otherwise
    ``loss_fn(hidden [B, S, D], weight [V, D], labels [B, S])`` returns the summed token loss
    from the final hidden states and ``lm_head.weight`` (e.g. a chunked, vocab-parallel
    ``lm_head_loss``), and the model builds no logits: a pre-hook hands ``lm_head`` no position of
    one row, detached (``[1, 0, D]``; under TP, DTensor cannot view ``[B, 0, V]`` with B > 1).
    A model that scales or soft-caps its logits (Gemma 2/3, Cohere, Granite, Falcon-H1, RecurrentGemma:
    ``chunked_head``) calls ``loss_fn(hidden, weight, labels, scale=s, softcap=c)``, which
    ``lm_head_loss`` takes; refused (ValueError) for heads with a bias or an unknown transform.
    """
    model_inputs.setdefault("use_cache", False)
    count = torch.as_tensor(global_count)
    if count.numel() != 1 or int(count) < 1:
        raise ValueError(f"global_count={global_count!r} must be a positive count of labelled tokens over all "
                         "data/context-parallel ranks (all-reduce the local counts).")
    if loss_fn is None:
        logits = model(input_ids=input_ids, **model_inputs).logits  # [B, S, V]
        return _token_loss_sum(logits, labels) / count.to(logits.device)
    head, scale, softcap = chunked_head(model)
    transform = {} if (scale, softcap) == (1.0, None) else dict(scale=scale, softcap=softcap)
    captured = {}

    def capture_and_skip(module, args):
        captured["hidden"] = args[0]  # [B, S, D]
        # lm_head computes logits for no position of one row ([1, 0, D]: B > 1 breaks DTensor's view of
        # [B, 0, V]), detached: under TP no logits are gathered and no partial zero [B, S, D] gradient joins
        # the loss's (one all-reduce of it whole)
        return (args[0][:1, :0].detach(),)

    handle = head.register_forward_pre_hook(capture_and_skip)
    try:
        logits = model(input_ids=input_ids, **model_inputs).logits  # [1, 0, V] (or its vocab shard)
    finally:
        handle.remove()
    hidden = captured["hidden"]
    # 0 * the model's output joins the loss: a hook on the output (FSDP2's pre-backward, which
    # queues the gradient reduction of a root-only unit) must see backward reach it (the output
    # needs a gradient when lm_head.weight trains; a frozen head has none to reduce)
    tied = (logits.to_local() if hasattr(logits, "to_local") else logits).sum() * 0
    return loss_fn(hidden, head.weight, labels, **transform) / count.to(hidden.device) + tied


# ----------------------------------------------------------------------------- generation


@torch.no_grad()
def generate_causal_lm(model: nn.Module, input_ids: Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                       top_p: float = 1.0, seed: int | None = None, eos_token_id: int | list[int] | None = None,
                       pad_token_id: int | None = None) -> Tensor:
    """Prompt ``[B, S]`` plus up to ``max_new_tokens`` tokens from a ``HybridLM`` or a transformers model.

    ``eos_token_id=None`` uses the model's generation config for a transformers model and
    never stops early for a ``HybridLM``; ``pad_token_id`` fills rows of a transformers model
    that finished first (default: the end token).
    """
    max_new_tokens, temperature, top_p, seed = map(python_number, (max_new_tokens, temperature, top_p, seed))
    check_sampling(max_new_tokens, temperature, top_p, seed)
    if not isinstance(model, HybridLM):  # HybridLM.generate checks its own; a list, a [S] row or an id past the
        vocab = model.get_input_embeddings().num_embeddings  # vocabulary were transformers' tracebacks
        check_prompt_ids(input_ids, vocab)
        eos_token_id = None if eos_token_id is None else end_token_ids(eos_token_id, vocab) or None  # []: the config's
    table = None if isinstance(model, HybridLM) else learned_positions(model)
    if table and input_ids.shape[-1] + max_new_tokens > table[1]:
        raise ValueError(f"the prompt ({input_ids.shape[-1]} tokens) plus --max-new-tokens {max_new_tokens} needs "
                         f"{input_ids.shape[-1] + max_new_tokens} positions, but {type(model).__name__} learned "
                         f"{table[1]} ({table[0]}); shorten the prompt or ask for fewer tokens.")
    if isinstance(model, HybridLM):
        return model.generate(input_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              eos_token_id=eos_token_id)
    eos = eos_token_id if eos_token_id is not None else model.generation_config.eos_token_id
    pad = pad_token_id if pad_token_id is not None else model.generation_config.pad_token_id
    if pad is None and eos is not None:
        pad = eos if isinstance(eos, int) else eos[0]
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature >= GREEDY_BELOW \
        else dict(do_sample=False)
    devices = [input_ids.device.index or 0] if input_ids.is_cuda else []
    with torch.random.fork_rng(devices=devices):  # a seed never disturbs the caller's generators
        if seed is not None:
            torch.manual_seed(seed)
        with quiet_transformers():  # its length reminder and id notes: position_note and the preflight say them
            return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                  eos_token_id=eos, pad_token_id=pad, **sampling)


# ----------------------------------------------------------------------------- export


def _persistent_buffers(model: nn.Module) -> dict[str, Tensor]:
    """``{single-device name: copy}`` of ``model``'s persistent buffers (NemotronH's router
    ``e_score_correction_bias``), read on this rank alone: a sharded one is refused, not gathered."""
    out = {}
    for module_name, module in model.named_modules():
        for buffer_name, tensor in module.named_buffers(recurse=False):
            if tensor is None or buffer_name in module._non_persistent_buffers_set:
                continue
            canonical = canonical_name(f"{module_name}.{buffer_name}" if module_name else buffer_name)
            placements = getattr(tensor, "placements", None)  # a DTensor, read by attribute: no distributed import
            if placements is not None and any(not p.is_replicate() for p in placements):
                raise ValueError(f"buffer {canonical} is sharded ({tuple(placements)}); export reads buffers on one "
                                 "rank: keep it replicated in the tensor-parallel plan.")
            out[canonical] = (tensor.to_local() if placements is not None else tensor).detach().clone()
    return out


def _single_device_copy(model: nn.Module, state_dict: dict[str, Tensor]) -> nn.Module:
    """A fresh model of ``model``'s config holding ``state_dict`` (full tensors, single-device names)."""
    if isinstance(model, HybridLM):
        single = HybridLM(model.config)
        single.load_state_dict(state_dict, strict=not model.config.tie_word_embeddings)
        for attribute in ("hf_config", "hf_prefix"):
            if hasattr(model, attribute):
                setattr(single, attribute, getattr(model, attribute))
        return single
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        single = AutoModelForCausalLM.from_config(model.config, dtype=next(iter(state_dict.values())).dtype)
    unexpected = single.load_state_dict(state_dict, strict=False, assign=True).unexpected_keys
    single.tie_weights()  # a tied head is listed once (as the embedding) by named_parameters
    buffers = _persistent_buffers(model)  # not in a parameter state (canonical_state_dict): the model's own
    wanted = {name: buffers[name] for name, tensor in single.state_dict().items() if tensor.is_meta and name in buffers}
    single.load_state_dict(wanted, strict=False, assign=True)
    missing = [name for name, tensor in single.state_dict().items() if tensor.is_meta]
    if missing or unexpected:
        raise ValueError(f"state_dict does not fit {type(single).__name__}: missing {sorted(missing)[:6]}, unexpected "
                         f"{sorted(unexpected)[:6]}; pass full tensors under single-device names (canonical_state_dict).")
    single.generation_config = model.generation_config
    return single


def export_causal_lm(model: nn.Module, out_dir: str | Path, *, tokenizer_dir: str | Path | None = None,
                     state_dict: dict[str, Tensor] | None = None, architecture: str | None = None) -> None:
    """Write ``model`` as a transformers checkpoint, with the tokenizer of ``tokenizer_dir``.

    ``state_dict``: full tensors under single-device names (``canonical_state_dict`` of a
    parallelized model) to export instead of ``model``'s own parameters; the model then only
    supplies the config. ``architecture``: for a ``HybridLM`` not loaded from a checkpoint.
    """
    out_dir = as_path(out_dir, "out_dir")
    if out_dir.exists() and not out_dir.is_dir():  # transformers logged it and wrote nothing: the export "succeeded"
        raise ValueError(f"export target {quoted(str(out_dir))} is a file, not a directory: a checkpoint is a folder "
                         "(config.json, safetensors); pass a new or empty directory.")
    if not isinstance(model, HybridLM) and not callable(getattr(model, "save_pretrained", None)):  # an AttributeError
        raise ValueError(f"model={quoted(model, 60)} (type {type(model).__name__}) is not a model export_causal_lm can "
                         "write; pass a HybridLM or a transformers causal LM (load_causal_lm's result).")
    refuse_adapters(model, state_dict, "export_causal_lm")  # written as lora_A/lora_B, dropped by transformers
    if state_dict is not None:
        model = _single_device_copy(model, state_dict)
    if isinstance(model, HybridLM):
        save_hf(model, out_dir, architecture=architecture, tokenizer_dir=tokenizer_dir)
        return
    if architecture is not None:
        raise ValueError(f"architecture={architecture!r} applies to HybridLM exports only; a transformers model "
                         "keeps its own class.")
    if tokenizer_dir is not None:  # first, so the model's own generation_config.json wins
        copy_tokenizer_files(tokenizer_dir, out_dir)
    with quiet_transformers():  # its "Writing model shards" progress bar
        model.save_pretrained(str(out_dir), safe_serialization=True)
