"""The vocabulary-parallel ``lm_head_loss`` and the model's in-forward loss on real gloo groups.

One 4-rank group holds TP groups of 1, 2 and 4 ranks side by side:

- ``lm_head_loss(hidden, weight_shard, labels, tp_group=...)`` in float64 equals
  ``F.cross_entropy(hidden @ weight.T, reduction="sum", ignore_index=-100)`` to 1e-10: the loss,
  the full ``grad_hidden`` on every rank and each rank's rows of ``grad_weight``; vocabularies
  of 64 (even), 61 (uneven Shard(0) chunks) and 6 (tp=4: one rank holds no row), ignored labels,
  a chunk with no valid label, tokens and vocabulary not multiples of the chunk; the same with a
  ``Shard(0)`` DTensor weight and a sequence-sharded ``Shard(1)`` DTensor hidden;
- the same (vocabulary 61) with soft-capped logits ``c tanh(s z / c)``, predictions included;
- predictions are the argmax with ties across shards and blocks going to the lower id;
- no op allocates a [T, V] tensor at tp=2 (profiler memory tracking);
- bad input raises ``ValueError`` on every rank before any collective;
- (2 ranks) ``torch._dynamo.explain`` finds one graph and no break on plain and DTensor inputs;
- the whole ``HybridLM`` at cp=2 x tp=2 with and without sequence parallelism: the in-forward
  loss, every gradient and the predictions equal the single-process model's (logits path).

One 2-rank group runs the whole model at tp=2, with and without sequence parallelism, dense and
packed, and tied embeddings with an odd vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.context.test_model import TOL as MODEL_TOL
from tests.distributed.context.test_model import build_model, compare, make_batch, reference_run
from tests.train.test_lm_head_loss import largest_allocation_bytes, make_case, reference

TOL = 1e-10
VOCABS = (64, 61, 6)
CHUNK = 5
BATCH, SEQ = 2, 12  # the Shard(1) hidden case: [2, 12, D], 12 divisible by 2 and 4


# ---------------------------------------------------------------- the function, tp in {1, 2, 4}


def _case(vocab: int):
    return make_case(tokens=BATCH * SEQ + 13, vocab=vocab, seed=vocab)  # 37 tokens: not a multiple of 5


SOFTCAP = dict(scale=0.5, softcap=2.0)  # a scale and a cap that bends logits of size ~3


def _loss_and_grads(h, w_local, labels, group, vocab, **transform):
    from hybridpar.train.loss import lm_head_loss_output

    h, w_local = h.clone().requires_grad_(), w_local.clone().requires_grad_()
    out = lm_head_loss_output(h, w_local, labels, chunk_size=CHUNK, tp_group=group, vocab_size=vocab,
                              return_predictions=True, **transform)
    out.loss_sum.backward()
    return {"loss": out.loss_sum.item(), "count": out.valid_count.item(), "dh": h.grad, "dw": w_local.grad,
            "predictions": out.predictions}


def _dtensor_case(mesh, vocab):
    """The weight as a Shard(0) DTensor, the hidden as a Shard(1) DTensor [B, S/tp, D]."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from hybridpar.train.loss import lm_head_loss

    h, w, labels = _case(vocab)
    h3 = distribute_tensor(h[: BATCH * SEQ].view(BATCH, SEQ, -1), mesh, [Shard(1)]).requires_grad_()
    w_d = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    loss, _ = lm_head_loss(h3, w_d, labels[: BATCH * SEQ].view(BATCH, SEQ), chunk_size=CHUNK)
    loss.backward()
    return {"loss": loss.item(), "dh": h3.grad.full_tensor(), "dw": w_d.grad.to_local(),
            "offset": _shard(w, vocab, mesh.get_group())[0]}


def _shard(w, vocab: int, group):
    """``(offset, this rank's rows of w)`` under ``Shard(0)`` of ``vocab`` rows over ``group``."""
    import torch.distributed as dist

    from hybridpar.parallel.tensor.vocab_parallel_loss import vocab_shard

    offset, rows = vocab_shard(vocab, dist.get_world_size(group), dist.get_rank(group))
    return offset, w[offset:offset + rows]


def _tied_case(vocab: int):
    """Integer-valued inputs (every dot product exact in any order) whose largest logits are
    equal in rows 3, 8 and V-2: other blocks and, for tp > 1, other shards."""
    h, w, labels = _case(vocab)
    h, w = h.abs().round() + 1, w.round()
    w[[3, 8, vocab - 2]] = 10.0
    return h, w, labels


