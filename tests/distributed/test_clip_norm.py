"""Gradient clipping's total norm under FSDP, TP (strided and Partial gradients) and CP equals
the norm of the full, gathered gradients, in float64: each global element counted once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks

DEFAULT = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")
BASE = ["model.preset=tiny", "model.dtype=float64", "data.pack_size=64", "data.packs_per_step=2", "train.eval_every=0",
        "checkpoint.every=-1", "tensorboard=false", "plot=false", "output_dir=unused",
        "data.task_options={min_len: 16, max_len: 32, num_kv_pairs: 2, vocab_size: 16}"]
LAYOUTS = {
    "cp2_tp2_sp": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "dp_shard2_tp2": (4, ["parallel.cp=1", "parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=false"]),
    "tp2_sp_no_fsdp": (2, ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true"]),
}


def _norms(rank: int, world_size: int, overrides: list) -> tuple[float, float]:
    from hybridpar.config import load_config
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.optim import clip_grad_norm
    from hybridpar.train.trainer import Trainer

    trainer = Trainer(load_config(DEFAULT, BASE + overrides), torch.device("cpu"))
    trainer.step_gradients(0)
    full = canonical_state_dict(trainer.model, grads=True)
    expected = torch.stack([g.double().square().sum() for g in full.values()]).sum().sqrt()
    got = clip_grad_norm(trainer.model.parameters(), max_norm=float("inf"))
    return float(got), float(expected)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_clipping_norm_counts_every_gradient_element_once(name):
    world_size, overrides = LAYOUTS[name]
    for got, expected in run_ranks(world_size, _norms, overrides, timeout_s=300):
        assert got == pytest.approx(expected, rel=1e-12), name
