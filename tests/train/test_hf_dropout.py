"""The dropout of a transformers checkpoint at every layout (float64, real gloo ranks).

Phi with ``resid_pdrop = embd_pdrop = 0.1``: its hidden-state dropouts are keyed by token
(``models/token_dropout.py``), so ``hybridpar check`` (which runs both sides in train mode, as
training does) is exact at cp=2, tp=2 + SP and dp_shard=2; before, check ran transformers models
in eval mode (dropout off) and training drew each rank's masks from its own generator. GPT-2's
attention-probability dropout (``attn_pdrop``) cannot be keyed: ``check`` on more than one process
refuses it and ``train`` says so, naming the field to zero. OPT's dropout is functional (no module
to key): a probe (two train-mode forwards, one set of keys, two generator seeds) finds it.
"""

import contextlib
import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from hybridpar.config import ConfigError, load_config
from tests.distributed.harness import run_ranks

DEFAULT = "configs/tiny-hybrid.yaml"
JOB = ["model.dtype=float64", "data.pack_size=128", "data.packs_per_step=2", "train.eval_every=0", "plot=false",
       "tensorboard=false", "data.task_options={min_len: 32, max_len: 64, num_kv_pairs: [2, 4]}", "output_dir=unused"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import transformers as hf

    root = tmp_path_factory.mktemp("hf_dropout")
    shapes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=256, num_hidden_layers=2)
    torch.manual_seed(0)
    hf.PhiForCausalLM(hf.PhiConfig(**shapes, resid_pdrop=0.1, embd_pdrop=0.1)).save_pretrained(root / "phi")
    hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=256, n_positions=256)).save_pretrained(
        root / "gpt2")  # resid, embd and attn pdrop 0.1
    hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=256, n_positions=256, attn_pdrop=0.0)
                       ).save_pretrained(root / "gpt2_hidden")  # resid and embd pdrop 0.1 only
    hf.OPTForCausalLM(hf.OPTConfig(hidden_size=32, ffn_dim=64, num_attention_heads=4, vocab_size=256, num_hidden_layers=2,
                                   word_embed_proj_dim=32, max_position_embeddings=256, dropout=0.1)).save_pretrained(
        root / "opt")  # functional dropout (F.dropout(p=config.dropout)): no module to key
    return {name: str(root / name) for name in ("phi", "gpt2", "gpt2_hidden", "opt")}


def _check(rank, world_size, overrides):
    import hybridpar.models.token_dropout as token_dropout
    from hybridpar.train.proof.layout import run_check

    masks, keep_mask = [], token_dropout.keep_mask
    token_dropout.keep_mask = lambda *args, **kwargs: masks.append(1) or keep_mask(*args, **kwargs)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run_check(load_config(DEFAULT, JOB + overrides), torch.device("cpu"))
    return code, out.getvalue(), len(masks)


@pytest.mark.parametrize("layout", [
    ["parallel.cp=2", "parallel.tp=1", "parallel.cp_attention=ring"],
    ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true"],
    ["parallel.cp=1", "parallel.tp=1", "parallel.dp_shard=2"],
], ids=["cp2", "tp2-sp", "dp2"])
def test_a_checkpoints_hidden_dropout_is_one_process_s_at_every_layout(checkpoints, layout):
    code, text, masks = run_ranks(2, _check, [f"model.hf_path={checkpoints['phi']}", *layout], timeout_s=300)[0]
    assert code == 0 and "check exact" in text, text[-1500:]
    assert masks >= 2 * 5, masks  # dropout ran (train mode) on both sides: embedding + 2 per layer, each


def test_gpt2_blocks_shard_and_checkpoint_by_no_split_modules_with_keyed_dropout(checkpoints):
    """GPT-2 keeps its blocks in ``transformer.h``: FSDP shards them one by one and activation
    checkpointing wraps them (``find_blocks``: ``_no_split_modules``; before, one root unit whose
    gradients were never reduced, and checkpointing refused), and the recompute draws the same masks."""
    code, text, masks = run_ranks(2, _check, [f"model.hf_path={checkpoints['gpt2_hidden']}", "parallel.cp=1",
                                              "parallel.tp=1", "parallel.dp_shard=2",
                                              "parallel.activation_checkpointing=full"], timeout_s=300)[0]
    assert code == 0 and "check exact" in text and masks > 0, text[-1500:]


