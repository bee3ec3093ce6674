"""A model whose state cannot fit is refused before any weight exists (``check_model_memory``).

``model.overrides={hidden_size: 1048576}`` on the tiny preset (2.2 billion parameters, 33 GiB of
float32 weights, gradients and AdamW moments) passed ``--dry-run`` and started training: the rank
built the model and grew past 20 GiB of this 24 GiB machine before step 1. The floor counts each
parameter once, and what trains three times more (gradient, two moments), at best split over
tp * dp_shard * cp; ``check`` keeps no moments. Measured on meta models: no memory, no time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar.config import ConfigError, load_config
from hybridpar.train.hf_model import meta_model
from hybridpar.train.peft import apply_peft
from hybridpar.train.preflight import check_model_memory, model_config, model_state_floor
from tests.distributed.harness import run_ranks
from tests.train.fault_probes import cli, one_line

DEFAULT = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")
TINY = ["parallel.cp=1", "parallel.tp=1", "data.pack_size=128", "train.eval_every=0", "plot=false", "tensorboard=false"]
HUGE = "model.overrides={hidden_size: 16777216}"  # 58 billion parameters: 870 GiB of state, on any machine


def _model(overrides: list[str]):
    config = load_config(DEFAULT, TINY + overrides)
    return config, apply_peft(config, meta_model(model_config(config)))


def test_the_floor_counts_weights_once_and_what_trains_four_times_over_the_shards():
    config, model = _model([])
    count = sum(p.numel() for p in model.parameters())
    assert model_state_floor(config, model) == 16 * count  # float32: weight, gradient, two moments
    assert model_state_floor(config, model, moments=False) == 8 * count  # check: weight and gradient
    sharded, model = _model(["parallel.dp_shard=2", "parallel.cp=2"])
    assert model_state_floor(sharded, model) == -(-16 * count // 4)
    lora, model = _model(["peft.method=lora"])
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trained < count and model_state_floor(lora, model) == 4 * count + 16 * trained  # base frozen
    double, model = _model(["model.dtype=float64"])
    assert model_state_floor(double, model) == 32 * count


def test_a_model_that_cannot_fit_is_refused_in_one_line_before_it_is_built(tmp_path):
    config, model = _model([HUGE])
    with pytest.raises(ConfigError) as error:
        check_model_memory(config, model, 1)
    message = one_line(error)
    assert "the model's 58,351,162,928 parameters" in message and "weights, gradients and AdamW's two moments" in message, message
    assert "parallel.dp_shard" in message and "peft.method=lora" in message, message
    code, text = cli("train", "--dry-run", "--config", DEFAULT, *TINY, HUGE, f"output_dir={tmp_path}/dry")
    assert code == 2 and "hybridpar: error: the model's 58," in text, text
    code, text = cli("check", "--dry-run", "--config", DEFAULT, *TINY, HUGE, f"output_dir={tmp_path}/check")
    assert code == 2 and "its weights and gradients" not in text and "their weights and gradients in" in text, text
    check_model_memory(*_model([]), 1)  # the tiny model fits


def _trainer_error(rank, world_size, overrides):
    import torch

    from hybridpar.train.trainer import Trainer

    try:
        Trainer(load_config(DEFAULT, TINY + overrides), torch.device("cpu"))
    except ConfigError as error:
        return str(error)
    return None


def test_the_trainer_refuses_it_before_building_the_model(tmp_path):
    """Through the Python API too (no launcher preflight): refused at once, not after allocating it."""
    message = run_ranks(1, _trainer_error, [HUGE, f"output_dir={tmp_path}"], timeout_s=120)[0]
    assert message is not None and message.startswith("the model's 58,") and "weights and gradients" in message
