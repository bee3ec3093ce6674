"""Round 23 of fault hunting (docs/reliability.md, "Round 23"): every transformers causal-LM family, tiny and float64,
through the trainer's own loading and loss (``train.trainer.build_model``, ``pack_loss_sum``) against transformers'
``model(ids, labels=ids).loss``, and through ``train --dry-run``."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.train.fault_probes import cli, refusal_line, saved_checkpoints

VOCAB = 128
S = 20
_C = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
          num_hidden_layers=2, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_E = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB)
_WINDOWED = dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"])


def _builders(hf) -> dict:
    return {
        # a learned per-token logit scale inside lm_head (DoryLMHead), nGPT-style gates
        "dory": lambda: hf.DoryForCausalLM(hf.DoryConfig(head_dim=16, **_WINDOWED, **_C)),
        "granite": lambda: hf.GraniteForCausalLM(hf.GraniteConfig(  # every multiplier, a logit scale
            attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=0.25, **_C)),
        "gemma2": lambda: hf.Gemma2ForCausalLM(hf.Gemma2Config(  # soft caps, embedding scale, windows
            head_dim=16, final_logit_softcapping=1.5, attn_logit_softcapping=2.0, query_pre_attn_scalar=24, **_WINDOWED,
            **_C)),
        "gpt2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_inner=64, vocab_size=VOCAB,
                                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "minicpm3": lambda: hf.MiniCPM3ForCausalLM(hf.MiniCPM3Config(  # MLA, embedding / depth / logit scales
            **{**_C, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=24, scale_emb=3.0, scale_depth=1.4, dim_model_base=16)),
        "glm4_moe_lite": lambda: hf.Glm4MoeLiteForCausalLM(hf.Glm4MoeLiteConfig(  # MLA + MoE (GLM-4.7-Flash)
            **{**_C, "num_key_value_heads": 4}, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=8, mlp_layer_types=["dense", "sparse"])),
        "phimoe": lambda: hf.PhimoeForCausalLM(hf.PhimoeConfig(num_local_experts=4, num_experts_per_tok=2, **_C)),
        "bloom": lambda: hf.BloomForCausalLM(hf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB)),
        # bidirectional: BERT-like without is_decoder, a Llama with is_causal false, Gemma 3 bidirectional
        "bert_encoder": lambda: hf.BertLMHeadModel(hf.BertConfig(**_E)),
        "llama_not_causal": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**_E, is_causal=False)),
        "gemma3_bidirectional": lambda: hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(
            **_E, head_dim=16, use_bidirectional_attention=True)),
        "llama4": lambda: hf.Llama4ForCausalLM(hf.Llama4TextConfig(  # transposed experts, shared expert added in place
            **_C, head_dim=16, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
            no_rope_layers=[1, 0], attention_chunk_size=24, floor_scale=41)),
        "gemma3n": lambda: hf.Gemma3nForCausalLM(hf.Gemma3nTextConfig(  # per-layer intermediate sizes
            head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
            laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], sliding_window=5,
            layer_types=["sliding_attention", "full_attention"] * 2,
            **{**_C, "num_hidden_layers": 4, "intermediate_size": [64] * 4})),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny float64 checkpoint of a family, by name (``save_pretrained``, every parameter perturbed)."""
    import transformers as hf

    from tests.models.hf.tiny import perturbed_float64

    builders = _builders(hf)

    def make(name: str):
        model = perturbed_float64(builders[name])
        if name == "llama_not_causal":
            model.config.is_causal = False
        return model
    return saved_checkpoints(tmp_path_factory, make)


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _transformers_own(path, ids):
    """transformers' own ``model(ids, labels=ids).loss`` and gradients, float64 throughout (as the trainer runs)."""
    import transformers as hf

    from hybridpar.models.hf.float64 import keep_float64

    model = hf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    keep_float64(model.to(torch.float64)).eval()  # RoPE's float32 inv_freq too, as the trainer's .to(float64)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), _grads(model)


