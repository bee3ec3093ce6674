"""Round 15 faults in the model's inputs and the run directory (docs/reliability.md "Round 15").

- A token id outside the vocabulary: one process raised torch's bare ``IndexError``; under tensor
  parallelism the vocabulary-parallel embedding gave it a zero vector, since no rank's shard holds the
  row, and the forward went on silently. Now a one-line ``ValueError`` names the id and the vocabulary,
  on every rank, before any collective.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.distributed.harness import run_ranks


def _tiny_hybrid():
    import hybridpar as hp

    torch.manual_seed(0)
    return hp.HybridLM(hp.HybridConfig.from_preset("tiny"))


@pytest.mark.parametrize("bad", [256, 10_000, -3])
def test_token_id_outside_the_vocabulary_is_one_value_error(bad):
    model = _tiny_hybrid()
    with pytest.raises(ValueError, match=rf"token id {bad}, outside the model's vocabulary \[0, 256\)"):
        model(torch.tensor([[1, 2, bad, 4]]))
    model(torch.tensor([[0, 255]]))  # both ends of the vocabulary run


def _tp_out_of_vocabulary(rank, world_size):
    import hybridpar as hp
    from transformers import LlamaConfig, LlamaForCausalLM

    results = {}
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    for name, model in (("hybrid", _tiny_hybrid()), ("llama", llama)):
        dims = hp.ParallelDims(tp=2)
        model = hp.parallelize(model, dims, mesh=dims.build_mesh())
        vocab = 256 if name == "hybrid" else 96
        try:
            model(torch.tensor([[1, 2, vocab, 4]]))
            results[name] = "ran"
        except ValueError as error:
            results[name] = str(error)
    return results


def test_token_id_outside_the_vocabulary_under_tensor_parallelism_is_refused_on_every_rank():
    for ranks in run_ranks(2, _tp_out_of_vocabulary, timeout_s=120):
        assert "token id 256, outside the model's vocabulary [0, 256)" in ranks["hybrid"]
        assert "token id 96, outside the model's vocabulary [0, 96)" in ranks["llama"]


def test_a_prompt_that_spells_the_end_token_keeps_it(tmp_path):
    """``document(text, add_eos=False)`` removed the last token whenever it was EOS, so ``generate --prompt
    "hi<|eos|>"`` lost the end token the user typed. Only a token the tokenizer adds is removed now."""
    from hybridpar.data.tokenizers import BPE_SPECIALS, load_pretrained_tokenizer
    from tests.data.bpe import train_tiny_bpe

    train_tiny_bpe(tmp_path)
    tokenizer = load_pretrained_tokenizer(tmp_path)
    eos, bos = BPE_SPECIALS["eos"], BPE_SPECIALS["bos"]
    plain = tokenizer.encode("hello", add_special_tokens=False)
    own = tokenizer.encode("hello")  # the tokenizer's own specials: a BOS in front
    assert own == [tokenizer.bos_id] + plain
    assert tokenizer.document(f"hello{eos}", add_eos=False) == own + [tokenizer.eos_id]
    assert tokenizer.document("hello", add_eos=False) == own
    assert tokenizer.document("hello") == own + [tokenizer.eos_id]
    assert tokenizer.document(f"{bos}hello", add_bos=False, add_eos=False) == [tokenizer.bos_id] + plain
    assert tokenizer.document("hello", add_bos=False, add_eos=False) == plain


def test_a_dry_run_says_a_held_out_document_would_be_split(tmp_path, monkeypatch):
    """Training says once that the packer splits documents longer than the pack, the held-out ones included
    (at the first evaluation). A dry run built the evaluation packs with their notices silenced, since the
    training packs' notices had been said: a long held-out document was split without a word."""
    from hybridpar.train.batches import PackStream
    from tests.train.fault_probes import cli

    monkeypatch.setattr(PackStream, "_warned", False)
    short, long = "a short paragraph.", "a long held-out paragraph " * 10
    (tmp_path / "data.txt").write_text("\n\n".join([short] * 18 + [long] * 2) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, output = cli("train", "data.task=text", f"data.path={tmp_path / 'data.txt'}", "data.pack_size=64",
                           f"output_dir={tmp_path / 'run'}", "train.steps=2", "train.eval_every=1", "--dry-run")
    said = [str(w.message) for w in caught if "pack_documents(pack_size=64)" in str(w.message)]
    assert code == 0 and said == ["pack_documents(pack_size=64): split 2 documents longer than the pack into pieces, "
                                  "dropped 0 such documents (0 tokens), skipped 0 empty documents."], (said, output)


def test_a_resume_warning_says_rounds_only_for_chunk_size():
    """Every changed field's warning said "computes (chunk_size: rounds) otherwise", a rope_theta one too."""
    from hybridpar.train.run.model_change import function_change_notes

    theta, chunk = function_change_notes("ckpt", {"rope_theta": 1e4, "chunk_size": 16}, {"rope_theta": 5e5, "chunk_size": 8},
                                         ["rope_theta", "chunk_size"])
    assert "but the model computes otherwise, so the losses" in theta and "chunk" not in theta
    assert "but the model rounds otherwise (the same function, summed in other chunks)" in chunk


def _export_nemotron_moe(rank, world_size, out_dir, layout):
    import hybridpar as hp
    from hybridpar.models.hf.causal_lm import export_causal_lm
    from tests.models.hf.hybrid_models import build_hybrid

    model = build_hybrid("nemotron_h_moe")
    with torch.no_grad():
        bias = model.model.layers[2].mixer.gate.e_score_correction_bias
        bias.copy_(torch.tensor([0.5, -1.0, 0.25, 2.0], dtype=bias.dtype))  # a trained router's, not zeros
    dims = hp.ParallelDims(**layout)
    model = hp.parallelize(model, dims, mesh=dims.build_mesh())
    state = hp.canonical_state_dict(model)  # every rank: the parameters' gathers
    if rank == 0:
        export_causal_lm(model, f"{out_dir}/{'_'.join(layout)}", state_dict=state)
    return rank


@pytest.mark.parametrize("layout", [{"tp": 2}, {"dp_shard": 2}])
def test_a_nemotron_moe_export_carries_the_routers_correction_bias(tmp_path, layout):
    """Exporting Nemotron-3-Nano's MoE (``model.export_hf``) failed after training: "state_dict does not fit
    NemotronHForCausalLM: missing [...gate.e_score_correction_bias]", a persistent buffer no parameter state
    holds (round 15h). The export now takes the model's own buffers, on rank 0 alone (no collective)."""
    from transformers import AutoModelForCausalLM

    run_ranks(2, _export_nemotron_moe, str(tmp_path), layout, timeout_s=120)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "_".join(layout), dtype=torch.float64)
    bias = loaded.model.layers[2].mixer.gate.e_score_correction_bias
    assert bias.tolist() == [0.5, -1.0, 0.25, 2.0]


def test_merging_adapters_of_a_shared_block_is_refused_before_training(tmp_path):
    """A merged LoRA export of Zamba2's shared block used by two layers is refused (round 15h), but only at the
    export, after training. The run's checks now refuse it before step 1, a dry run included."""
    from tests.models.hf.hybrid_models import build_hybrid
    from tests.train.fault_probes import cli

    build_hybrid("zamba2_shared").save_pretrained(tmp_path / "base")
    code, output = cli("train", f"model.hf_path={tmp_path / 'base'}", "data.task=mqar", "peft.method=lora",
                       "peft.target_modules=[q_proj, in_proj]", "peft.merge=true", f"model.export_hf={tmp_path / 'out'}",
                       f"output_dir={tmp_path / 'run'}", "train.steps=2", "--dry-run")
    assert code == 2 and "model.export_hf with peft.merge=true: cannot merge the LoRA adapters of " \
        "'model.layers.1.shared_transformer.self_attn.q_proj' and 'model.layers.3" in output, output
    assert not (tmp_path / "run").exists()
