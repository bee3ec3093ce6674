"""The model a run config names: a ``HybridLM`` or a transformers causal LM, its shape, its loss.

    model.hf_path   model.backend   the model
    null            auto | hybrid   HybridLM(model.preset + model.overrides)
    null            transformers    ConfigError: there is no checkpoint to load
    a directory     auto            Mamba2 / Bamba / NemotronH -> HybridLM, any other causal LM -> transformers
    a directory     hybrid          HybridLM, or ConfigError for another architecture
    a directory     transformers    the transformers model (``models/hf_causal.load_causal_lm``)

The *shape* (``model_shape``) is what the preflight checks need before any process starts:
the ``HybridConfig``, or the transformers ``PretrainedConfig`` of ``config.json``; a shape
builds a ``meta`` model (modules without memory) for the layout rules.

**The loss of a transformers model** (``hf_loss_sum``) follows ``HybridLM``'s: the summed
token loss of this rank's share of a pack, from the final hidden states and ``lm_head.weight``
through ``train.loss.lm_head_loss`` (blockwise, vocab-parallel under TP, never the ``[T, V]``
logits), taken at the ``hf_causal_lm_loss`` seam; the trainer divides by the global count,
which is what makes FSDP's summed gradients exact. A model that scales or soft-caps its logits
(Gemma 2/3, Cohere, Granite incl. 4.0-H, Falcon-H1, RecurrentGemma) takes the same loss on the
transformed logits, once the load-time probe has checked the transform (``models/hf/logit_transform``);
a head with a bias, or a transform the probe cannot confirm, takes the logits route instead
(``loss_path_line`` says which).

**Attention and inputs** (``use_blockwise_attention``, ``hf_forward_inputs``): a model
``parallel/context/hf.attention_problem`` accepts runs hybridpar's ``"hybridpar"`` attention at every
cp (``parallelize`` installs it for cp > 1, the trainer at cp = 1): blockwise and
document-causal over the pack's ``PackedSeqParams``, so no ``[S, S]`` mask exists and memory
grows linearly with ``data.pack_size``; its Mamba2 mixers run hybridpar's Mamba core
(``models/hf/mixers/mamba2``), its gated DeltaNets hybridpar's gated delta rule (``models/hf/mixers/gdn``). Any other model keeps transformers' attention and trains one
document per row (``train/packing_rule.py``). RoPE reads the position ids (zigzag-sharded under CP).
A float64 model with MoE experts runs transformers' eager experts (``grouped_mm`` has no float64),
and every float32 cast inside transformers stays float64 (``models/hf/float64.keep_float64``).
The checkpoint's hidden-state dropouts (embedding, residual: ``nn.Dropout`` on one row per token)
draw token-keyed masks (``models/token_dropout.key_model_dropout``), so every layout draws one
process's; what no key reaches (attention dropout, functional dropout) is said by ``randomness_problem``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from hybridpar.config import ConfigError, RunConfig
from hybridpar.models.hf.causal_lm import (causal_lm_backend, chunked_head, hf_causal_lm_loss, load_causal_lm,
                                           probe_logits_after_head, transformers_config)
from hybridpar.models.hf.logit_transform import describe_transform
from hybridpar.models.hf.positions import learned_positions
from hybridpar.models.hf.config import read_hf_config
from hybridpar.strict_json import FileRefused
from hybridpar.models.hf.activations import use_lean_gated_mlps, use_lean_rms_norms, use_product_relu2
from hybridpar.models.hf.float64 import keep_float64
from hybridpar.models.hf.router_aux import capture_router_aux
from hybridpar.models.hf.mixers.gdn import install_gdn_core
from hybridpar.models.hf.mixers.kda import install_kda_core
from hybridpar.models.hf.mixers.mamba1 import install_mamba1_core
from hybridpar.models.hf.mixers.rglru import install_rglru_core
from hybridpar.models.hf.mixers.mamba2 import bridged_mixers, install_mamba_core
from hybridpar.models.hf.mixers.short_conv import install_short_conv
from hybridpar.models.token_dropout import key_model_dropout, random_fields, set_dropout_tokens, token_keys, unkeyed_dropout
from hybridpar.parallel.context.hf import attention_problem, hf_cp_inputs, runs_hybridpar_attention, use_hybridpar_attention
from hybridpar.parallel.context.hf_own_memory import own_attention_note
from hybridpar.parallel.context.inputs import ShardedInputs
from hybridpar.parallel.precision import autocast_dtype
from hybridpar.train.loss import lm_head_loss_output, token_loss_sum
from hybridpar.train.packing_rule import causality_problem, future_probe

__all__ = ["model_backend", "attention_dropout_problem", "randomness_problem", "unkeyed_randomness", "hf_shape",
           "hf_meta_model", "meta_model", "build_hf_model", "use_blockwise_attention", "hf_forward_inputs",
           "loss_path_line", "hf_loss_sum"]


def model_backend(config: RunConfig) -> str:
    """``"hybrid"`` or ``"transformers"``: the implementation ``model.*`` trains (module docstring)."""
    model = config.model
    if not model.hf_path:
        if model.backend == "transformers":
            raise ConfigError("model.backend='transformers' needs model.hf_path (a transformers checkpoint directory "
                              "to load); set model.hf_path, or model.backend=auto for a HybridLM preset.")
        return "hybrid"
    path = Path(model.hf_path)
    if not path.is_dir():
        raise ConfigError(f"model.hf_path={str(path)!r} is not a directory; point it at a Hugging Face checkpoint "
                          "directory (config.json + model.safetensors).")
    try:
        read_hf_config(path)
    except FileRefused as error:  # a file of the directory, config.json or not: the message names it
        raise ConfigError(f"model.hf_path={str(path)!r}: {error}") from None
    except (ValueError, TypeError, KeyError, OSError) as error:
        raise ConfigError(f"model.hf_path={str(path)!r}: {path / 'config.json'} cannot be used: {error}") from None
    try:
        return causal_lm_backend(path, model.backend)
    except ValueError as error:
        raise ConfigError(f"model.backend={model.backend!r}: {error}") from None


def hf_shape(path: str | Path):
    """The transformers ``PretrainedConfig`` of checkpoint ``path`` (config.json only, no weights)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    except ImportError as error:
        raise ConfigError("a transformers model needs transformers: pip install 'hybridpar[hf]'.") from error
    try:
        shape = transformers_config(path)
    except ValueError as error:
        raise ConfigError(f"model.hf_path={str(path)!r}: {error}") from None
    if type(shape) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"model.hf_path={str(path)!r} holds a {type(shape).__name__}, which has no causal-LM class in "
                          "transformers; hybridpar trains causal language models (AutoModelForCausalLM).")
    return shape


