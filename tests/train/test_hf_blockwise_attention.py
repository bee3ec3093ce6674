"""A transformers model at cp=1 trains on hybridpar's blockwise attention, with no [S, S] tensor.

The trainer switches every model ``cp_hf.attention_problem`` accepts to ``"hybridpar"``
attention before parallelizing (``train/hf_model.use_blockwise_attention``), as context
parallelism already does; the loss and every gradient equal transformers' own SDPA attention with
its per-document mask (float64), and no op output has two dims of the pack's length. A model it
does not accept keeps transformers' attention, trains one document per row (``train/packing_rule.py``)
and the trainer's line says why.
"""

import pytest
import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.attention.blockwise import BLOCK_SIZE
from hybridpar.parallel.context.inputs import shard_inputs
from hybridpar.train.hf_model import use_blockwise_attention
from hybridpar.train.trainer import pack_loss_sum
from tests.distributed.tensor.hf_models import VOCAB, build_model
from tests.op_outputs import OpOutputs

SEQ = 2 * BLOCK_SIZE + 88  # over two query blocks; a score block is [B, Hkv, BLOCK_SIZE * G, <= SEQ], G = 2
DOCS = [0, 100, 101, 300, SEQ - 12, SEQ]


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, SEQ))
    labels = torch.roll(ids, -1, 1)
    labels[0, torch.tensor(DOCS[1:]) - 1] = -100  # no label across a document end
    return ids, labels, PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))


def _step(model):
    """``(loss, {name: grad}, [S, S] outputs)`` of the trainer's loss on one pack."""
    ids, labels, packed = _batch()
    model.zero_grad()
    with OpOutputs() as outputs:
        loss, _ = pack_loss_sum(model, shard_inputs(input_ids=ids, labels=labels, packed=packed))
        loss.backward()
    square = [(op, shape) for op, shape in outputs.shapes if sum(size == SEQ for size in shape) >= 2]  # [S, S]
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, square


def _relative(got, want):
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "gemma3", "phi"])
def test_supported_models_train_on_blockwise_attention_equal_to_transformers(name):
    reference, model = build_model(name), build_model(name)
    line = use_blockwise_attention(model)
    assert "blockwise" in line and model.config._attn_implementation == "hybridpar", line
    want_loss, want_grads, want_square = _step(reference)
    got_loss, got_grads, got_square = _step(model)
    assert want_square, "the tracker must see transformers' [S, S] document mask"
    assert got_square == []
    assert _relative(got_loss, want_loss) < 1e-13
    worst = max((_relative(got_grads[n], g), n) for n, g in want_grads.items())
    assert worst[0] < 1e-10, worst
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4, dtype=torch.long))


def test_a_model_hybridpar_cannot_take_keeps_transformers_attention_and_says_why():
    import transformers as hf

    torch.manual_seed(0)  # Bloom: ALiBi lives in transformers' mask, which hybridpar's attention does not build
    model = hf.BloomForCausalLM(hf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB)).double()
    line = use_blockwise_attention(model)
    assert model.config._attn_implementation == "eager"  # Bloom's own: it has no SDPA path
    assert "transformers' 'eager' over rows of one document each" in line and "model_type 'bloom'" in line, line
    loss, grads, _ = _step(model)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
