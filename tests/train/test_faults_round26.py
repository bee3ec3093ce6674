"""Round 26 of fault hunting (docs/reliability.md, "Round 26"): memory in sequence length, on every path and
family. Peaks of live tensor bytes (``TensorPeak``) of the trainer's loss at two pack sizes, tiny float32 models
saved with ``save_pretrained`` and loaded as the trainer loads them (``benchmarks/memory_growth.py`` sweeps more)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from tests.train.fault_probes import cli, refusal_line, saved_checkpoints

VOCAB = 97
_C = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
          num_hidden_layers=2, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _builders(hf) -> dict:
    return {
        "bloom": lambda: hf.BloomForCausalLM(hf.BloomConfig(hidden_size=32, n_layer=2, n_head=2, vocab_size=VOCAB)),
        "llama_attention_dropout": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(attention_dropout=0.1, **_C)),
        "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**_C)),
        # a head bias: the loss runs through the [tokens, vocabulary] logits
        "gptj": lambda: hf.GPTJForCausalLM(hf.GPTJConfig(n_embd=32, n_layer=1, n_head=2, rotary_dim=8, vocab_size=50000,
                                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A family's tiny float32 checkpoint folder, by name."""
    import transformers as hf

    builders = _builders(hf)

    def make(name: str):
        torch.manual_seed(0)
        return builders[name]()
    return saved_checkpoints(tmp_path_factory, make)


def _trainers_model(path, pack_size: int):
    from hybridpar.config import load_config
    from hybridpar.train.trainer import build_model

    config = load_config(None, [f"model.hf_path={path}", "model.dtype=float32", f"data.pack_size={pack_size}"])
    with contextlib.redirect_stdout(io.StringIO()):
        return build_model(config), config


