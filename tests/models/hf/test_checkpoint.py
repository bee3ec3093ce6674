"""Hugging Face interop: Mamba2 / Bamba / NemotronH checkpoints <-> HybridLM.

Each checkpoint is a tiny random transformers model saved to a temporary directory (no
downloads). transformers runs its SSD scan in float32, so logits are compared at 1e-5
relative to the largest logit; copies of the same weights are compared bit for bit.
"""

import json
import os
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BambaConfig, Mamba2Config, NemotronHConfig

from hybridpar.models.hf import checkpoint as hf_io
from hybridpar.models.hf.checkpoint import BAMBA, MAMBA2, NEMOTRON_H, load_hf, save_hf
from hybridpar.models.hybrid import HybridConfig, HybridLM

VOCAB, BATCH, SEQ_LEN = 64, 2, 11  # 11 is not a multiple of any chunk size below


def tiny_hf_config(architecture):
    if architecture == MAMBA2:
        return Mamba2Config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, expand=2, n_groups=2,
            state_size=8, chunk_size=4, tie_word_embeddings=True, time_step_limit=(0.0, 0.05),
        )
    if architecture == BAMBA:
        return BambaConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, attn_layer_indices=[1], num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
            mamba_d_state=8, mamba_chunk_size=3, mamba_expand=2, time_step_limit=(0.01, 1.3),
        )
    return NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, hybrid_override_pattern="M*-M-", num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
        ssm_state_size=8, chunk_size=4, time_step_min=0.05,
    )


EXPECTED_PATTERN = {MAMBA2: "MM", BAMBA: "M-*-M-", NEMOTRON_H: "M*-M-"}


@torch.no_grad()
def perturb_vectors(model, seed):
    """Norm weights start at one and biases at zero; make every 1-D parameter distinct."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        if param.dim() == 1:
            param.add_(0.1 * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def load_transformers(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def relative_error(ours, reference):
    return ((ours.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


def assert_same_tensors(dir_a, dir_b):
    a, b = hf_io.read_hf_tensors(dir_a), hf_io.read_hf_tensors(dir_b)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def build_checkpoint(architecture, path):
    """A tiny random transformers model saved with ``save_pretrained``, and its logits."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(architecture), attn_implementation="eager").eval()
    perturb_vectors(model, seed=1)
    model.save_pretrained(path)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    return types.SimpleNamespace(architecture=architecture, path=path, ids=ids, logits=hf_logits(model, ids))


@pytest.fixture(scope="module", params=[MAMBA2, BAMBA, NEMOTRON_H])
def checkpoint(request, tmp_path_factory):
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers(checkpoint):
    model = load_hf(checkpoint.path)
    assert model.config.pattern == EXPECTED_PATTERN[checkpoint.architecture]
    assert model.lm_head.weight.dtype == torch.float32
    if checkpoint.architecture == MAMBA2:  # tied embeddings stay one parameter
        assert model.lm_head.weight is model.backbone.embeddings.weight
    with torch.no_grad():
        logits = model(checkpoint.ids)
    assert relative_error(logits, checkpoint.logits) < 1e-5


