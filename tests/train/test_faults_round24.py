"""Round 24 of fault hunting (docs/reliability.md, "Round 24"): a whole run equals one process's, across time.

``hybridpar check`` proves one step; these hold whole runs (float64, several steps, evaluation, checkpoints,
gradient accumulation over packs of very different labelled-token counts, clipping and weight decay) against one
process, and a run stopped and resumed (at another layout too) against the uninterrupted one. Real gloo process
groups (``run_each``); the final weights and AdamW moments are read back from the checkpoints. And the one setting a
resume changed without a word: ``parallel.tf32`` on a float32 CUDA run."""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil

import pytest
import torch

from tests.distributed.harness import run_each

WORDS = "the cat sat on a mat while dogs ran far away into green fields and blue skies over hills".split()
RUN = ["model.preset=tiny", "model.dtype=float64", "model.overrides={vocab_size: 320}", "data.task=chat",
       "data.pack_size=32", "data.packs_per_step=4", "data.pad_to_multiple_of=4", "train.steps=3", "train.warmup_steps=1",
       "train.grad_clip=0.5", "train.weight_decay=0.1", "train.eval_every=2", "train.eval_packs=4",
       "checkpoint.every=2", "checkpoint.keep=3", "tensorboard=false", "plot=false"]
LOGGED = ("loss", "grad_norm", "lr", "eval_loss", "eval_accuracy", "unigram_loss")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A chat file whose prompts (masked) run from 1 to 60 words and replies from 1 to 30, so the step's packs hold
    very different labelled-token counts (some none), and a BPE tokenizer trained on it."""
    from hybridpar.data.tokenizers import train_bpe_tokenizer

    root, rng = tmp_path_factory.mktemp("chat"), random.Random(1)
    rows = [[" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60 if i % 3 == 0 else 20))),
             " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30 if i % 2 else 3)))] for i in range(60)]
    with open(root / "chat.jsonl", "w") as handle:
        for user, reply in rows:
            handle.write(json.dumps({"messages": [{"role": "user", "content": user},
                                                  {"role": "assistant", "content": reply}]}) + "\n")
    train_bpe_tokenizer([text for row in rows for text in row], root / "tok", vocab_size=320)
    return [f"data.path={root / 'chat.jsonl'}", f"data.tokenizer={root / 'tok'}"]


def _train(rank, world_size, overrides, directory, stop_after=None):
    """``Trainer.fit`` of ``RUN + overrides`` in ``directory``; rank 0 returns the metrics history."""
    from hybridpar.config import load_config
    from hybridpar.train.trainer import Trainer

    with contextlib.redirect_stdout(io.StringIO()):
        history = Trainer(load_config(None, [*RUN, *overrides, f"output_dir={directory}"]), torch.device("cpu")).fit(stop_after)
    return [{k: r[k] for k in LOGGED if k in r} | {"step": r["step"]} for r in history] if rank == 0 else None


def _final_state(directory) -> dict:
    """The newest checkpoint of ``directory`` as one process's dict: weights, AdamW moments and steps, param groups."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    newest = sorted((directory / "checkpoints").glob("step_*"))[-1]
    dcp_to_torch_save(newest, directory / "state.pt")
    return torch.load(directory / "state.pt", weights_only=False)


def _same_state(reference: dict, state: dict, where: str = "") -> None:
    if isinstance(reference, dict):
        assert sorted(reference) == sorted(state), where
        for key in reference:
            _same_state(reference[key], state[key], f"{where}.{key}")
    elif isinstance(reference, (list, tuple)):
        assert len(reference) == len(state), where
        for index, (a, b) in enumerate(zip(reference, state)):
            _same_state(a, b, f"{where}.{index}")
    elif isinstance(reference, torch.Tensor):
        torch.testing.assert_close(state, reference, rtol=1e-9, atol=1e-12, msg=where)
    else:
        assert reference == state, where


def _same_history(reference: list[dict], history: list[dict], label: str) -> None:
    assert [r["step"] for r in history] == [r["step"] for r in reference], label
    for ref, got in zip(reference, history):
        assert ref.keys() == got.keys(), label
        for key in ref:
            assert got[key] == pytest.approx(ref[key], rel=1e-10, abs=1e-12), f"{label}: step {ref['step']} {key}"


