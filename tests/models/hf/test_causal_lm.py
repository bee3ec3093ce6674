"""Any transformers causal LM: backends, loading, the loss helper, export with the tokenizer.

Tiny Llama, Qwen3 and Mistral checkpoints saved by transformers in the test (with a BPE
tokenizer trained in the test) load through ``load_causal_lm``, take one training step with
``hf_causal_lm_loss``, export with ``export_causal_lm`` and reload in transformers with no
missing or unexpected keys, equal logits, and the tokenizer and chat template present.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers as hf

from hybridpar.data.chat import chat_document
from hybridpar.data.packing import collate_thd, pack_documents
from hybridpar.data.tokenizers import resolve_tokenizer
from hybridpar.models.hf.causal_lm import (causal_lm_backend, export_causal_lm, hf_causal_lm_loss, load_causal_lm,
                                           probe_logits_after_head)
from hybridpar.models.hf.checkpoint import load_hf, save_hf
from hybridpar.models.hf.files import copy_tokenizer_files
from hybridpar.models.hybrid import HybridConfig, HybridLM
from tests.data.bpe import train_tiny_bpe

VOCAB = 320  # the tiny BPE's size
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB)
CONFIGS = {
    "llama": lambda: hf.LlamaConfig(**COMMON),
    "qwen3": lambda: hf.Qwen3Config(head_dim=8, **COMMON),
    "mistral": lambda: hf.MistralConfig(sliding_window=6, **COMMON),
}
MESSAGES = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "how are you"}]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_tiny_bpe(tmp_path_factory.mktemp("bpe"))


def save_checkpoint(name, path, bpe):
    """A tiny random transformers model saved with save_pretrained, next to its tokenizer."""
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(CONFIGS[name]())
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(path)
    copy_tokenizer_files(bpe.source_dir, path)
    return path


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_train_export_and_reload_in_transformers(name, bpe, tmp_path):
    source = save_checkpoint(name, tmp_path / "source", bpe)
    assert causal_lm_backend(source) == "transformers"
    model = load_causal_lm(source, dtype=torch.float64)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}[name]
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    tokenizer = resolve_tokenizer("auto", model_path=source, vocab_size=model.config.vocab_size)
    assert tokenizer.source_dir == source

    batch = collate_thd(pack_documents([chat_document(MESSAGES, tokenizer)] * 2, pack_size=64))
    labels = batch["labels"]
    model.train()
    loss = hf_causal_lm_loss(model, batch["input_ids"], labels, (labels != -100).sum(), position_ids=batch["position_ids"])
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param.sub_(0.5 * param.grad)

    out = tmp_path / "export"
    export_causal_lm(model, out, tokenizer_dir=tokenizer.source_dir)
    reloaded, info = hf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, output_loading_info=True,
                                                             local_files_only=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    model.eval()
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(logits(reloaded, ids), logits(load_causal_lm(source, dtype=torch.float64), ids))
    exported_tokenizer = hf.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert exported_tokenizer.chat_template == tokenizer.chat_template is not None
    assert exported_tokenizer.encode("hello there") == tokenizer.encode("hello there")
    assert hf.GenerationConfig.from_pretrained(out).eos_token_id is not None


def test_export_of_a_gathered_state_dict_uses_a_fresh_single_device_model(bpe, tmp_path):
    torch.manual_seed(0)
    tied = hf.Qwen3ForCausalLM(hf.Qwen3Config(head_dim=8, tie_word_embeddings=True, **COMMON)).double()
    # canonical_state_dict of a parallel model: parameters only, the tied head once
    state = {name: param.detach() + 1.0 for name, param in tied.named_parameters()}
    assert "lm_head.weight" not in state
    export_causal_lm(tied, tmp_path / "export", state_dict=state)
    reloaded = load_causal_lm(tmp_path / "export", dtype=torch.float64)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    for name, param in reloaded.named_parameters():
        assert torch.equal(param, state[name]), name
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match=r"state_dict does not fit Qwen3ForCausalLM: missing \['model.norm.weight'\]"):
        export_causal_lm(tied, tmp_path / "bad", state_dict=state)
    with pytest.raises(ValueError, match="applies to HybridLM exports only"):
        export_causal_lm(tied, tmp_path / "x", architecture="Mamba2ForCausalLM")


def test_backends_choose_hybrid_or_transformers(bpe, tmp_path):
    mamba = tmp_path / "mamba2"
    torch.manual_seed(0)
    hf.Mamba2ForCausalLM(hf.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                                         n_groups=2, state_size=8, chunk_size=4)).save_pretrained(mamba)
    assert isinstance(load_causal_lm(mamba), HybridLM) and isinstance(load_causal_lm(mamba, "hybrid"), HybridLM)
    as_transformers = load_causal_lm(mamba, "transformers")
    assert type(as_transformers).__name__ == "Mamba2ForCausalLM"
    ids = torch.randint(0, VOCAB, (1, 9))
    torch.testing.assert_close(logits(load_causal_lm(mamba), ids), logits(as_transformers, ids), rtol=1e-4, atol=1e-4)
    # a HybridLM export carries the tokenizer files too
    save_hf(load_hf(mamba), tmp_path / "mamba2_export", tokenizer_dir=bpe.source_dir)
    assert hf.AutoTokenizer.from_pretrained(tmp_path / "mamba2_export", local_files_only=True).chat_template

    llama = save_checkpoint("llama", tmp_path / "llama", bpe)
    with pytest.raises(ValueError, match=r"backend 'hybrid' loads only .*LlamaForCausalLM.*use backend 'transformers'"):
        load_causal_lm(llama, "hybrid")
    with pytest.raises(ValueError, match=r"model backend 'jax' is unknown; choose one of \['auto', 'hybrid', 'transformers'\]"):
        load_causal_lm(llama, "jax")
    (llama / "model.safetensors").rename(llama / "pytorch_model.bin")
    with pytest.raises(ValueError, match="loads safetensors weights only"):
        load_causal_lm(llama)


def test_a_checkpoint_that_does_not_match_its_config_is_refused(bpe, tmp_path):
    source = save_checkpoint("llama", tmp_path / "source", bpe)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"does not match its LlamaForCausalLM config: \d+ missing keys: model.layers.2"):
        load_causal_lm(source)
    # Shapes that disagree (transformers itself raises a RuntimeError with a traceback): one ValueError
    (source / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    with pytest.raises(ValueError, match=r"\d+ mismatched keys: model.layers.0.mlp.down_proj.weight \(checkpoint \[") as error:
        load_causal_lm(source)
    assert len(str(error.value)) < 600



@pytest.mark.parametrize("backend", ["transformers", "hybrid"])
def test_quantized_or_integer_weights_are_refused_naming_them(bpe, tmp_path, backend):
    """transformers casts a weight stored as integers to float without a word (an int32 copy of a
    float weight loads as zeros), and a quantized checkpoint fails in its quantizer with a
    traceback: both are one ValueError, before any value is used."""
    from safetensors.torch import load_file, save_file

    if backend == "transformers":
        source, name = save_checkpoint("llama", tmp_path / "source", bpe), "model.layers.0.mlp.up_proj.weight"
    else:
        source, name = tmp_path / "source", "backbone.layers.0.mixer.in_proj.weight"
        save_hf(HybridLM(HybridConfig.from_preset("tiny", rotary_fraction=0.0)), source, architecture="NemotronHForCausalLM")
    tensors = load_file(source / "model.safetensors")
    for dtype in (torch.int32, torch.bool, torch.float8_e4m3fn):
        save_file({**tensors, name: tensors[name].to(dtype)}, source / "model.safetensors", metadata={"format": "pt"})
        short = str(dtype).removeprefix("torch.")
        with pytest.raises(ValueError, match=rf"stores weights that are not floating point: {name} \((I32|BOOL|F8_E4M3|{short})\)"):
            load_causal_lm(source, backend)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    with pytest.raises(ValueError, match=r"is a quantized checkpoint \(quantization_config with quant_method 'gptq'\)"):
        load_causal_lm(source, backend)

def test_loss_helper_equals_transformers_mean_loss_in_one_process_and_its_hidden_state_seam(bpe, tmp_path):
    model = load_causal_lm(save_checkpoint("llama", tmp_path / "source", bpe), dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]  # hybridpar's shifted labels of plain next-token prediction
    count = (labels != -100).sum()
    ours = hf_causal_lm_loss(model, ids, labels, count)
    torch.testing.assert_close(ours.float(), model(ids, labels=ids).loss, rtol=1e-6, atol=0)  # theirs: float32 CE
    mean = torch.nn.functional.cross_entropy(logits(model, ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(ours, mean, rtol=1e-13, atol=0)

    def logits_loss(hidden, weight, target):  # what a fused lm_head_loss computes
        return torch.nn.functional.cross_entropy((hidden @ weight.T).flatten(0, 1), target.flatten(), reduction="sum")

    torch.testing.assert_close(hf_causal_lm_loss(model, ids, labels, count, loss_fn=logits_loss), ours, rtol=1e-13, atol=0)
    model.config.final_logit_softcapping = 30.0  # a field Llama's forward ignores: logits = the head's output
    assert probe_logits_after_head(model) is None  # the identity on it, which the chunked loss computes
    torch.testing.assert_close(hf_causal_lm_loss(model, ids, labels, count, loss_fn=logits_loss), ours, rtol=1e-13, atol=0)
    model.config.final_logit_softcapping, model.config.output_multiplier_scale = None, 2.0  # a field nobody maps
    with pytest.raises(ValueError, match=r"sets output_multiplier_scale=2.0, a logit transform hybridpar does not map"):
        hf_causal_lm_loss(model, ids, labels, count, loss_fn=logits_loss)
    with pytest.raises(ValueError, match="global_count=0 must be a positive count"):
        hf_causal_lm_loss(model, ids, labels, 0)


def test_packed_documents_do_not_see_each_other(bpe, tmp_path):
    model = load_causal_lm(save_checkpoint("qwen3", tmp_path / "source", bpe), dtype=torch.float64)
    docs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 4)]
    batch = collate_thd(pack_documents(docs, pack_size=24))
    labels = batch["labels"]
    packed = hf_causal_lm_loss(model, batch["input_ids"], labels, 1, position_ids=batch["position_ids"])
    alone = sum(hf_causal_lm_loss(model, torch.tensor([d]), torch.tensor([d[1:] + [-100]]), 1) for d in docs)
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=0)


def test_generation_dispatches_to_hybrid_or_transformers(bpe, tmp_path):
    from hybridpar.models.hf.causal_lm import generate_causal_lm

    llama = load_causal_lm(save_checkpoint("llama", tmp_path / "source", bpe), dtype=torch.float64)
    prompt = torch.tensor([bpe.encode("hello there")])
    greedy = generate_causal_lm(llama, prompt, 6, eos_token_id=[])
    assert torch.equal(greedy, llama.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0))
    rng_state = torch.random.get_rng_state()
    sampled = [generate_causal_lm(llama, prompt, 6, temperature=1.0, top_p=0.9, seed=3, eos_token_id=[]) for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1]) and sampled[0].shape == (1, prompt.shape[1] + 6)
    assert torch.equal(torch.random.get_rng_state(), rng_state)  # the caller's generator is untouched
    torch.manual_seed(0)
    hybrid = HybridLM(HybridConfig.from_preset("tiny", vocab_size=VOCAB, dtype=torch.float64))
    assert torch.equal(generate_causal_lm(hybrid, prompt, 5), hybrid.generate(prompt, 5))
    with pytest.raises(ValueError, match="top_p=1.5"):
        generate_causal_lm(llama, prompt, 4, top_p=1.5)