def test_export_round_trips_bit_exactly_and_loads_in_transformers(checkpoint, tmp_path):
    model = load_hf(checkpoint.path)
    save_hf(model, tmp_path)
    assert_same_tensors(checkpoint.path, tmp_path)
    assert hf_io.read_hf_config(tmp_path) == hf_io.read_hf_config(checkpoint.path)
    reloaded = load_hf(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    exported = load_transformers(tmp_path)
    assert type(exported).__name__ == checkpoint.architecture
    torch.testing.assert_close(hf_logits(exported, checkpoint.ids), checkpoint.logits, rtol=0, atol=0)


def test_fine_tune_in_float64_then_export(checkpoint, tmp_path):
    model = load_hf(checkpoint.path, dtype=torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    ids = checkpoint.ids

    def loss_fn():
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    loss = loss_fn()
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().max() > 0, name
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    optimizer.step()
    with torch.no_grad():
        assert loss_fn() < loss

    save_hf(model, tmp_path)
    assert hf_io.read_hf_config(tmp_path)["dtype"] == "float64"
    exported = load_transformers(tmp_path)
    with torch.no_grad():
        assert relative_error(model(ids), hf_logits(exported, ids)) < 1e-5


NEW_MODEL_SHAPES = {
    MAMBA2: dict(pattern="MMM", tie_word_embeddings=True),
    BAMBA: dict(pattern="*-M-", rotary_fraction=0.5, mlp_gated=True, mlp_activation="silu", mlp_bias=True,
                attention_bias=True, time_step_limit=(0.0, 3.0), rope_theta=500.0),
    NEMOTRON_H: dict(pattern="M-*M-", rotary_fraction=0.0, time_step_limit=(0.01, float("inf")), mamba_proj_bias=True),
}


@pytest.mark.parametrize("architecture", [MAMBA2, BAMBA, NEMOTRON_H])
def test_model_built_here_exports_to_transformers(architecture, tmp_path):
    config = HybridConfig(vocab_size=VOCAB, hidden_size=32, mamba_num_heads=8, mamba_head_dim=8, mamba_n_groups=2,
                          ssm_state_size=8, chunk_size=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          intermediate_size=48, **NEW_MODEL_SHAPES[architecture])
    torch.manual_seed(3)
    model = HybridLM(config)
    perturb_vectors(model, seed=4)
    with pytest.raises(ValueError, match="architecture="):
        save_hf(model, tmp_path)
    save_hf(model, tmp_path, architecture=architecture)

    reloaded = load_hf(tmp_path)
    assert hf_io.config_differences(config, reloaded.config) == []
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    exported = load_transformers(tmp_path)
    assert type(exported).__name__ == architecture
    ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert relative_error(model(ids), hf_logits(exported, ids)) < 1e-5


def test_sharded_checkpoints_both_ways(tmp_path):
    torch.manual_seed(6)
    hf_model = AutoModelForCausalLM.from_config(tiny_hf_config(BAMBA), attn_implementation="eager").eval()
    perturb_vectors(hf_model, seed=7)
    hf_model.save_pretrained(tmp_path / "theirs", max_shard_size="20KB")
    assert (tmp_path / "theirs" / hf_io.INDEX_FILE).is_file()
    model = load_hf(tmp_path / "theirs")

    save_hf(model, tmp_path / "ours", max_shard_bytes=20_000)
    shards = sorted(p.name for p in (tmp_path / "ours").glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (tmp_path / "ours" / hf_io.WEIGHTS_FILE).exists()
    assert_same_tensors(tmp_path / "theirs", tmp_path / "ours")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(hf_logits(load_transformers(tmp_path / "ours"), ids), hf_logits(hf_model, ids), rtol=0, atol=0)

    save_hf(model, tmp_path / "ours")  # one file again: the stale shards and index are removed
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["config.json", "model.safetensors"]

    save_hf(model, tmp_path / "broken", max_shard_bytes=20_000)
    (tmp_path / "broken" / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        load_hf(tmp_path / "broken")


def test_nemotron_h_model_prefix_and_legacy_config(tmp_path):
    """NemotronH weights may be stored as ``model.*``; old configs use a pattern string and mamba_* names."""
    checkpoint = build_checkpoint(NEMOTRON_H, tmp_path / "original")
    tensors = load_file(checkpoint.path / "model.safetensors")
    save_file({name.replace("backbone.", "model.", 1): t for name, t in tensors.items()}, tmp_path / "model.safetensors")
    config = hf_io.read_hf_config(checkpoint.path)
    layers = config.pop("layers_block_type")
    config["hybrid_override_pattern"] = "".join({"linear_attention": "M", "full_attention": "*", "mlp": "-"}[k] for k in layers)
    config["mamba_n_groups"] = config.pop("n_groups")
    (tmp_path / "config.json").write_text(json.dumps(hf_io._encode_floats(config)))
    model = load_hf(tmp_path)
    with torch.no_grad():
        assert relative_error(model(checkpoint.ids), checkpoint.logits) < 1e-5
    save_hf(model, tmp_path / "out")
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == sorted(load_file(tmp_path / "model.safetensors"))
    assert hf_logits(load_transformers(tmp_path / "out"), checkpoint.ids).equal(checkpoint.logits)


# ----------------------------------------------------------------------------- bad input


def test_missing_files(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path / "absent")
    (tmp_path / "config.json").write_text((checkpoint.path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf(tmp_path)


def test_weights_that_do_not_fit_the_config(checkpoint, tmp_path):
    tensors = load_file(checkpoint.path / "model.safetensors")
    dropped = sorted(tensors)[-1]
    save_file({k: v for k, v in tensors.items() if k != dropped}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((checkpoint.path / "config.json").read_text())
    with pytest.raises(ValueError, match=dropped.replace(".", r"\.")):
        load_hf(tmp_path)
    save_file(tensors, tmp_path / "model.safetensors")
    config = hf_io.read_hf_config(checkpoint.path)
    config["vocab_size"] = VOCAB + 1
    (tmp_path / "config.json").write_text(json.dumps(hf_io._encode_floats(config)))
    with pytest.raises(ValueError, match=r"shape \(64, 32\)"):
        load_hf(tmp_path)


BASE = {"vocab_size": VOCAB, "hidden_size": 32}


@pytest.mark.parametrize(
    ("hf_config", "message"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "unsupported architecture.*LlamaForCausalLM"),
        ({"model_type": "jamba"}, "unsupported architecture.*jamba"),
        ({"architectures": [NEMOTRON_H], "layers_block_type": ["linear_attention", "moe"]}, "layers_block_type='moe'"),
        ({"architectures": [NEMOTRON_H], "hybrid_override_pattern": "M*E"}, "hybrid_override_pattern='E'"),
        ({"architectures": [NEMOTRON_H], "hybrid_override_pattern": "M*-", "mamba_hidden_act": "gelu"}, "mamba_hidden_act='gelu'"),
        ({"architectures": [NEMOTRON_H], "hybrid_override_pattern": "M-", "mlp_hidden_act": "gelu"}, "mlp_hidden_act='gelu'"),
        ({"architectures": [NEMOTRON_H], "hybrid_override_pattern": "M*", "num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1"),
        ({"architectures": [NEMOTRON_H], "hybrid_override_pattern": "M*", "hidden_dropout": 0.1}, "hidden_dropout=0.1"),
        ({"architectures": [MAMBA2], "num_heads": 8, "head_dim": 8, "hidden_act": "relu"}, "hidden_act='relu'"),
        ({"architectures": [MAMBA2], "num_heads": 8, "head_dim": 4, "expand": 2}, "expand=2"),
        ({"architectures": [BAMBA], "mamba_n_heads": 8, "num_attention_heads": 4,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type='llama3'"),
        ({"architectures": [BAMBA], "mamba_n_heads": 8, "num_attention_heads": 4, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unrepresentable_configs_are_rejected(hf_config, message):
    with pytest.raises(ValueError, match=message):
        hf_io.config_from_hf({**BASE, **hf_config})


def test_unsupported_architecture_in_a_directory(checkpoint, tmp_path):
    config = hf_io.read_hf_config(checkpoint.path)
    config["architectures"] = ["FalconH1ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(hf_io._encode_floats(config)))
    with pytest.raises(ValueError, match="FalconH1ForCausalLM"):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    ("architecture", "fields", "message"),
    [
        (MAMBA2, dict(pattern="M*-"), "pattern='M\\*-'"),
        (BAMBA, dict(pattern="M*-"), "'M-' and '\\*-' pairs"),
        (BAMBA, dict(pattern="M-", mlp_gated=False, mlp_activation="silu"), "mlp_gated=False"),
        (BAMBA, dict(pattern="M-", mlp_gated=True), "mlp_activation='relu2'"),
        (NEMOTRON_H, dict(pattern="M*-"), "rotary_fraction=1.0"),
        (NEMOTRON_H, dict(pattern="M-", rotary_fraction=0.0, time_step_limit=(0.0, 5.0)), "time_step_limit"),
        (NEMOTRON_H, dict(pattern="M-", mlp_activation="silu", mlp_gated=True), "mlp_gated=True"),
        (MAMBA2, dict(pattern="M", hidden_size=48), "whole multiple of hidden_size=48"),
        ("LlamaForCausalLM", dict(pattern="M"), "unsupported architecture"),
    ],
)
def test_unrepresentable_exports_are_rejected(architecture, fields, message, tmp_path):
    model = HybridLM(HybridConfig(**{"vocab_size": VOCAB, "hidden_size": 32, **fields}))
    with pytest.raises(ValueError, match=message):
        save_hf(model, tmp_path, architecture=architecture)
    assert not (tmp_path / "config.json").exists()


def test_save_rejects_bad_arguments_before_writing(checkpoint, tmp_path):
    model = load_hf(checkpoint.path)
    with pytest.raises(ValueError, match="max_shard_bytes=0"):
        save_hf(model, tmp_path, max_shard_bytes=0)
    model.hf_config = {**model.hf_config, "vocab_size": VOCAB + 1}
    with pytest.raises(ValueError, match="vocab_size=64 becomes 65"):
        save_hf(model, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("backend", ["hybrid", "transformers"])
def test_a_config_that_ties_a_head_the_weights_hold_apart_loads_untied_and_exports_so(tmp_path, backend):
    """config.json with ``tie_word_embeddings: true`` beside an ``lm_head.weight`` unlike the embeddings (a flag
    edited, or a head trained untied): transformers loads the two untied. HybridLM tied them, dropping the stored
    head, and the transformers export's ``tie_weights()`` did the same; both now keep it, say so once, and export
    ``tie_word_embeddings: false`` with the head."""
    import warnings

    from transformers import LlamaConfig

    from hybridpar.models.hf.causal_lm import export_causal_lm, load_causal_lm

    torch.manual_seed(0)
    source = tmp_path / "source"
    if backend == "hybrid":
        untied = dict(tiny_hf_config(MAMBA2).to_dict(), tie_word_embeddings=False)
        AutoModelForCausalLM.from_config(Mamba2Config(**untied)).save_pretrained(source)
    else:
        AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)).save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    stored = load_file(source / "model.safetensors")
    embedding = next(name for name in stored if "emb" in name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_causal_lm(source, backend=backend)
    notes = [str(w.message) for w in caught if "sets tie_word_embeddings=true, but the checkpoint holds an lm_head" in str(w.message)]
    assert len(notes) == 1, [str(w.message) for w in caught]
    assert type(model).__name__ == ("HybridLM" if backend == "hybrid" else "LlamaForCausalLM")
    head, embeddings = (model.lm_head, model.backbone.embeddings) if backend == "hybrid" else \
        (model.get_output_embeddings(), model.get_input_embeddings())
    assert torch.equal(head.weight, stored["lm_head.weight"]) and torch.equal(embeddings.weight, stored[embedding])
    export_causal_lm(model, tmp_path / "export", state_dict=dict(model.state_dict()))
    written = load_file(tmp_path / "export" / "model.safetensors")
    assert torch.equal(written["lm_head.weight"], stored["lm_head.weight"]) and torch.equal(written[embedding], stored[embedding])
    assert json.loads((tmp_path / "export" / "config.json").read_text())["tie_word_embeddings"] is False


def test_an_index_unlike_its_shards_or_beside_one_file_is_named(tmp_path):
    """A sharded checkpoint's index that lists a tensor under a shard that does not hold it loaded it as missing
    ("check config.json against the weights"); one that lists a tensor no shard holds, or misses one a shard holds,
    and a folder with both ``model.safetensors`` and a sharded index (transformers loads the one file), said nothing."""
    import shutil
    import warnings

    from transformers import LlamaConfig

    from hybridpar.models.hf.weights import weight_files

    source = tmp_path / "sharded"
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(source, max_shard_size="8KB")
    index_file = source / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = list(index["weight_map"].values())
    names = sorted(index["weight_map"], key=lambda n: -shards.count(index["weight_map"][n]))  # first: in a shared shard
    other = next(n for n in names if index["weight_map"][n] != index["weight_map"][names[0]])

    def said(edit=None, single=False):
        case = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        shutil.copytree(source, case)
        if edit:
            (case / index_file.name).write_text(json.dumps({**index, "weight_map": edit(dict(index["weight_map"]))}))
        if single:
            save_file({"model.embed_tokens.weight": torch.zeros(VOCAB, 32)}, case / "model.safetensors")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            files = weight_files(case, "model.safetensors", "model.safetensors.index.json")
        return [f.name for f in files], [str(w.message) for w in caught]

    files, notes = said()
    assert len(files) > 2 and notes == []
    with pytest.raises(ValueError, match=f"lists the tensor '{names[0]}' in {index['weight_map'][other]}, but "
                                         f"{index['weight_map'][names[0]]} holds it"):
        said(lambda m: {**m, names[0]: m[other]})
    _, notes = said(lambda m: {**{k: v for k, v in m.items() if k != names[0]}, "model.extra.weight": m[names[0]]})
    assert len(notes) == 1 and "lists 1 tensor(s) no shard holds (['model.extra.weight'])" in notes[0] and \
        f"does not list 1 tensor(s) the shards hold (['{names[0]}']: transformers skips them)" in notes[0], notes
    files, notes = said(single=True)
    assert files == ["model.safetensors"] and len(notes) == 1 and "holds both model.safetensors and a sharded" in notes[0]