@pytest.fixture(scope="module")
def runs(chat, tmp_path_factory):
    """Two launches: one process's run (checkpoints at steps 2 and 3); then the dp_shard=2 run (each rank accumulates
    two packs) and, in the same 2-rank launch, the one-process run resumed from its step-2 checkpoint at tp=2 + SP."""
    root = tmp_path_factory.mktemp("runs")
    one, dp, tp_resume = (root / name for name in ("one", "dp", "tp-resume"))
    [[reference]] = run_each(1, _train, [(chat, str(one))], timeout_s=300)
    shutil.copytree(one, tp_resume, ignore=shutil.ignore_patterns("step_00000003"))
    [[sharded, _], [tp, _]] = run_each(2, _train, [([*chat, "parallel.dp_shard=2"], str(dp)),
                                                   ([*chat, "parallel.tp=2", "parallel.sequence_parallel=true"],
                                                    str(tp_resume))], timeout_s=300)
    return {name: (history, _final_state(path), [json.loads(line)["step"] for line in open(path / "metrics.jsonl")])
            for name, history, path in (
        ("one", reference, one), ("dp_shard=2", sharded, dp), ("one -> tp=2 + SP", tp, tp_resume))}


def test_a_whole_run_at_dp_shard_2_is_one_processes_run(runs):
    """Three float64 steps of chat SFT (masked prompts: the step's 4 packs hold from 0 to ~30 labelled tokens) with
    evaluation, clipping at every step (``train.grad_clip=0.5``) and weight decay on matrices: at dp_shard=2 every
    logged number (loss, gradient norm, lr, eval loss and accuracy, the unigram baseline) and the final weights,
    AdamW moments and parameter groups (the weight-decay selection, by name) equal one process's."""
    reference, state, _ = runs["one"]
    assert len(reference) == 3 and "eval_loss" in reference[1] and "eval_loss" in reference[2]
    history, sharded, _ = runs["dp_shard=2"]
    _same_history(reference, history, "dp_shard=2")
    _same_state(state, sharded)


def test_a_run_resumed_at_another_layout_continues_the_uninterrupted_run(runs):
    """Stopped after step 2 (its checkpoint kept, step 3's removed) and resumed at tp=2 + SP: step 3 (loss, norm,
    lr, eval) and the final weights and moments equal the uninterrupted run's; metrics.jsonl keeps steps 1-2."""
    reference, state, _ = runs["one"]
    history, resumed, steps = runs["one -> tp=2 + SP"]
    assert steps == [1, 2, 3]
    _same_history(reference[2:], history, "one -> tp=2 + SP")
    _same_state(state, resumed)


@pytest.mark.parametrize("dtype, cuda, said", [("float32", True, True), ("float64", True, False), ("float32", False, False)])
def test_a_resume_that_flips_tf32_on_a_float32_cuda_run_says_so(monkeypatch, dtype, cuda, said):
    """Before: a float32 run on CUDA resumed with ``parallel.tf32`` flipped computed its matmuls at another precision
    (TF32's 10 mantissa bits or float32's 23) without a word, where a changed ``model.dtype`` or
    ``parallel.mixed_precision`` is said. Now one warning, where it applies (float32 on CUDA; float64 never uses TF32)."""
    from hybridpar.config import load_config
    from hybridpar.train.run.numerics import numeric_changes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    config = load_config(None, [f"model.dtype={dtype}", "parallel.tf32=false", "output_dir=unused"])
    recorded = {"config": {"model": {"dtype": dtype}, "parallel": {"tf32": True, "mixed_precision": None}}}
    notes = [note for note in numeric_changes("ckpt/step_00000002", recorded, config) if "tf32" in note]
    assert len(notes) == int(said), notes
    if said:
        assert notes[0].startswith("warning: checkpoint ckpt/step_00000002 was trained with parallel.tf32=true; resuming "
                                   "with false computes float32 matmuls on CUDA in full float32") and "\n" not in notes[0]