def _predictions(group, vocab):
    from hybridpar.parallel.tensor.vocab_parallel_loss import vocab_parallel_lm_head_loss

    out = []
    for v, (h, w, labels) in ((vocab, _tied_case(vocab)), (vocab + 1, _case(vocab + 1))):
        out.append(vocab_parallel_lm_head_loss(h, _shard(w, v, group)[1], labels, tp_group=group, chunk_size=CHUNK,
                                               vocab_size=v, return_predictions=True).predictions)
    return tuple(out)


def _errors(group, vocab) -> dict:
    """Every rank of ``group`` runs these; each must raise before a collective (or the group hangs)."""
    from hybridpar.train.loss import lm_head_loss

    h, w, labels = _case(vocab)
    _, shard = _shard(w, vocab, group)
    cases = {
        "label = V": lambda: lm_head_loss(h, shard, torch.where(labels == labels[0], vocab, labels), tp_group=group,
                                          vocab_size=vocab),
        "rows": lambda: lm_head_loss(h, w[:shard.shape[0] + 1], labels, tp_group=group, vocab_size=vocab),
        "chunk_size": lambda: lm_head_loss(h, shard, labels, tp_group=group, vocab_size=vocab, chunk_size=0),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except ValueError as error:
            out[name] = str(error)
    return out


def function_results(rank: int, groups: dict) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    results = {}
    for tp, group in groups.items():
        for vocab in VOCABS:
            if vocab == 6 and tp != 4:
                continue
            h, w, labels = _case(vocab)
            offset, shard = _shard(w, vocab, group)
            results[("plain", tp, vocab)] = {**_loss_and_grads(h, shard, labels, group, vocab), "offset": offset}
        h, w, labels = _case(61)
        offset, shard = _shard(w, 61, group)
        results[("softcap", tp, 61)] = {**_loss_and_grads(h, shard, labels, group, 61, **SOFTCAP), "offset": offset}
        if tp > 1:
            mesh = DeviceMesh.from_group(group, "cpu")
            results[("dtensor", tp, 61)] = _dtensor_case(mesh, 61)
        results[("predictions", tp)] = _predictions(group, 61)
    results["errors tp2"] = _errors(groups[2], 61)

    h, w, labels = make_case(tokens=64, vocab=96, dtype=torch.float32)
    w_local = _shard(w, 96, groups[2])[1].clone().requires_grad_()
    h.requires_grad_()

    def run():
        from hybridpar.train.loss import lm_head_loss

        lm_head_loss(h, w_local, labels, chunk_size=16, tp_group=groups[2])[0].backward()

    results["largest allocation tp2"] = largest_allocation_bytes(run)
    return results


def compile_results() -> dict:
    """``torch._dynamo.explain`` of the TP loss core on plain and DTensor inputs, and a fullgraph
    ``aot_eager`` compile of the plain call (loss and gradients) against eager."""
    import torch._dynamo
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hybridpar.parallel.tensor.vocab_parallel_loss import VocabParallelLMHeadLoss

    group = dist.group.WORLD
    core = VocabParallelLMHeadLoss(group, chunk_size=CHUNK)
    h, w, labels = _case(64)
    shard = w.chunk(2)[dist.get_rank()]
    mesh = DeviceMesh.from_group(group, "cpu")
    inputs = {"plain": (h, shard, labels),
              "dtensor": (distribute_tensor(h[: BATCH * SEQ].view(BATCH, SEQ, -1), mesh, [Shard(1)]),
                          distribute_tensor(w, mesh, [Shard(0)]), labels[: BATCH * SEQ].view(BATCH, SEQ))}
    out = {}
    for name, args in inputs.items():
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(core)(*args)
        out[name] = (explanation.graph_count, explanation.graph_break_count)
    torch._dynamo.reset()
    compiled = torch.compile(core, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (compiled, core):
        hg, wg = h.clone().requires_grad_(), shard.clone().requires_grad_()
        loss = fn(hg, wg, labels).loss_sum
        loss.backward()
        grads.append((loss.detach(), hg.grad, wg.grad))
    torch._dynamo.reset()
    out["compiled error"] = max((a - b).abs().max().item() for a, b in zip(*grads))
    return out


# ---------------------------------------------------------------- the whole model


def in_forward_run(model, mesh, batch, sequence_parallel: bool, overrides: dict) -> dict:
    """One step with the loss computed inside ``model.forward``; rank 0's record is complete."""
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.loss import global_sum, valid_token_count

    ids, labels, packed = batch
    dp_cp = ParallelDims.group(mesh, "dp_cp")
    groups = dict(cp_group=mesh["cp"].get_group(), tp_group=mesh["tp"].get_group(), sequence_parallel=sequence_parallel)
    local = shard_inputs(ids, labels=labels, packed=packed, **groups)
    with torch.no_grad():  # the single-process argmax, laid out like this rank's labels
        reference_argmax = build_model(**overrides)(ids, packed=packed)
    want_predictions = shard_inputs(ids, labels=reference_argmax.argmax(-1), packed=packed, **groups).labels
    count = global_sum(valid_token_count(local.labels), dp_cp)
    loss_sum, local_count, predictions = model(local.input_ids, packed=local.packed, labels=local.labels,
                                               return_predictions=True)
    (loss_sum / count).backward()
    return {"loss": (global_sum(loss_sum, dp_cp) / count).item(), "grads": canonical_state_dict(model, grads=True),
            "count ok": local_count.item() == valid_token_count(local.labels).item(),
            "predictions ok": torch.equal(predictions, want_predictions)}


TIED = dict(vocab_size=61, tie_word_embeddings=True)


def model_cases(world_size: int) -> dict:
    """name -> (ParallelDims kwargs, build_model overrides, batch kind, sequence parallel)."""
    if world_size == 2:
        cases = {f"tp2 {kind}{' sp' if sp else ''}": (dict(tp=2), {}, kind, sp) for kind in ("dense", "packed")
                 for sp in (False, True)}
        cases["tp2 tied odd-vocab sp packed"] = (dict(tp=2), TIED, "packed", True)
        return cases
    return {f"cp2 tp2 packed{' sp' if sp else ''}": (dict(cp=2, tp=2), {}, "packed", sp) for sp in (False, True)}


def model_batch(overrides: dict, kind: str):
    return make_batch(kind, seed=40, vocab=overrides.get("vocab_size", 64))


def model_results(world_size: int) -> dict:
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    results = {}
    for name, (dims_kwargs, overrides, kind, sp) in model_cases(world_size).items():
        dims = ParallelDims(**dims_kwargs)
        mesh = dims.build_mesh()
        model = parallelize(build_model(**overrides), dims, mesh=mesh, sequence_parallel=sp)
        results[name] = in_forward_run(model, mesh, model_batch(overrides, kind), sp, overrides)
    return results


def worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    results = {}
    if world_size == 4:
        groups = {}
        for tp in (1, 2, 4):  # every rank creates every group, in the same order
            for start in range(0, 4, tp):
                group = dist.new_group(list(range(start, start + tp)))
                if start <= rank < start + tp:
                    groups[tp] = group
        results.update(function_results(rank, groups))
    else:
        results["compile"] = compile_results()
    results["models"] = model_results(world_size)
    return results


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(4, worker, timeout_s=300)


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(2, worker, timeout_s=300)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_loss_equals_cross_entropy_in_float64(four_ranks, tp):
    checked = 0
    for vocab in VOCABS:
        if vocab == 6 and tp != 4:
            continue
        want_loss, want_dh, want_dw = reference(*_case(vocab))
        for rank, results in enumerate(four_ranks):
            got = results[("plain", tp, vocab)]
            rows = got["dw"].shape[0]
            where = f"tp={tp} V={vocab} rank {rank}"
            assert abs(got["loss"] - want_loss.item()) < TOL * max(1.0, want_loss.abs().item()), where
            assert (got["dh"] - want_dh).abs().max().item() < TOL, where
            if rows:
                assert (got["dw"] - want_dw[got["offset"]:got["offset"] + rows]).abs().max().item() < TOL, where
            checked += rows
    assert checked == sum(v * 4 // tp for v in VOCABS if v != 6 or tp == 4)  # every row, by its owner


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_soft_capped_logits_vocab_parallel_equal_their_cross_entropy(four_ranks, tp):
    h, w, labels = _case(61)
    want_loss, want_dh, want_dw = reference(h, w, labels, **SOFTCAP)
    assert abs(want_loss.item() - reference(h, w, labels)[0].item()) > 1e-3 * want_loss.item()  # the cap matters
    for rank, results in enumerate(four_ranks):
        got, where = results[("softcap", tp, 61)], f"tp={tp} rank {rank}"
        rows = got["dw"].shape[0]
        assert abs(got["loss"] - want_loss.item()) < 1e-12 * want_loss.item(), where
        assert (got["dh"] - want_dh).abs().max().item() < 1e-12, where
        assert not rows or (got["dw"] - want_dw[got["offset"]:got["offset"] + rows]).abs().max().item() < 1e-12, where
        assert torch.equal(got["predictions"], (h @ w.T).argmax(-1)), where


@pytest.mark.parametrize("tp", [2, 4])
def test_dtensor_weight_and_sequence_sharded_hidden(four_ranks, tp):
    h, w, labels = _case(61)
    want_loss, want_dh, want_dw = reference(h[: BATCH * SEQ], w, labels[: BATCH * SEQ])
    for results in four_ranks:
        got = results[("dtensor", tp, 61)]
        rows = got["dw"].shape[0]
        assert abs(got["loss"] - want_loss.item()) < TOL * want_loss.item()
        assert (got["dh"].reshape(-1, h.shape[1]) - want_dh).abs().max().item() < TOL
        assert (got["dw"] - want_dw[got["offset"]:got["offset"] + rows]).abs().max().item() < TOL


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_predictions_are_the_global_argmax_with_ties_to_the_lower_id(four_ranks, tp):
    h, w, _ = _tied_case(61)
    h2, w2, _ = _case(62)
    for results in four_ranks:
        tied, plain = results[("predictions", tp)]
        assert torch.equal(tied, (h @ w.T).argmax(-1)) and torch.equal(tied, torch.full_like(tied, 3))
        assert torch.equal(plain, (h2 @ w2.T).argmax(-1))


def test_no_tokens_by_vocabulary_tensor_at_tp2(four_ranks):
    full = 64 * 96 * 4
    for results in four_ranks:
        assert results["largest allocation tp2"] < full
        assert results["largest allocation tp2"] <= max(16 * 16, 64 * 8, 48 * 8) * 8


EXPECTED_ERRORS = {"label = V": ["label 61", "[0, 61)"], "rows": ["rows", "vocab_size=61"],
                   "chunk_size": ["chunk_size=0"]}


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_bad_input_raises_on_every_rank_before_a_collective(four_ranks, name):
    for results in four_ranks:
        message = results["errors tp2"][name]
        assert message is not None, f"{name}: no ValueError"
        for fragment in EXPECTED_ERRORS[name]:
            assert fragment in message, f"{fragment!r} not in {message!r}"


def _check_models(results_by_rank: list, world_size: int) -> None:
    failures = []
    for name, (_, overrides, kind, _) in model_cases(world_size).items():
        want = reference_run(build_model(**overrides), [model_batch(overrides, kind)])
        failures += compare(name, [results_by_rank[0]["models"][name]], want)
        for rank, results in enumerate(results_by_rank):
            record = results["models"][name]
            if not (record["count ok"] and record["predictions ok"]):
                failures.append(f"{name} rank {rank}: count ok {record['count ok']}, "
                                f"predictions ok {record['predictions ok']}")
    assert not failures, "\n".join(failures[:40])


def test_vocab_parallel_loss_is_one_graph_under_torch_compile(two_ranks):
    for results in two_ranks:
        got = results["compile"]
        assert got["plain"] == (1, 0) and got["dtensor"] == (1, 0), got
        assert got["compiled error"] < TOL


def test_model_in_forward_loss_at_tp2_matches_single_process(two_ranks):
    _check_models(two_ranks, 2)


def test_model_in_forward_loss_at_cp2_tp2_matches_single_process(four_ranks):
    _check_models(four_ranks, 4)


def test_reference_is_the_logits_cross_entropy():
    """The single-process in-forward loss equals the logits path the references use."""
    from hybridpar.train.loss import token_loss_sum

    model = build_model()
    ids, labels, packed = make_batch("packed", seed=40)
    loss_sum, count = model(ids, packed=packed, labels=labels)
    want = token_loss_sum(model(ids, packed=packed), labels)
    assert abs(loss_sum.item() - want.item()) < TOL * want.item() and count.item() == int((labels != -100).sum())