def _trainers(path, ids):
    """The trainer's loss of one document (one row, no packing) and gradients, and its loss-path line."""
    from hybridpar.config import load_config
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.train.hf_model import loss_path_line, use_blockwise_attention
    from hybridpar.train.trainer import build_model, pack_loss_sum

    with contextlib.redirect_stdout(io.StringIO()):
        model = build_model(load_config(None, [f"model.hf_path={path}", "model.dtype=float64", "data.pack_size=32"]))
    use_blockwise_attention(model)
    labels = torch.roll(ids, -1, 1)
    labels[0, -1] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, ids.shape[1]], dtype=torch.int32))
    loss = pack_loss_sum(model.eval(), shard_inputs(input_ids=ids, labels=labels, packed=packed))[0] / (ids.shape[1] - 1)
    loss.backward()
    return loss.detach(), _grads(model), loss_path_line(model)


@pytest.mark.parametrize("name", ["dory", "granite", "gemma2", "gpt2", "minicpm3", "bloom"])
def test_the_trainers_loss_is_transformers_own(saved, name):
    """Before: Dory trained 1.8e-2 (relative) off its own loss, with its ``lm_head.logit_scale`` (a learned scale per
    token, in ``DoryLMHead.forward``) never trained: the chunked loss read ``lm_head.weight`` alone, and the load-time
    probe compared the logits with the head's *output*, which already held the scale. A head with its own forward or
    parameters now takes the logits path. The others stand for their kind (multipliers, soft caps, learned positions,
    MLA with MiniCPM's scales, ALiBi on transformers' attention): equal to 1e-12 in float64, every gradient. MiniCPM3
    took the logits path: its ``logits_scaling`` divides the head's *input*, so the probe saw the head's output unscaled
    against the config's claim; the probe now takes logits equal to the head's output as the transform done before it."""
    path = saved(name)
    ids = torch.randint(3, VOCAB, (1, S), generator=torch.Generator().manual_seed(3))
    want, want_grads = _transformers_own(path, ids)
    got, got_grads, line = _trainers(path, ids)
    assert abs(float(got - want)) <= 1e-12 * float(want), (float(got), float(want))
    assert sorted(got_grads) == sorted(want_grads)
    scale = max(float(g.abs().max()) for g in want_grads.values())
    for n, g in want_grads.items():
        assert float((got_grads[n] - g).abs().max()) <= 1e-11 * scale, n
    if name == "dory":
        assert "its head DoryLMHead computes more than hidden @ weight.T (its own forward, parameters logit_scale)" in line
        assert float(got_grads["lm_head.logit_scale"].abs().max()) > 0
    if name == "minicpm3":  # its logits_scaling divides the head's input: the chunked loss already reads that
        assert line.startswith("loss: chunked LM head + cross entropy (no [tokens, vocabulary] logits"), line


@pytest.mark.parametrize("name, said", [
    ("bert_encoder", 'BertLMHeadModel has is_decoder=False: its attention is bidirectional, so every position sees the '
                     'token it is trained to predict (a causal LM\'s shifted labels); set "is_decoder": true'),
    ("llama_not_causal", 'LlamaForCausalLM has is_causal=False: its attention is bidirectional'),
    ("gemma3_bidirectional", 'Gemma3ForCausalLM has use_bidirectional_attention=True: its attention is bidirectional, '
                             'so every position sees the token it is trained to predict (a causal LM\'s shifted '
                             'labels); set "use_bidirectional_attention": false'),
])
def test_a_bidirectional_model_is_refused_before_any_process_starts(saved, tmp_path, name, said):
    """Before: a BERT-like ``*ForCausalLM`` without ``is_decoder`` (transformers only logs "add is_decoder=True"), a
    Llama with ``is_causal: false`` and a Gemma 3 with ``use_bidirectional_attention`` passed ``--dry-run`` and trained
    on transformers' bidirectional attention, one document per row: every position saw its own target (the next
    token), so the loss fell towards 0 and the model learned nothing a causal LM can use, without a word."""
    run = [f"model.hf_path={saved(name)}", "model.dtype=float64", "data.pack_size=64", f"output_dir={tmp_path}"]
    verbs = [["train", "--dry-run"], ["train", "--dry-run", "--nproc-per-node", "2", "parallel.dp_shard=2"], ["plan"],
             ["check", "--packing", "--dry-run"]]
    for verb in verbs if name == "bert_encoder" else verbs[:1]:
        code, output = cli(*verb, *run)
        line = refusal_line(output)
        assert code == 2 and said in line, (verb, output)
        assert "Traceback" not in output


