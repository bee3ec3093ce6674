"""LoRA dropout masks keyed by the token (``models/token_dropout.py``): the hash, the keep rate, and
the property layouts rely on: a token's mask does not depend on which tensor, chunk or feature
shard holds it. (Layout parity itself: ``tests/distributed/test_lora.py`` and ``test_check.py``.)"""

import random

import pytest
import torch
from torch import nn

import hybridpar.models.token_dropout as token_dropout
from hybridpar.models.lora import add_lora
from hybridpar.models.token_dropout import (DropoutTokens, TokenDropout, keep_mask, key_model_dropout, mix32,
                                           mix32_int32_, set_dropout_tokens, token_keys, unkeyed_dropout)


SALTS = (torch.tensor(12345), torch.tensor(678))


def fmix32(h: int) -> int:
    """MurmurHash3's finalizer in Python's unbounded integers (the reference)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_mix32_is_murmur3s_finalizer_without_overflow():
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [random.Random(0).getrandbits(32) for _ in range(200)]
    got = mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [fmix32(v) for v in values]


def test_the_int32_form_gives_the_same_bits_and_the_mask_the_int64_hashs():
    """Per (token, feature) the finalizer runs in int32 (its multiply wraps mod 2**32): the same 32 bits
    as the reference, and the same mask as the int64 hash compared unsigned, at every keep threshold."""
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [random.Random(1).getrandbits(32) for _ in range(2000)]
    bits = torch.tensor([v - 2**32 if v >= 2**31 else v for v in values], dtype=torch.int32)
    assert [v % 2**32 for v in mix32_int32_(bits).tolist()] == [fmix32(v) for v in values]
    keys = token_keys(torch.tensor([0, 7, 2**20]), torch.arange(0, 900, 7))  # [3, 129]
    for p in (0.0, 0.05, 0.5, 0.999):
        f = mix32(torch.arange(5, 5 + 33) ^ SALTS[1])
        flat = keys.reshape(-1)
        t = mix32(mix32(flat & 0xFFFFFFFF) ^ (flat >> 32)) ^ SALTS[0]
        want = (mix32(t[:, None] ^ f[None, :]) >= (round(p * 2**24) << 8)).double() / (1 - p)
        assert torch.equal(keep_mask(keys, 33, 5, p, SALTS, torch.float64), want.view(3, 129, 33))


def test_keep_rate_and_scale():
    keys = token_keys(torch.tensor([0, 1]), torch.arange(1000))  # [2, 1000]
    mask = keep_mask(keys, 64, 0, 0.25, SALTS, torch.float64)  # [2, 1000, 64]
    kept = (mask > 0).double().mean().item()
    assert abs(kept - 0.75) < 4 * (0.25 * 0.75 / mask.numel()) ** 0.5  # 4 sigma of 128K draws
    assert set(mask.unique().tolist()) == {0.0, 1 / 0.75}


def test_a_tokens_mask_does_not_depend_on_what_holds_it(monkeypatch):
    """Shuffled tokens (a zigzag shard), a feature block (a row-parallel shard) and another chunk size
    give the same masks as the whole: the mask is a function of (token key, feature) alone."""
    keys = token_keys(torch.tensor([3]), torch.arange(257))  # [1, 257]
    whole = keep_mask(keys, 40, 0, 0.5, SALTS, torch.float64)  # [1, 257, 40]
    order = torch.randperm(257, generator=torch.Generator().manual_seed(0))
    assert torch.equal(keep_mask(keys[:, order], 40, 0, 0.5, SALTS, torch.float64), whole[:, order])
    assert torch.equal(keep_mask(keys, 15, 20, 0.5, SALTS, torch.float64), whole[..., 20:35])
    monkeypatch.setattr(token_dropout, "CHUNK_ELEMENTS", 100)  # chunks of 2 tokens
    assert torch.equal(keep_mask(keys, 40, 0, 0.5, SALTS, torch.float64), whole)
    other = [keep_mask(keys, 40, 0, 0.5, salts, torch.float64) for salts in (SALTS[::-1], (SALTS[0] + 1, SALTS[1]))]
    assert all((m != whole).float().mean() > 0.3 for m in other)  # another step, adapter or seed: new masks


def test_the_mask_compiles_into_one_graph_with_the_same_bits():
    """On CUDA the hash runs compiled (one fused kernel); here aot_eager proves it traces whole
    (no graph break) and gives the eager bits."""
    keys = token_keys(torch.tensor([1]), torch.arange(100))
    compiled = torch.compile(keep_mask, backend="aot_eager", fullgraph=True, dynamic=True)
    got = compiled(keys, 24, 8, 0.3, SALTS, torch.float32, chunked=False)
    assert torch.equal(got, keep_mask(keys, 24, 8, 0.3, SALTS, torch.float32))


def test_masks_follow_the_keys_the_trainer_sets():
    tokens = DropoutTokens(seed=7)
    dropout = TokenDropout(0.5, "q_proj.lora_dropout", tokens, fix="set peft.dropout=0").train()
    x = torch.ones(1, 33, 8, dtype=torch.float64)
    set_dropout_tokens(nn.Module(), 0, None)  # a model without keyed dropout: no-op
    holder = nn.Module()
    holder.dropout_tokens = tokens
    set_dropout_tokens(holder, 4, token_keys(torch.tensor([0]), torch.arange(33)))
    first = dropout(x)
    assert torch.equal(dropout(x), first)  # keyed: a recompute draws the same masks
    set_dropout_tokens(holder, 5, tokens.keys)
    assert not torch.equal(dropout(x), first)  # the next step: new masks
    assert not torch.equal(TokenDropout(0.5, "k_proj.lora_dropout", tokens).train()(x), dropout(x))  # its own masks
    tokens.keys = token_keys(torch.tensor([0]), torch.arange(32))
    with pytest.raises(ValueError, match=r"dropout q_proj\.lora_dropout \(p=0\.5\) sees an input of \(1, 33\) tokens.*set peft\.dropout=0\."):
        dropout(x)
    tokens.keys = None  # outside the trainer: a salt from the default generator, fresh every call
    torch.manual_seed(0)
    a = dropout(x)
    torch.manual_seed(0)
    assert torch.equal(dropout(x), a) and not torch.equal(dropout(x), a)
    assert torch.equal(dropout.eval()(x), x)


def test_add_lora_keys_every_adapter_of_a_model_by_one_holder():
    model = nn.Sequential()
    model.q_proj, model.v_proj = nn.Linear(4, 4), nn.Linear(4, 4)
    add_lora(model, r=2, dropout=0.1, seed=5)
    layers = [model.q_proj.lora_dropout, model.v_proj.lora_dropout]
    assert [d.name for d in layers] == ["q_proj.lora_dropout", "v_proj.lora_dropout"]
    assert layers[0].module_hash != layers[1].module_hash and all(d.tokens is model.dropout_tokens for d in layers)
    assert model.dropout_tokens.seed == 5
    set_dropout_tokens(model, 3, token_keys(torch.tensor([1]), torch.arange(2)))
    assert layers[0].tokens.step == 3 and layers[1].tokens.keys.shape == (1, 2)


def test_a_checkpoints_hidden_dropout_is_keyed_and_its_attention_dropout_named():
    """GPT-2's embedding, residual and MLP dropouts (one row per token) become ``TokenDropout``s
    sharing the model's keys; its attention-probability dropout stays and is named by its field."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=16, n_head=2, n_layer=1, vocab_size=31, n_positions=32)  # every pdrop 0.1
    model = GPT2LMHeadModel(config)
    keyed = key_model_dropout(model, seed=3)
    assert keyed == ["transformer.drop", "transformer.h.0.attn.resid_dropout", "transformer.h.0.mlp.dropout"]
    assert type(model.transformer.h[0].attn.attn_dropout) is nn.Dropout
    assert all(model.get_submodule(n).tokens is model.dropout_tokens for n in keyed)
    assert unkeyed_dropout(config) == {"attn_pdrop": 0.1}
    ids = torch.randint(0, 31, (1, 12))
    model.train()
    set_dropout_tokens(model, 0, token_keys(torch.tensor([0]), torch.arange(12)))
    config.attn_pdrop = 0.0
    model.transformer.h[0].attn.attn_dropout.p = 0.0
    first = model(ids).logits
    assert torch.equal(model(ids).logits, first)  # every remaining dropout is keyed: the same masks again
    assert not torch.equal(model.eval()(ids).logits, first)


def test_blocks_of_one_kind_share_a_compiled_graph_across_steps():
    """The module's own hash is a buffer and the step's salt a tensor: four blocks over three steps
    compile once (an int attribute per module, or ``int()`` on a tensor, gave a graph per block)."""
    import torch._dynamo

    tokens = DropoutTokens(seed=1)
    holder = nn.Module()
    holder.dropout_tokens = tokens

    class Block(nn.Module):
        def __init__(self, index):
            super().__init__()
            self.linear, self.drop = nn.Linear(8, 8), TokenDropout(0.2, f"blocks.{index}.drop", tokens)

        def forward(self, x):
            return self.drop(self.linear(x))

    blocks = [Block(i) for i in range(4)]
    for block in blocks:
        block.compile(backend="eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for step in range(3):
        set_dropout_tokens(holder, step, token_keys(torch.tensor([0]), torch.arange(16)))
        y = torch.randn(1, 16, 8)
        for block in blocks:
            y = block(y)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
