"""Round 20 of fault hunting (docs/reliability.md, "Round 20"): the Python API called as a library user calls it, and
the transformers hybrids (Granite 4.0-H, Nemotron-H, Falcon-H1, Zamba2, Bamba) through every verb."""

from __future__ import annotations

import pytest
import torch

from tests.train.fault_probes import one_line


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny float64 transformers hybrids saved with ``save_pretrained`` (vocabulary 97), by name."""
    from tests.models.hf.hybrid_models import build_hybrid

    folder = tmp_path_factory.mktemp("hybrids")

    def save(name: str):
        path = folder / name
        if not path.exists():
            build_hybrid(name).save_pretrained(path)
        return path
    return save


@pytest.mark.parametrize("name", ["granite_moe", "nemotron_h_moe"])
def test_a_float64_moe_checkpoint_loads_to_run_on_the_cpu(saved, name):
    """Before: ``load_causal_lm`` (and so ``generate --hf-path``) of a float64 Granite 4.0-H MoE or Nemotron-H MoE kept
    transformers' ``torch._grouped_mm`` experts, which take no float64: "Expected mat_a to be Float32, BFloat16 or
    Float16 matrix, got Double", a traceback at the first forward (the trainer alone switched to eager experts)."""
    from hybridpar.models.hf.causal_lm import load_causal_lm

    model = load_causal_lm(saved(name))
    assert model.dtype == torch.float64
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 97) and torch.isfinite(logits).all()


def _tiny_model(seed: int = 0):
    from hybridpar import HybridConfig, HybridLM

    torch.manual_seed(seed)
    return HybridLM(HybridConfig.from_preset("tiny"))


def test_a_refused_canonical_state_leaves_the_model_as_it_was():
    """Before: ``load_canonical_state_dict`` copied each tensor as it went, so a state refused for a missing key (strict)
    or a wrong shape left the model half loaded; a numpy array was "'numpy.ndarray' object has no attribute 'to'", and
    a state of another model listed every name (one line of thousands of characters)."""
    from hybridpar import canonical_state_dict, load_canonical_state_dict

    model, other = _tiny_model(0), canonical_state_dict(_tiny_model(1))
    before = {name: value.clone() for name, value in canonical_state_dict(model).items()}
    last = list(other)[-1]
    for state, said in [({**other, last: other[last][:1]}, "state tensor has shape"),
                        ({k: v for k, v in other.items() if k != last}, f"missing 1 ['{last}']"),
                        ({**other, "x": torch.zeros(1)}, "unexpected 1 ['x']"),
                        ({**other, last: other[last].numpy()}, "is a ndarray, not a torch.Tensor"),
                        ({f"other.{k}": v for k, v in other.items()}, "...")]:
        with pytest.raises(ValueError) as error:
            load_canonical_state_dict(model, state)
        assert said in one_line(error) and len(str(error.value)) < 400, str(error.value)
        assert all(torch.equal(before[k], v) for k, v in canonical_state_dict(model).items())
    load_canonical_state_dict(model, other)
    assert all(torch.equal(other[k], v) for k, v in canonical_state_dict(model).items())


def test_a_value_that_is_not_a_model_or_a_device_is_one_line():
    """Before: ``parallelize("ckpt/", dims)`` was "'str' object has no attribute 'named_modules'" and
    ``make_plan(run, device="h100")`` "'str' object has no attribute 'bf16_tflops'"."""
    import hybridpar as hp

    with pytest.raises(ValueError) as error:
        hp.parallelize("ckpt/", hp.ParallelDims())
    assert "parallelize takes the model (an nn.Module), got str" in one_line(error)
    run = hp.load_config(None, ["model.preset=tiny", "parallel.cp=1"])
    with pytest.raises(ValueError) as error:
        hp.make_plan(run, 1, device="h100")
    assert "device='h100' is not a DeviceFigures" in one_line(error)