def test_the_loaded_model_is_probed_for_causality_too(saved):
    """A bidirectional model its config does not flag is caught where the trainer loads it: changing the last token
    must leave every earlier position's logits alone (``packing_rule.future_probe``)."""
    import transformers as hf

    from hybridpar.train.packing_rule import future_probe

    encoder = hf.AutoModelForCausalLM.from_pretrained(saved("bert_encoder"), dtype=torch.float64)
    found = future_probe(encoder, VOCAB)
    assert found.startswith("BertLMHeadModel is not causal: changing the last of 16 tokens moves the logits of earlier "
                            "positions"), found
    assert future_probe(hf.AutoModelForCausalLM.from_pretrained(saved("gpt2"), dtype=torch.float64), VOCAB) is None


def test_per_layer_intermediate_sizes_are_a_valid_config(saved, tmp_path):
    """Before: every Gemma 3n text checkpoint (``intermediate_size`` is a list, one per layer) was refused before any
    process started: "intermediate_size=[64, 64, 64, 64] must be an integer >= 1; restore the checkpoint's config.json"
    (a type rule for a field transformers reads per layer); the tiny one trains exactly (loss = transformers')."""
    import json
    import shutil

    run = ["model.dtype=float64", "data.pack_size=64", f"output_dir={tmp_path / 'run'}"]
    code, output = cli("train", "--dry-run", f"model.hf_path={saved('gemma3n')}", *run)
    assert code == 0, output
    bad = tmp_path / "bad"
    shutil.copytree(saved("gemma3n"), bad)
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] = [64, 0, 64, 64]
    (bad / "config.json").write_text(json.dumps(config))
    code, output = cli("train", "--dry-run", f"model.hf_path={bad}", *run)
    assert code == 2 and "intermediate_size=[64, 0, 64, 64] must be each entry an integer >= 1" in refusal_line(output)


def test_sampled_routing_is_randomness_no_token_key_reaches(saved):
    """Before: Phi-MoE (its sparsemixer samples experts and Heun's step in training: ``exponential_``, ``rand_like``)
    passed the randomness probe, whose two forwards with different seeds gave the same logits, so ``train`` at dp_shard=2
    or tp=2 said nothing and ``check`` FAILED 26 of 27 quantities (loss 3e-2 apart) instead of refusing: each rank drew
    its own samples. The probe now also sees a forward move the generator (keyed dropout draws nothing from it)."""
    from hybridpar.config import load_config
    from hybridpar.train.hf_model import randomness_problem, unkeyed_randomness
    from hybridpar.train.trainer import build_model

    found = {}
    for name in ("phimoe", "gpt2"):
        config = load_config(None, [f"model.hf_path={saved(name)}", "model.dtype=float64", "data.pack_size=32"])
        with contextlib.redirect_stdout(io.StringIO()):
            model = build_model(config)
        found[name] = unkeyed_randomness(model, VOCAB)
        if name == "phimoe":
            said = randomness_problem(config, model, VOCAB, 2)
            assert said.startswith("PhimoeForCausalLM draws random numbers in training that no token key reaches "
                                   "(router_jitter_noise=0.01"), said
            assert said.endswith("such as Phi-MoE's routing, is exact on one process only)."), said
    assert found == {"phimoe": True, "gpt2": False}


def test_a_tied_weight_the_tp_plan_shards_on_one_side_only_is_refused_before_any_process_starts(saved, tmp_path):
    """Before: Bloom (and MPT, Falcon, OPT: tied embeddings, transformers' plan shards ``lm_head`` alone) passed
    ``train --dry-run --nproc-per-node 2 parallel.tp=2``; every rank then built and sharded the model and stopped with
    "tied weights transformer.word_embeddings.weight (None) and lm_head.weight ((Shard(dim=0),)) got different TP
    layouts". Tied models whose plan shards both sides (GPT-2) stay accepted."""
    run = ["--dry-run", "--nproc-per-node", "2", "model.dtype=float64", "data.pack_size=64", f"output_dir={tmp_path}",
           "parallel.tp=2"]
    code, output = cli("train", *run, f"model.hf_path={saved('bloom')}")
    line = refusal_line(output)
    assert code == 2 and line.startswith("hybridpar: error: parallel.tp=2: tied weights transformer.word_embeddings."
                                         "weight, lm_head.weight: the TP plan shards lm_head.weight and leaves "
                                         "transformer.word_embeddings.weight whole"), line
    code, output = cli("plan", *run[3:], f"model.hf_path={saved('bloom')}")
    assert code == 2 and "the TP plan shards lm_head.weight" in refusal_line(output)
    code, output = cli("train", *run, f"model.hf_path={saved('gpt2')}")
    assert code == 0, output


