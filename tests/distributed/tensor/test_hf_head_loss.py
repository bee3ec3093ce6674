"""The transformers LM head under tensor parallelism through hybridpar's loss seam, on a batch of
several rows: ``hf_loss_sum`` (vocab-parallel chunked loss from the final hidden states) at tp=2,
with and without sequence parallelism, equals one process in float64 (the loss and every
parameter gradient, 1e-9). It failed for B > 1: the seam handed ``lm_head`` an empty
``[B, 0, D]`` sequence, which DTensor cannot view once the head is column-parallel. The same for a
Gemma 2 that soft-caps its logits (``final_logit_softcapping``): the vocab-parallel loss on
``c tanh(z / c)``, probed at load, equal to one process."""

from __future__ import annotations

from tests.distributed.harness import run_ranks

TOL = 1e-9


def _models():
    import torch
    import transformers as hf

    from hybridpar.models.hf.float64 import keep_float64

    torch.manual_seed(0)
    llama = hf.LlamaForCausalLM(hf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                vocab_size=256)).double()
    gemma2 = hf.Gemma2ForCausalLM(hf.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                   vocab_size=256, final_logit_softcapping=1.5)).double()
    gemma2.set_attn_implementation("eager")
    keep_float64(gemma2)  # its norms' float32 casts: 2e-7 apart under sequence parallelism otherwise (cap or none)
    return {"llama": llama, "gemma2 soft cap": gemma2}


def _head_loss_errors(rank: int, world_size: int) -> dict:
    errors = {}
    for name, reference in _models().items():
        errors.update({(name, sp): worst for sp, worst in _errors_of(reference).items()})
    return errors


def _errors_of(reference) -> dict:
    import copy

    import torch
    import transformers as hf
    from torch.distributed.tensor import DTensor

    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.models.hf.logit_transform import probe_logits_after_head
    from hybridpar.train.hf_model import hf_loss_sum, loss_path_line

    assert probe_logits_after_head(reference) is None
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    labels[1, 5:9] = -100  # ignored tokens in one row
    want = hf_loss_sum(reference, ids, labels, {})[0]
    want.backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    errors = {}
    for sequence_parallel in (False, True):
        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        model = parallelize(model, ParallelDims(tp=2), sequence_parallel=sequence_parallel)
        assert loss_path_line(model).startswith("loss: chunked"), loss_path_line(model)
        got = hf_loss_sum(model, ids, labels, {})[0]
        got = got.full_tensor() if isinstance(got, DTensor) else got
        got.backward()
        worst = abs(got.item() - want.item()) / abs(want.item())
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            worst = max(worst, ((grad - expected[name]).abs().max() / expected[name].abs().max()).item())
        errors[sequence_parallel] = worst
    return errors


def test_hf_head_loss_under_tp_with_several_rows_equals_one_process():
    for errors in run_ranks(2, _head_loss_errors, timeout_s=300):
        assert set(errors) == {(m, sp) for m in ("llama", "gemma2 soft cap") for sp in (False, True)}, errors
        assert max(errors.values()) < TOL, errors
