"""Nemotron-H's squared ReLUs (dense MLPs and MoE experts) run as products: the swap leaves the
logits bitwise unchanged in float64 (``tests/models/test_blocks.py`` holds the product off ``pow``,
float32 under CUDA's autocast), and ``install_cores`` (what training and ``check`` run) makes it."""

import pytest
import torch

from hybridpar.models.hf.activations import ProductReLUSquared, use_product_relu2
from hybridpar.train.hf_model import install_cores
from tests.models.hf.hybrid_models import build_hybrid


@pytest.mark.parametrize("name", ["nemotron_h", "nemotron_h_moe"])
def test_squared_relus_become_products_with_the_same_logits(name):
    from transformers.activations import ReLUSquaredActivation

    model = build_hybrid(name).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    relus = sum(type(m) is ReLUSquaredActivation for m in model.modules())
    assert relus and use_product_relu2(model) == relus
    assert sum(type(m) is ProductReLUSquared for m in model.modules()) == relus
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(after, before)
    fresh = install_cores(build_hybrid(name))
    assert not any(type(m) is ReLUSquaredActivation for m in fresh.modules())