def test_a_pack_past_llama4s_chunk_is_refused_before_any_process_starts(saved, tmp_path):
    """Before: a Llama 4 text model with ``data.pack_size`` above its ``attention_chunk_size`` (24 here; 8192 in the
    real ones) passed ``train --dry-run --nproc-per-node 2`` and every rank stopped at its first pack with "... use
    data.pack_size <= 24"; the preflight now names it (the meta model's limit), at any layout."""
    run = ["--dry-run", "--nproc-per-node", "2", f"model.hf_path={saved('llama4')}", "model.dtype=float64",
           f"output_dir={tmp_path / 'run'}", "parallel.dp_shard=2"]
    code, output = cli("train", *run, "data.pack_size=64")
    line = refusal_line(output)
    assert code == 2 and line.startswith("hybridpar: error: data.pack_size=64: Llama4ForCausalLM's chunked attention"), line
    assert line.endswith("use data.pack_size <= 24."), line
    code, output = cli("train", *run, "data.pack_size=24")
    assert code == 0, output


def _check_tp2(rank, world_size, paths):
    """``hybridpar check`` at tp=2 (no SP, float64, packs of 24) of each checkpoint in ``paths``: exit code and what it
    printed."""
    from hybridpar.config import load_config
    from hybridpar.train.proof.layout import run_check

    found = {}
    for path in paths:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = run_check(load_config(None, [f"model.hf_path={path}", "model.dtype=float64", "data.pack_size=24",
                                                "parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=false",
                                                "output_dir=unused"]), torch.device("cpu"))
        found[path] = (code, out.getvalue())
    return found


def test_modules_the_tp_plan_leaves_whole_run_on_local_tensors_wherever_they_are_read(saved):
    """Before: Dory and Gemma 3n text at tp=2 (no SP) passed ``--dry-run`` and every rank stopped with "aten.mm.default
    got mixed torch.Tensor and DTensor". The modules a plan leaves whole are replicated and swap in their local tensors
    for their own forward, but (a) Dory's plan shards only its embedding, so the replicated module was the ``layers``
    ``ModuleList``, which is never called, and (b) Gemma 3n calls ``self.altup.predict(...)``, not its forward. Now a
    container's children are replicated one by one, and a module the plan shards in part keeps its replicated children
    local for its whole forward. And Gemma 3n's 95%-sparse MLPs (a cut-off at mean + z * std over the intermediate dim)
    stay whole under its registered plan: column-parallel, each rank took its own half's statistics (loss 0.16 off).
    Llama 4 (its experts stored transposed without saying so, its shared expert's output added into in place: the
    experts split on the wrong dim, then autograd refused the in-place add) and MiniCPM3 (MLA; "Hugging Face TP style
    'mla_kv_a_proj' is not supported", filed under parallel.sequence_parallel) have plans of their own now, and so has
    GLM-4-MoE-Lite (MLA and MoE, refused the same way)."""
    from hybridpar.config import load_config
    from hybridpar.parallel.tensor.apply import get_tp_plan
    from hybridpar.train.preflight import _named_parallel_key

    paths = [str(saved(name)) for name in ("dory", "gemma3n", "llama4", "minicpm3", "glm4_moe_lite")]
    found = run_ranks(2, _check_tp2, paths, timeout_s=600)[0]
    for path in paths:
        code, text = found[path]
        assert code == 0 and "check exact: all" in text, text[-2000:]
    import transformers as hf

    sparse = hf.Gemma3nForCausalLM.from_pretrained(paths[1])
    plan = get_tp_plan(sparse).styles
    assert sparse.config.activation_sparsity_pattern[0] > 0
    assert "model.layers.0.mlp.gate_proj" not in plan and "model.layers.1.mlp.gate_proj" in plan, sorted(plan)
    # a style hybridpar lacks is filed under parallel.tp, not under a key its list of supported styles spells
    config = load_config(None, ["parallel.tp=2", "parallel.cp=1"])
    assert _named_parallel_key(config, "Hugging Face TP style 'mla_kv_a_proj' is not supported (supported: ['colwise', "
                                       "'sequence_parallel'])") == "parallel.tp=2"