def _step_peak(model, tokens: int) -> int:
    """Peak live tensor bytes of one forward + backward of the trainer's loss on one document of ``tokens``
    (a row of its own, as the trainer lays out a model that trains one document per row)."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.train.tensor_peak import TensorPeak
    from hybridpar.train.trainer import pack_loss_sum

    ids = torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    labels[0, -1] = -100
    sharded = shard_inputs(input_ids=ids, labels=labels,
                           packed=PackedSeqParams.from_cu_seqlens(torch.tensor([0, tokens], dtype=torch.int32)))
    with TensorPeak() as peak:
        loss, _ = pack_loss_sum(model.train(), sharded)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return peak.bytes


@pytest.mark.parametrize("name", ["bloom", "llama_attention_dropout"])
def test_transformers_own_attention_grows_as_the_square_and_the_run_says_and_prices_it(saved, name):
    """Before: a model on transformers' own attention (Bloom's eager ALiBi; a Llama with attention dropout, which
    SDPA runs on its math path) trained one document per row with each layer's [S, S] probabilities kept, a step's
    peak growing 3.4x per doubled pack, while the trainer's line, the preflight's pack floor and ``plan`` (a
    Llama's linear twin) all said or assumed linear. Now the line says so, the floor and the plan price the
    [S, S] tensors (``own_attention_bytes``), and that figure stays below the measured peak."""
    from hybridpar.config import load_config
    from hybridpar.parallel.context.hf_own_memory import own_attention_bytes
    from hybridpar.plan import TransformersPlan, make_plan
    from hybridpar.train.hf_model import use_blockwise_attention
    from hybridpar.train.preflight import pack_memory_floor

    path, short, long = saved(name), 512, 1024
    peaks, floors = [], []
    for tokens in (short, long):
        model, config = _trainers_model(path, tokens)
        line = use_blockwise_attention(model)
        peaks.append(_step_peak(model, tokens))
        floors.append(own_attention_bytes(model, tokens, 4))
        assert pack_memory_floor(config, model.config, model) >= floors[-1] > 0
    assert peaks[1] / peaks[0] > 3.0, peaks  # the path is quadratic: transformers' necessity here
    assert floors[1] == 4 * floors[0] and all(f <= p for f, p in zip(floors, peaks)), (floors, peaks)
    assert "square of data.pack_size" in line, line
    plan = make_plan(load_config(None, [f"model.hf_path={path}", "model.dtype=float32", f"data.pack_size={long}"]))
    assert isinstance(plan, TransformersPlan) and plan.square_bytes == floors[1], plan  # no linear twin
    assert "[S, S]" in plan.text()


def test_hybridpars_attention_stays_linear(saved):
    """The same Llama without attention dropout runs hybridpar's blockwise core: linear, and nothing priced."""
    from hybridpar.parallel.context.hf_own_memory import own_attention_bytes
    from hybridpar.train.hf_model import use_blockwise_attention

    peaks = []
    for tokens in (1024, 2048):
        model, _ = _trainers_model(saved("llama"), tokens)
        assert "blockwise" in use_blockwise_attention(model)
        peaks.append(_step_peak(model, tokens))
        assert own_attention_bytes(model, tokens, 4) == 0
    assert peaks[1] / peaks[0] < 2.3, peaks


def test_a_pack_whose_square_attention_cannot_fit_is_refused_before_any_process_starts(saved, tmp_path):
    """Before: Bloom at data.pack_size=65536 passed ``train --dry-run`` (its floor was linear: a few MiB) and a run
    would have asked for 64 GiB of [S, S] probabilities at its first step."""
    code, out = cli("train", "--dry-run", f"model.hf_path={saved('bloom')}", "model.dtype=float32",
                    "data.pack_size=65536", f"output_dir={tmp_path / 'out'}")
    line = refusal_line(out)
    assert code != 0 and "[S, S] tensors of its attention" in line and "data.pack_size=65536" in line, out
    assert "parallel.cp" not in line, line  # such a model trains one document per row: cp > 1 is refused for it


def test_generation_prefills_a_long_prompt_without_its_tokens_by_vocabulary_logits():
    """Before: ``generate`` on a HybridLM ran the prompt's prefill through the LM head at every position, a
    ``[B, S, V]`` logits tensor (32 KiB per prompt token at V=8192 in float32, 128K-vocabulary models: 0.5 MiB
    per token) to sample from its last row, and ``generation_bytes`` priced it so. Now the prefill's head
    sees the last position only: the bytes a prompt token adds stay under half a vocabulary row."""
    from hybridpar.models.generation import generate, generation_bytes
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.train.tensor_peak import TensorPeak

    vocab, short, long = 8192, 1024, 2048
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", dtype=torch.float32, vocab_size=vocab)).eval()
    peaks = []
    for tokens in (short, long):
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
        with TensorPeak() as peak:
            generate(model, ids, max_new_tokens=2)
        peaks.append(peak.bytes)
    per_token = (peaks[1] - peaks[0]) / (long - short)
    assert 0 < per_token < vocab * 4 / 2, (peaks, per_token)
    priced = (generation_bytes(model, 1, long, 2) - generation_bytes(model, 1, short, 2)) / (long - short)
    assert priced < vocab * 4 / 2, priced


def test_the_logits_path_is_priced_and_a_pack_whose_logits_cannot_fit_is_refused(saved, tmp_path):
    """Before: a model whose loss runs through transformers' [tokens, vocabulary] logits (GPT-J's head bias; heads
    with their own forward, unmapped logit transforms) had a linear pack floor of a few bytes per token and no
    line in ``plan``: GPT-J at V=50000 and data.pack_size=131072 passed ``train --dry-run`` and would have needed
    24 GiB of logits. Now the floor and the plan count ``[T/(cp*tp), V]``, which the measured step exceeds."""
    from hybridpar.config import load_config
    from hybridpar.parallel.context.hf_own_memory import logits_path, own_path_bytes
    from hybridpar.plan import make_plan

    tokens = 256
    model, _ = _trainers_model(saved("gptj"), tokens)
    assert logits_path(model)
    priced = own_path_bytes(model, tokens, 4)
    assert priced == tokens * 50000 * 4 <= _step_peak(model, tokens), priced
    plan = make_plan(load_config(None, [f"model.hf_path={saved('gptj')}", "model.dtype=float32", "data.pack_size=4096"]))
    assert plan.logits_bytes == 4096 * 50000 * 4 and "[tokens, vocabulary] logits" in plan.text(), plan.text()
    code, out = cli("train", "--dry-run", f"model.hf_path={saved('gptj')}", "model.dtype=float32",
                    "data.pack_size=131072", f"output_dir={tmp_path / 'out'}")
    line = refusal_line(out)
    assert code != 0 and "[tokens, vocabulary] logits" in line, out