def hf_meta_model(shape) -> nn.Module:
    """The transformers model of ``shape`` on the meta device (its modules, no memory), its Mamba2
    mixers switched to hybridpar's core as ``build_hf_model`` switches them."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(shape)
    except (ArithmeticError, TypeError, RuntimeError, IndexError, KeyError, AttributeError) as error:
        # a field transformers reads without checking (a zero it divides by, a width conv1d refuses)
        first = (str(error).strip().splitlines() or [""])[0][:200]
        where = getattr(shape, "name_or_path", "") or "the model's"
        raise ConfigError(f"model.hf_path={where!r}: config.json builds no {type(shape).__name__} model "
                          f"({type(error).__name__} in transformers: {first}); a field there is out of range: "
                          "restore the checkpoint's config.json.") from None
    if problem := causality_problem(model):  # trained on shifted labels, it would read each target from its input
        raise ConfigError(f"model.hf_path={getattr(shape, 'name_or_path', '') or 'the model'!r}: {problem}.")
    return install_cores(model)


def _shapes_only():
    """A torch-function mode under which parameter initializers do nothing: a meta tensor has a
    shape and no values. (torch's meta initializers also cost about a second in a fresh
    process: the first one imports ``torch._dynamo``.) ``HybridLM`` and ``Mamba2Mixer`` skip
    their own initialization on meta."""
    from torch.nn import init
    from torch.overrides import TorchFunctionMode

    value_only = {init.uniform_, init.normal_, init.trunc_normal_, init.constant_, init.kaiming_uniform_,
                  torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.fill_, torch.Tensor.zero_}

    class ShapesOnly(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in value_only:
                tensor = args[0] if args else kwargs["tensor"]
                if tensor.is_meta:
                    return tensor
            return func(*args, **kwargs)

    return ShapesOnly()


def meta_model(shape):
    """The model of ``shape`` on the meta device: its modules and parameter shapes, without
    memory, time or initial values."""
    from hybridpar.models.hybrid import HybridConfig, HybridLM

    if not isinstance(shape, HybridConfig):
        return hf_meta_model(shape)
    with torch.device("meta"), _shapes_only():
        return HybridLM(shape)


def install_cores(model: nn.Module) -> nn.Module:
    """Every token mixer hybridpar has a document-resetting core for, switched onto it: Mamba2 and
    Mamba1 mixers, RG-LRU blocks (RecurrentGemma), gated short convs, gated DeltaNets (Qwen3-Next, Qwen3.5),
    Kimi Delta Attentions (Kimi Linear); squared ReLUs as products, Llama-form gated MLPs through
    ``gated_product`` and Llama-form RMSNorms through ``blocks.rms_norm`` (``models/hf/activations.py``:
    bf16 under CUDA's autocast, one ``[T, I]`` and one float32 ``[T, D]`` less kept); returns ``model``."""
    use_product_relu2(model)
    use_lean_gated_mlps(model)
    use_lean_rms_norms(model)
    install_mamba_core(model)
    install_mamba1_core(model)
    install_rglru_core(model)
    install_short_conv(model)
    install_gdn_core(model)
    install_kda_core(model)
    return model


def check_learned_positions(model: nn.Module, pack_size: int) -> None:
    """ConfigError if a row's position ids (up to ``pack_size - 1``) index past a learned position
    table (the preflight checks the meta model, the worker the loaded one)."""
    table = learned_positions(model) if hasattr(model, "get_input_embeddings") else None  # HybridLM: RoPE
    if table and pack_size > table[1]:
        raise ConfigError(f"data.pack_size={pack_size} is longer than the {table[1]} positions "
                          f"{type(model).__name__} learned ({table[0]}): position ids past {table[1] - 1} have no "
                          f"embedding. Use data.pack_size <= {table[1]}.")
    from hybridpar.parallel.context.hf import hf_attention_modules
    from hybridpar.parallel.context.hf_types import _document_limit

    hf = hasattr(model, "get_input_embeddings")
    limits = [_document_limit(m)[0] for _, m in (hf_attention_modules(model) if hf else [])]
    longest = min((n for n in limits if n is not None), default=None)  # Llama 4's chunk and temperature floor
    if longest is not None and pack_size > longest:
        raise ConfigError(f"data.pack_size={pack_size}: {type(model).__name__}'s chunked attention and temperature "
                          f"tuning equal transformers' only for documents of at most {longest} tokens (its "
                          f"attention_chunk_size / floor_scale), and a document may fill a pack; use data.pack_size <= "
                          f"{longest}.")


def pack_position_note(config: RunConfig) -> str | None:
    """A warning when ``data.pack_size`` passes the positions ``model.hf_path``'s RoPE covers (a
    computed-position model runs there, extrapolating; a learned table is refused above), or None."""
    from types import SimpleNamespace

    from hybridpar.models.hf.positions import position_note
    from hybridpar.strict_json import load_file as load_json

    if not config.model.hf_path:
        return None
    try:
        fields = load_json(Path(config.model.hf_path) / "config.json")
    except (OSError, ValueError, RecursionError):
        return None  # read and refused with its reason by the checks before this one
    if isinstance(fields, dict) and "max_position_embeddings" not in fields and isinstance(fields.get("text_config"), dict):
        fields = fields["text_config"]
    if not isinstance(fields, dict):
        return None
    return position_note(SimpleNamespace(hf_config=fields), config.data.pack_size,
                         f"data.pack_size={config.data.pack_size}: a packed row needs")


def build_hf_model(config: RunConfig, dtype: torch.dtype) -> nn.Module:
    """The transformers model of ``model.hf_path`` in ``dtype`` (weights from local safetensors), its
    Mamba2 mixers on hybridpar's core (``models/hf/mixers/mamba2.install_mamba_core``)."""
    model = load_causal_lm(config.model.hf_path, "transformers", dtype=dtype)
    check_learned_positions(model, config.data.pack_size)
    if dtype == torch.float64:  # float64 throughout: kept-in-fp32 modules (routers) too, and every float32 cast
        keep_float64(model.to(torch.float64))
    install_cores(model)
    if problem := future_probe(model, model.config.vocab_size):  # what the config did not say (causality_problem)
        raise ConfigError(f"model.hf_path={str(config.model.hf_path)!r}: {problem}.")
    probe_logits_after_head(model)  # the soft cap or scale past lm_head checked; anything else: the loss takes the logits
    key_model_dropout(model, config.train.seed)  # hidden-state dropout keyed by token: every layout draws alike
    capture_router_aux(model)  # output_router_logits: the trainer adds its load-balancing loss (models/hf/router_aux)
    return model


def attention_dropout_problem(config: RunConfig, shape, processes: int) -> str | None:
    """A transformers checkpoint's attention-probability dropout on more than one process: its masks
    are drawn per rank (``models/token_dropout.unkeyed_dropout``), so the step is not one process's."""
    fields = unkeyed_dropout(shape) if config.model.hf_path and model_backend(config) == "transformers" else {}
    if not fields or processes == 1:
        return None
    field, p = next(iter(fields.items()))
    return (f"{type(shape).__name__.removesuffix('Config')} applies attention dropout ({field}={p:g}), whose masks each "
            "rank draws for its own (query, key) pairs, so at this layout a step is not one process's (its hidden-state "
            f"dropout is keyed by token and is); set \"{field}\": 0.0 in {config.model.hf_path}/config.json for an exact "
            "layout.")


PROBE_TOKENS = 8


def unkeyed_randomness(model: nn.Module, vocab_size: int) -> bool:
    """Whether a train-mode forward of ``model`` still draws from the generator after its dropouts
    were keyed (functional dropout such as OPT's ``dropout``, attention dropout, router jitter, Phi-MoE's
    sampled experts): a forward of ``PROBE_TOKENS`` tokens moves the generator's state, or two with the same
    keys and different generator seeds differ (beyond rounding)."""
    ids = torch.arange(PROBE_TOKENS, device=next(model.parameters()).device)[None] % vocab_size
    set_dropout_tokens(model, 0, token_keys(torch.tensor([0]), torch.arange(PROBE_TOKENS)))
    was_training = model.training
    model.train()
    cuda = [ids.device] if ids.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            logits, drew = [], False
            for seed in (1, 2):
                torch.manual_seed(seed)
                state = _generator_states(cuda)
                logits.append(model(input_ids=ids, use_cache=False).logits)
                drew = drew or any(not torch.equal(a, b) for a, b in zip(state, _generator_states(cuda)))
    finally:
        model.train(was_training)
        set_dropout_tokens(model, 0, None)
    if drew:  # a draw from the generator (keyed dropout draws none): Phi-MoE's sampled routing, whose logits rarely move
        return True
    if ids.device.type == "cpu":  # deterministic kernels: any difference is a random draw
        return not torch.equal(*logits)
    first, second = (x.double() for x in logits)  # a nondeterministic CUDA kernel moves logits by rounding only
    return bool((first - second).abs().max() > 1e-3 * first.abs().max().clamp_min(1.0))


def _generator_states(cuda: list) -> list:
    return [torch.random.get_rng_state(), *(torch.cuda.get_rng_state(device) for device in cuda)]


def randomness_problem(config: RunConfig, model: nn.Module, vocab_size: int, processes: int) -> str | None:
    """On more than one process: why a transformers model's training step is not one process's: its
    attention dropout (``attention_dropout_problem``), or random numbers no token key reaches that
    the probe finds (``unkeyed_randomness``). The trainer says it; ``check`` refuses."""
    if processes == 1:
        return None
    attention = attention_dropout_problem(config, model.config, processes)
    if attention or not unkeyed_randomness(model, vocab_size):
        return attention
    fields = random_fields(vars(model.config))
    named = ", ".join(f"{k}={v:g}" for k, v in fields.items()) or "no config field names it"
    return (f"{type(model).__name__} draws random numbers in training that no token key reaches ({named}: functional "
            "dropout, attention dropout or router jitter), so each rank draws its own and at this layout a step is not "
            f"one process's; set them to 0.0 in {config.model.hf_path}/config.json for an exact layout (a model that "
            "samples in its forward whatever its fields say, such as Phi-MoE's routing, is exact on one process only).")


def use_blockwise_attention(model: nn.Module) -> str:
    """Run ``model`` (one process, cp = 1) on hybridpar's blockwise attention if it can take it
    (module docstring); returns the progress line that says which attention runs."""
    problem = attention_problem(model)
    if problem is None:
        use_hybridpar_attention(model)
        return "attention: hybridpar's blockwise document-causal core (no [S, S] mask; memory linear in the pack size)"
    return (f"attention: transformers' {model.config._attn_implementation!r} over rows of one document each (the "
            f"packing line says so), because {problem.rstrip('.')}{own_attention_note(model)}")


def hf_forward_inputs(sharded: ShardedInputs, model: nn.Module) -> dict:
    """The transformers forward's keyword inputs (besides the ids) for this rank's share of a pack:
    ``position_ids [1, T/cp]`` restarting at 0 at every document, and for ``"hybridpar"``
    attention the (under CP localized) ``packed_seq_params`` it reads (``parallel/cp_hf.hf_cp_inputs``)."""
    inputs = hf_cp_inputs(sharded)
    for key in ("input_ids", "inputs_embeds", "use_cache"):
        inputs.pop(key, None)
    if not runs_hybridpar_attention(model) and not bridged_mixers(model):  # only position ids reach the model
        inputs.pop("packed_seq_params", None)
    return inputs


def loss_path_line(model: nn.Module) -> str:
    """The progress line that says which loss a transformers model trains with (``hf_loss_sum``)."""
    try:
        _, scale, softcap = chunked_head(model)
    except ValueError as error:
        return f"loss: through the [tokens, vocabulary] logits, because {error}"
    on = "" if (scale, softcap) == (1.0, None) else f" on the logits {describe_transform(scale, softcap)}"
    return f"loss: chunked LM head + cross entropy{on} (no [tokens, vocabulary] logits; vocab-parallel under TP)"


def hf_loss_sum(model: nn.Module, input_ids: Tensor, labels: Tensor, inputs: dict,
                predictions: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(summed token loss, argmax ids or None)`` of a transformers model on ``input_ids [B, S]``
    with hybridpar's shifted ``labels [B, S]`` (module docstring)."""
    try:
        chunked_head(model)
    except ValueError:  # soft-capped / scaled logits or a head bias: through the logits [B, S, V]
        logits = model(input_ids=input_ids, use_cache=False, **inputs).logits
        return token_loss_sum(logits, labels), logits.argmax(-1) if predictions else None
    found = {}

    mixed = autocast_dtype(model)  # the forward ran under autocast: so do the head's matmuls

    def head_loss(hidden: Tensor, weight: Tensor, target: Tensor, scale: float = 1.0,
                  softcap: float | None = None) -> Tensor:
        with torch.autocast(hidden.device.type, dtype=mixed, enabled=mixed is not None):
            out = lm_head_loss_output(hidden, weight, target, return_predictions=predictions, scale=scale,
                                      softcap=softcap)
        found["predictions"] = out.predictions
        return out.loss_sum

    loss_sum = hf_causal_lm_loss(model, input_ids, labels, 1, loss_fn=head_loss, **inputs)  # count 1: the sum
    return loss_sum, found["predictions"]
