"""Context parallelism for Hugging Face models (``parallel/context/hf.py``) against one process.

Tiny float64 Llama, Qwen3, Mistral (sliding window 6) and Gemma3 (a sliding layer with window
5, a full layer, ``query_pre_attn_scalar`` scaling) from ``tp_hf_models``: the single-process
reference is the transformers model with SDPA (packed rows through position ids that restart
at 0, which transformers masks per document); the parallel model goes through
``parallelize(model, dims, cp_attention=...)`` (FSDP over dp_shard x cp, TP plans at tp=2)
and is fed ``hf_cp_inputs(shard_inputs(...))``: each model with allgather and ulysses, one on
dense rows and the other on packed rows (at tp=2 the other way round). The loss (token-loss sum /
global count, summed over CP ranks) and every parameter gradient (``full_tensor``) agree to 1e-9. Ring, Qwen2
and Phi run once each; Mistral also with its blocks compiled (``aot_eager``): exact, and no
graph break. One process: the refusals, ``packed_from_position_ids``, and the attention
at cp=1 (documents from position ids or ``PackedSeqParams``) against SDPA.

Rows are 32 tokens; packed rows hold documents of 12 and 20 tokens, so at cp=2 (four zigzag
chunks per document) both documents are split across the two ranks and the window crosses
chunk boundaries. One process-group launch runs every case of a world size.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.tensor.hf_models import gradient_errors, relative_error

TOL = 1e-9
BATCH, SEQ = 2, 32
DOCS = [0, 12, 32]
MODELS = ("llama", "qwen3", "mistral", "gemma3")
VARIANTS = ("dense", "packed")


def _batch(vocab: int, variant: str):
    from hybridpar.parallel.context.hf import packed_from_position_ids

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels[:, ::5] = -100  # some tokens carry no target
    positions = torch.cat([torch.arange(b - a) for a, b in zip(DOCS[:-1], DOCS[1:])])  # restart at every document
    packed = packed_from_position_ids(positions) if variant == "packed" else None
    return ids, labels, packed


def _loss_sum(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")


def _build(name: str):
    """``build_model``'s tiny float64 models, and three more: Bloom (ALiBi: refused), DeepSeek-V3
    (multi-head latent attention: q/k head dim 8 + 8, v head dim 12, dense MLPs) and GPT-OSS
    (attention sinks, a sliding layer, biased experts)."""
    import transformers as hf

    from tests.distributed.tensor.hf_models import COMMON, build_model

    if name not in ("bloom", "deepseek_v3", "gpt_oss"):
        return build_model(name)
    torch.manual_seed(0)
    if name == "bloom":
        return hf.BloomForCausalLM(hf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=COMMON["vocab_size"]))
    # attention sinks: eager reference, on dense rows only (transformers' GPT-OSS lets packed documents see each
    # other through position ids: logits 1.39 apart; test_hf_model_types.py proves packed rows against each document
    # alone); a window of 6, biased experts
    if name == "gpt_oss":
        config = hf.GptOssConfig(**{**COMMON, "attn_implementation": "eager"}, head_dim=16, num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                 experts_implementation="eager")
        model = hf.GptOssForCausalLM(config).to(torch.float64)
    else:
        config = hf.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=24,
                                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2)
        model = hf.DeepseekV3ForCausalLM(config).to(torch.float64)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def _case(name: str, strategy: str, variant: str, dims, mesh, compile=False, sequence_parallel=False) -> dict:
    import torch.distributed as dist

    from hybridpar.parallel.context.hf import hf_cp_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.models.hf.float64 import keep_float64

    # Gemma2's reference is eager attention (SDPA does not soft-cap), whose softmax casts to float32, and
    # DeepSeek-V3's RMSNorms cast to float32: both models keep float64 there, as the trainer runs a float64 model
    exact = keep_float64 if name in ("gemma2", "deepseek_v3", "gpt_oss") else (lambda model: model)
    reference = exact(_build(name))
    ids, labels, packed = _batch(reference.config.vocab_size, variant)
    count = int((labels != -100).sum())
    positions = None if packed is None else packed.position_ids.expand(BATCH, -1)
    ref_loss = _loss_sum(reference(input_ids=ids, position_ids=positions, use_cache=False).logits, labels) / count
    ref_loss.backward()

    model = exact(_build(name))
    parallelize(model, dims, mesh=mesh, cp_attention=strategy, compile=compile, sequence_parallel=sequence_parallel)
    cp_group, tp_group = ParallelDims.group(mesh, "cp"), ParallelDims.group(mesh, "tp")
    sharded = shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=cp_group, tp_group=tp_group,
                           sequence_parallel=sequence_parallel)
    loss = _loss_sum(model(**hf_cp_inputs(sharded)).logits, sharded.labels) / count
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)  # [] -> the global loss

    errors = gradient_errors(model, reference)
    worst = max(errors, key=errors.get)
    return {"loss_error": abs(total.item() - ref_loss.item()), "grad_error": errors[worst], "worst": worst,
            "params": len(errors), "expected_params": len(dict(reference.named_parameters())),
            "attn": model.config._attn_implementation}


def _refusals(mesh) -> dict:
    """Messages of the errors that must come before any forward or collective (every rank raises alike)."""
    import transformers as hf

    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.distributed.tensor.hf_models import COMMON, build_model

    messages = {}
    three_heads = hf.LlamaForCausalLM(hf.LlamaConfig(**{**COMMON, "hidden_size": 48, "num_attention_heads": 3,
                                                          "num_key_value_heads": 1}))
    try:
        parallelize(three_heads, ParallelDims(cp=2), mesh=mesh, cp_attention="ulysses")
    except ValueError as error:
        messages["ulysses_heads"] = str(error)
    model = parallelize(build_model("llama"), ParallelDims(cp=2), mesh=mesh)
    try:
        model(input_ids=torch.zeros(1, 8, dtype=torch.long), attention_mask=torch.ones(1, 8, dtype=torch.long))
    except ValueError as error:
        messages["attention_mask"] = str(error)
    return messages


def _run_cases(rank: int, world_size: int, tp: int, cases: list, refusals: bool = False,
               compiled: tuple = (), sequence_parallel: tuple = ()) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    dims = ParallelDims(cp=2, tp=tp)
    mesh = dims.build_mesh()
    results = {case: _case(*case, dims, mesh) for case in cases}
    if refusals:
        results["refusals"] = _refusals(mesh)
    results.update({("sp", *case): _case(*case, dims, mesh, sequence_parallel=True) for case in sequence_parallel})
    if compiled:  # blocks compiled with aot_eager (dynamo's graph breaks are the same as inductor's)
        from torch._dynamo.utils import counters

        results.update({("compiled", *case): _case(*case, dims, mesh, compile="aot_eager") for case in compiled})
        results["graph_breaks"] = dict(counters["graph_break"])
    return results


def _check(results: list[dict]) -> None:
    for rank_results in results:
        for case, r in rank_results.items():
            if case in ("refusals", "graph_breaks"):
                continue
            assert r["attn"] == "hybridpar", case
            assert r["params"] == r["expected_params"], case
            assert r["loss_error"] < TOL, (case, r)
            assert r["grad_error"] < TOL, (case, r)


def test_cp2_matches_one_process_compiles_and_refuses_before_collectives():
    """cp=2: every model with allgather and ulysses, each on one row kind and the other on the other (the
    tp=2 test below takes the opposite pairs; the cores on both kinds: ``test_attention.py``); ring, Qwen2, Phi, OLMo2, Mixtral,
    Granite, Gemma2 (soft-capped scores) and GPT-OSS (attention sinks, every strategy) once each
    (``test_hf_model_types.py`` proves the other listed types at cp=1);
    Mistral compiled per block without graph breaks; the refusals that need a CP group."""
    cases = [(m, ("allgather", "ulysses")[(i + j + 1) % 2], v) for i, m in enumerate(MODELS) for j, v in enumerate(VARIANTS)]
    assert {(s, v) for _, s, v in cases} == {(s, v) for s in ("allgather", "ulysses") for v in VARIANTS}
    cases += [("mistral", "ring", "packed"), ("gemma3", "ring", "dense"), ("qwen2", "allgather", "packed"),
              ("phi", "ulysses", "packed"), ("olmo2", "allgather", "packed"), ("mixtral", "ulysses", "packed"),
              ("granite", "ring", "packed"), ("gemma2", "ring", "packed"), ("gemma2", "ulysses", "dense"),
              ("deepseek_v3", "ulysses", "packed"), *(("gpt_oss", s, "dense") for s in ("ring", "ulysses", "allgather"))]
    results = run_ranks(2, _run_cases, 1, cases, True, (("mistral", "allgather", "packed"),), timeout_s=600)
    _check(results)
    for rank_results in results:
        assert rank_results["graph_breaks"] == {}
        refusals = rank_results["refusals"]
        assert "3 query heads" in refusals["ulysses_heads"] and "model.layers.0.self_attn" in refusals["ulysses_heads"]
        assert "drop attention_mask" in refusals["attention_mask"]


def test_cp2_tp2_matches_one_process():
    """cp=2 x tp=2 (world 4) with the registered TP plans; each model runs both strategies, GPT-OSS
    ring; sequence parallelism once per strategy."""
    cases = [(m, ("allgather", "ulysses")[(i + j) % 2], v) for i, m in enumerate(MODELS) for j, v in enumerate(VARIANTS)]
    cases.append(("gpt_oss", "ring", "dense"))  # attention sinks sharded by head over TP, then ring over CP
    sp = (("gemma3", "allgather", "packed"), ("mistral", "ulysses", "dense"))
    results = run_ranks(4, _run_cases, 2, cases, False, (), sp, timeout_s=600)
    assert all(("sp", *case) in r for r in results for case in sp)
    _check(results)


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("model_kwargs, fragment", [
    ({"name": "bloom"}, "use cp=1"),
    ({"name": "bamba"}, "load the checkpoint as a HybridLM"),
    ({"name": "llama", "attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"name": "gpt2", "attn_pdrop": 0.1}, "attn_pdrop=0.1"),
    ({"name": "llama", "rope": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "'dynamic'"),
    ({"name": "gemma3", "use_bidirectional_attention": True}, "bidirectional"),
])
def test_unsupported_models_are_refused_before_any_collective(model_kwargs, fragment):
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import validate_parallelize

    kwargs = dict(model_kwargs)
    model = _build(kwargs.pop("name"))
    if "rope" in kwargs:
        model.config.rope_parameters = kwargs.pop("rope")
    for key, value in kwargs.items():
        setattr(model.config, key, value)
    with pytest.raises(ValueError, match="context parallel") as error:
        validate_parallelize(model, ParallelDims(cp=2))
    assert fragment in str(error.value)


def test_attention_sinks_without_a_plan_that_shards_them_are_refused_under_tp_in_one_line():
    import transformers as hf

    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import validate_parallelize
    from hybridpar.parallel.tensor.apply import check_tp_plan
    from tests.distributed.tensor.hf_models import COMMON

    validate_parallelize(_build("gpt_oss"), ParallelDims(cp=2, tp=2))  # its plan shards the sinks by head
    granite = hf.GraniteSWAForCausalLM(hf.GraniteSWAConfig(**{**COMMON, "attn_implementation": "eager"}))
    with pytest.raises(ValueError, match=r"^tensor parallelism for GraniteSWAForCausalLM: model.layers.0.self_attn has "
                                         r"attention sinks .* use parallel.tp=1 .* or a plan with HeadShardedSinks.$"):
        check_tp_plan(granite, 2, plan="default")


def test_packed_from_position_ids_and_single_process_attention_match_sdpa():
    """cp=1 with "hybridpar" attention: documents from position ids or PackedSeqParams, equal to SDPA."""
    from hybridpar.parallel.context.hf import hf_cp_inputs, packed_from_position_ids
    from hybridpar.parallel.context.inputs import shard_inputs
    from tests.distributed.tensor.hf_models import build_model

    positions = torch.cat([torch.arange(12), torch.arange(20)])[None].expand(BATCH, -1)
    packed = packed_from_position_ids(positions)
    assert packed.cu_seqlens.tolist() == DOCS
    with pytest.raises(ValueError, match="count 0, 1, 2"):
        packed_from_position_ids(torch.tensor([0, 1, 3, 0, 1]))
    with pytest.raises(ValueError, match="start at 0"):
        packed_from_position_ids(torch.tensor([1, 2, 0]))
    for name in ("mistral", "gemma3"):
        reference, model = build_model(name), build_model(name)
        model.set_attn_implementation(__import__("hybridpar.parallel.context.hf").parallel.context.hf.register_hf_attention())
        ids, _, _ = _batch(reference.config.vocab_size, "packed")
        want = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
        by_positions = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        by_packed = model(**hf_cp_inputs(shard_inputs(input_ids=ids, packed=packed))).logits
        assert relative_error(by_positions, want) < 1e-12 and relative_error(by_packed, want) < 1e-12, name


def test_parallelize_refuses_packed_documents_that_transformers_attention_would_leak():
    """At any layout (here one process), a transformers model whose attention ignores
    ``packed_seq_params`` (SDPA) is refused several documents per row, naming the fix; after
    ``use_hybridpar_attention`` the packed row equals each document run alone. A token mixer
    outside our cores (LFM2's short convolution before ``install_short_conv``) is refused them whatever the
    attention."""
    import transformers as hf

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.hf import refuse_unread_documents, use_hybridpar_attention
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.models.hf.hybrid_models import VOCAB, build_hybrid

    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 7, 16], dtype=torch.int32))
    model = parallelize(build_hybrid("granite"), ParallelDims())
    with pytest.raises(ValueError, match="2 documents per row.*'sdpa'.*use_hybridpar_attention"):
        model(input_ids=ids, position_ids=packed.position_ids, packed_seq_params=packed)
    one = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 16], dtype=torch.int32))
    model(input_ids=ids, position_ids=one.position_ids, packed_seq_params=one)  # one document: nothing to leak
    use_hybridpar_attention(model)
    logits = model(input_ids=ids, position_ids=packed.position_ids, packed_seq_params=packed).logits
    alone = [model(input_ids=ids[:, a:b], position_ids=torch.arange(b - a)[None]).logits for a, b in ((0, 7), (7, 16))]
    assert relative_error(logits, torch.cat(alone, dim=1)) < 1e-12

    lfm2 = hf.Lfm2ForCausalLM(hf.Lfm2Config(num_hidden_layers=2, layer_types=["conv", "full_attention"], hidden_size=64,
                                            intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                            vocab_size=VOCAB, use_cache=False))
    refuse_unread_documents(lfm2)  # its short convs still transformers' own (parallelize would switch them)
    with pytest.raises(ValueError, match="Conv1d.*one document per row"):
        lfm2(input_ids=ids, position_ids=packed.position_ids, packed_seq_params=packed)