def test_attention_dropout_is_refused_by_check_and_named_by_train(checkpoints, capsys):
    from hybridpar.train.preflight import validate_run

    config = load_config(DEFAULT, JOB + [f"model.hf_path={checkpoints['gpt2']}", "parallel.cp=1", "parallel.tp=1",
                                         "parallel.dp_shard=2"])
    with pytest.raises(ConfigError, match=r"check cannot prove this layout: GPT2 applies attention dropout "
                                          r"\(attn_pdrop=0\.1\).*set \"attn_pdrop\": 0\.0 in .*config\.json"):
        validate_run(config, "check", world_size=2, dry_run=True)
    one = load_config(DEFAULT, JOB + [f"model.hf_path={checkpoints['gpt2']}", "parallel.cp=1", "parallel.tp=1"])
    validate_run(one, "check", world_size=1, dry_run=True)  # one process: its own masks are the reference's
    assert "attention dropout" not in capsys.readouterr().err
    from hybridpar.train.hf_model import randomness_problem
    from hybridpar.train.trainer import build_model

    said = randomness_problem(config, build_model(config), 256, processes=2)  # what the trainer prints at start
    assert said.startswith("GPT2 applies attention dropout (attn_pdrop=0.1)"), said
    assert randomness_problem(config, build_model(config), 256, processes=1) is None


def test_random_numbers_no_key_reaches_are_found_by_the_probe(checkpoints):
    """OPT draws ``F.dropout(p=config.dropout)`` from the generator: check at dp_shard=2 refuses with the
    field named (before any step), where it would have failed as if the layout were wrong."""
    from tests.distributed.harness import RankFailure

    with pytest.raises(RankFailure, match=r"check cannot prove this layout: OPTForCausalLM draws random numbers "
                                          r"in training that no token key reaches \(dropout=0\.1"):
        run_ranks(2, _check, [f"model.hf_path={checkpoints['opt']}", "parallel.cp=1", "parallel.tp=1",
                              "parallel.dp_shard=2"], timeout_s=300)
    from hybridpar.train.hf_model import unkeyed_randomness
    from hybridpar.train.trainer import build_model

    phi = build_model(load_config(DEFAULT, JOB + [f"model.hf_path={checkpoints['phi']}"]))
    assert not unkeyed_randomness(phi, 256)  # every dropout of Phi is keyed


@pytest.mark.parametrize("fields, said", [
    ({"hidden_dropout": 0.0, "attention_dropout": 0.0, "classifier_dropout": 0.3}, None),
    ({"hidden_dropout": 0.1, "attention_dropout": 0.0}, "hidden_dropout=0.1"),
    ({"text_config": {"resid_pdrop": 0.2}, "router_jitter_noise": 0.01}, "text_config.resid_pdrop=0.2, router_jitter_noise=0.01"),
    (None, "any dropout of"),
])
def test_a_resume_with_another_seed_is_said_only_where_the_checkpoint_draws_random_numbers(tmp_path, fields, said):
    """A transformers checkpoint resumed with another ``train.seed`` draws other dropout masks where its config.json
    has dropout (or router jitter) above 0: said with the fields. Every hf_path was said, though most fine-tuned
    configs have none (it said "where the model or its adapters have dropout")."""
    import dataclasses
    import json

    from hybridpar.config import to_dict
    from hybridpar.train.run.numerics import numeric_changes

    (tmp_path / "config.json").write_text("{not json" if fields is None else json.dumps({"model_type": "llama", **fields}))
    recorded = load_config(None, ["train.seed=0"])
    info = {"config": json.loads(json.dumps(to_dict(recorded)))}
    config = load_config(None, ["train.seed=5"])
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, hf_path=str(tmp_path)))
    notes = numeric_changes("ckpt", info, config)
    if said is None:
        assert notes == [], notes
    else:
        [note] = notes
        assert f"resuming with 5 draws other dropout masks from the next step on ({said}" in note, note
