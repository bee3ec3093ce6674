"""shard_inputs / gather_outputs on 8 real gloo ranks, against references written chunk by chunk.

One 8-rank launch runs every check (8 processes on 2 cores are slow to start): grids
cp=2 x tp=4 and cp=4 x tp=2 for SP-only, CP-only and CP+SP, seq_dim 0 and 1, dense and
packed; the gather_outputs round trip with its gradient; every bad-input rule; and a toy
MIMO-style language model on two sub-grids of 4 ranks (cp=2 x tp=2 with SP, cp=4).
Each rank returns ``{check name: passed}``; the tests below assert on those.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridpar.data.thd import PackedSeqParams
from hybridpar.parallel.comm.collectives import CommStats, all_gather
from hybridpar.parallel.context.inputs import gather_outputs, shard_inputs
from hybridpar.parallel.context.zigzag import localize
from tests.distributed.harness import run_ranks

WORLD = 8
PACKED_PADDED = [8, 24, 16]  # multiples of 2*cp for cp <= 4; T/cp divisible by tp on both grids
PACKED_REAL = [5, 24, 9]
DENSE_B, DENSE_S, HIDDEN = 2, 32, 3


# ----------------------------------------------------------------------------- references
def ref_cp_shard(x: torch.Tensor, dim: int, doc_lengths: list[int], cp: int, r: int) -> torch.Tensor:
    """Rank r's tokens, chunk by chunk: per document chunk r then chunk 2cp-1-r."""
    pieces, start = [], 0
    for length in doc_lengths:
        c = length // (2 * cp)
        for k in (r, 2 * cp - 1 - r):
            pieces.append(x.narrow(dim, start + k * c, c))
        start += length
    return torch.cat(pieces, dim)


def ref_sp_slice(x: torch.Tensor, dim: int, tp: int, t: int) -> torch.Tensor:
    return torch.chunk(x, tp, dim=dim)[t]


def grid_groups(rank: int, cp: int, tp: int, ranks: list[int]):
    """(c, t, cp_group, tp_group, grid_group) of a cp x tp grid over ``ranks`` (tp fastest).

    Every world rank must call this for every grid, in the same order (dist.new_group).
    """
    cp_groups = [dist.new_group([ranks[c * tp + t] for c in range(cp)]) for t in range(tp)]
    tp_groups = [dist.new_group([ranks[c * tp + t] for t in range(tp)]) for c in range(cp)]
    grid = dist.new_group(ranks)
    if rank not in ranks:
        return None
    c, t = divmod(ranks.index(rank), tp)
    return c, t, cp_groups[t], tp_groups[c], grid


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())


def make_batch(layout: str, seq_dim: int):
    """Inputs whose values encode their coordinates, and the document lengths."""
    if layout == "packed":
        b, s, docs = 1, sum(PACKED_PADDED), PACKED_PADDED
        packed = PackedSeqParams.from_cu_seqlens(cu_of(PACKED_REAL), cu_of(PACKED_PADDED))
        position_ids = packed.position_ids.clone()  # [1, T]
    else:
        b, s, docs, packed = DENSE_B, DENSE_S, [DENSE_S], None
        position_ids = torch.arange(s).expand(b, s).clone()
    sb = torch.arange(s).view(s, 1) * 10 + torch.arange(b).view(1, b)  # [S, B]: 10*s + b
    emb = (sb.double() * 100).unsqueeze(-1) + torch.arange(HIDDEN, dtype=torch.float64)  # [S, B, H]
    if seq_dim == 1:
        sb, emb = sb.t().contiguous(), emb.transpose(0, 1).contiguous()
    labels = (torch.arange(s) * 7).expand(b, s) + torch.arange(b).view(b, 1)  # [B, S]
    loss_mask = (torch.arange(s) % 3 != 0).double().expand(b, s).clone()
    return dict(input_ids=sb, inputs_embeds=emb, labels=labels, loss_mask=loss_mask, position_ids=position_ids,
                packed=packed), docs


# ----------------------------------------------------------------------------- content checks
def check_sharding(results: dict, name: str, c: int, t: int, cp: int, tp: int, cp_group, tp_group) -> None:
    modes = {  # name: (cp group, tp group, sequence_parallel, effective cp, effective tp)
        "sp": (None, tp_group, True, 1, tp),
        "cp": (cp_group, tp_group, False, cp, 1),  # the TP group is given but SP is off: no scatter
        "cpsp": (cp_group, tp_group, True, cp, tp),
    }
    for mode, (cpg, tpg, sp, ecp, etp) in modes.items():
        r, tr = (c if ecp > 1 else 0), (t if etp > 1 else 0)
        for layout in ("dense", "packed"):
            for seq_dim in (0, 1):
                key = f"{name}/{mode}/{layout}/seq_dim{seq_dim}"
                batch, docs = make_batch(layout, seq_dim)
                s = sum(docs)
                b = batch["labels"].shape[0]
                out = shard_inputs(**batch, cp_group=cpg, tp_group=tpg, sequence_parallel=sp, seq_dim=seq_dim)

                emb_shape = [s // (ecp * etp), b, HIDDEN] if seq_dim == 0 else [b, s // (ecp * etp), HIDDEN]
                exp_emb = ref_sp_slice(ref_cp_shard(batch["inputs_embeds"], seq_dim, docs, ecp, r), seq_dim, etp, tr)
                got = out.inputs_embeds
                results[f"{key}/embeds"] = list(got.shape) == emb_shape and torch.equal(got, exp_emb)
                ids_shape = [s // ecp, b] if seq_dim == 0 else [b, s // ecp]
                exp_ids = ref_cp_shard(batch["input_ids"], seq_dim, docs, ecp, r)  # never SP-split
                got = out.input_ids
                results[f"{key}/input_ids"] = list(got.shape) == ids_shape and torch.equal(got, exp_ids)
                for field in ("labels", "loss_mask", "position_ids"):  # batch-first, CP only
                    got, full = getattr(out, field), batch[field]
                    exp = ref_cp_shard(full, 1, docs, ecp, r)
                    results[f"{key}/{field}"] = list(got.shape) == [full.shape[0], s // ecp] and torch.equal(got, exp)

                if ecp > 1:
                    lay = out.packed.cp
                    glob = batch["packed"] or PackedSeqParams.for_dense(s)
                    results[f"{key}/packed"] = (
                        (lay.cp_size, lay.cp_rank) == (cp, c)
                        and torch.equal(lay.local_indices, ref_cp_shard(torch.arange(s), 0, docs, ecp, r))
                        and torch.equal(out.packed.seq_idx, ref_cp_shard(glob.seq_idx, 1, docs, ecp, r))
                        and torch.equal(out.packed.position_ids, ref_cp_shard(glob.position_ids, 1, docs, ecp, r))
                        and torch.equal(out.packed.cu_seqlens_padded, glob.cu_seqlens_padded)
                        and out.packed.qkv_format == ("thd" if layout == "packed" else "bshd")
                    )
                else:
                    results[f"{key}/packed"] = out.packed is batch["packed"]

                # round trip: every rank gets the full tensor back, in sequence order
                local = out.inputs_embeds.detach().clone().requires_grad_(True)
                full = gather_outputs(local, out.packed, cpg, seq_dim=seq_dim, tp_group=tpg, sequence_parallel=sp)
                weight = torch.sin(batch["inputs_embeds"])  # the same on every rank
                (full * weight).sum().backward()
                # backward reduce-scatters: each of the ecp*etp ranks contributes the same weight
                exp_grad = ref_sp_slice(ref_cp_shard(weight, seq_dim, docs, ecp, r), seq_dim, etp, tr) * (ecp * etp)
                results[f"{key}/gather_embeds"] = torch.equal(full, batch["inputs_embeds"])
                results[f"{key}/gather_grad"] = torch.allclose(local.grad, exp_grad, rtol=0, atol=1e-12)
                back = gather_outputs(out.loss_mask, out.packed, cpg, seq_dim=1)  # no SP for per-token outputs
                results[f"{key}/gather_loss_mask"] = torch.equal(back, batch["loss_mask"])


# ----------------------------------------------------------------------------- bad input
def check_errors(results: dict, cp_group, tp_group, foreign_cp_group) -> None:
    """Every rule raises ValueError on every rank, and gather_outputs starts no collective first."""
    with CommStats() as stats:
        _check_errors(results, cp_group, tp_group, foreign_cp_group)
    results["errors/no_collective_started"] = not any(stats.bytes_sent.values())


def _check_errors(results: dict, cp_group, tp_group, foreign_cp_group) -> None:  # cp=2 x tp=4 grid
    emb = torch.zeros(1, 36, 4, dtype=torch.float64)
    g = dict(cp_group=cp_group, tp_group=tp_group)
    bad_doc = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 8, 14]))
    packed16 = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 8, 16]))
    view = shard_inputs(inputs_embeds=emb[:, :32], packed=PackedSeqParams.from_cu_seqlens(cu_of([32])), **g).packed
    wrong_cp = localize(PackedSeqParams.for_dense(32), 4, 0)
    local = torch.zeros(1, 16, 4, dtype=torch.float64)
    cases = [  # (name, message pattern, function, args, kwargs)
        ("dense_len", r"sequence length 30 .*2\*cp = 4", shard_inputs, (), dict(inputs_embeds=emb[:, :30], **g)),
        ("packed_doc_len", r"document 1 .*length 6.*cp_size=2", shard_inputs, (),
         dict(inputs_embeds=emb[:, :14], packed=bad_doc, **g)),
        ("packed_doc_len_labels_only", r"document 1 .*length 6", shard_inputs, (),
         dict(labels=torch.zeros(1, 14, dtype=torch.long), packed=bad_doc, **g)),
        ("sp_split", r"sequence length 36 gives 18 .*size 4.*multiple of 16", shard_inputs, (),
         dict(inputs_embeds=emb, sequence_parallel=True, **g)),
        ("sp_split_no_cp", r"sequence length 6 gives 6 .*size 4", shard_inputs, (),
         dict(inputs_embeds=emb[:, :6], sequence_parallel=True, tp_group=tp_group)),
        ("dense_mask", r"attention_mask .*context parallel size 2.*causal.*packed", shard_inputs, (),
         dict(inputs_embeds=emb[:, :32], attention_mask=torch.ones(1, 32), **g)),
        ("packed_total", r"16 tokens .*S = 32", shard_inputs, (),
         dict(inputs_embeds=emb[:, :32], packed=packed16, **g)),
        ("seq_mismatch", r"sequence lengths disagree", shard_inputs, (),
         dict(inputs_embeds=emb[:, :32], labels=torch.zeros(1, 16, dtype=torch.long), **g)),
        ("batch_mismatch", r"batch sizes disagree", shard_inputs, (),
         dict(inputs_embeds=emb[:, :32], loss_mask=torch.ones(2, 32), **g)),
        ("seq_dim", r"seq_dim must be 0 .* got 2", shard_inputs, (), dict(inputs_embeds=emb[:, :32], seq_dim=2, **g)),
        ("embeds_rank", r"inputs_embeds must have at least 3 dims", shard_inputs, (),
         dict(inputs_embeds=emb[0, :32], **g)),
        ("not_member", r"not a member of cp_group", shard_inputs, (),
         dict(inputs_embeds=emb[:, :32], cp_group=foreign_cp_group)),
        ("already_localized", r"already localized", shard_inputs, (),
         dict(inputs_embeds=emb[:, :32], packed=view, **g)),
        # gather_outputs: layouts or groups that disagree with the output, before any all-gather
        ("gather_no_layout", r"no layout but cp_group has size 2", gather_outputs, (local, None, cp_group), {}),
        ("gather_global_packed", r"no layout", gather_outputs, (local, PackedSeqParams.for_dense(32), cp_group), {}),
        ("gather_group_size", r"cp_size=4, cp_rank=0 but cp_group has size 2", gather_outputs,
         (local[:, :8], wrong_cp, cp_group), {}),
        ("gather_length", r"output has 16 tokens .*sequence-parallel size 4 .*16 tokens", gather_outputs,
         (local, view, cp_group), dict(tp_group=tp_group, sequence_parallel=True)),
        ("gather_seq_dim", r"seq_dim 3 is out of range", gather_outputs, (local, view, cp_group, 3), {}),
    ]
    for name, pattern, fn, args, kwargs in cases:
        try:
            fn(*args, **kwargs)
            results[f"errors/{name}"] = False
        except ValueError as err:
            results[f"errors/{name}"] = re.search(pattern, str(err)) is not None
            if not results[f"errors/{name}"]:
                results[f"errors/{name} (message was: {err})"] = False


# ----------------------------------------------------------------------------- toy MIMO LM
IMG_TOKEN, VOCAB, FEAT, H_LM, N_POS = 0, 11, 5, 6, 40


def toy_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"enc_w": (FEAT, H_LM), "emb": (VOCAB, H_LM), "w1": (H_LM, H_LM), "pos": (N_POS, H_LM),
              "w_mix": (H_LM, H_LM), "w_out": (H_LM, VOCAB)}
    return {
        k: (torch.randn(*s, generator=gen, dtype=torch.float64) * 0.5).requires_grad_(True) for k, s in shapes.items()
    }


def toy_batch(layout: str):
    """Token ids with image placeholders, image features for them, labels, loss mask, positions."""
    gen = torch.Generator().manual_seed(1)
    if layout == "packed":
        padded, real = [8, 16, 8], [6, 16, 3]
        b, s = 1, sum(padded)
        packed = PackedSeqParams.from_cu_seqlens(cu_of(real), cu_of(padded))
        position_ids, docs = packed.position_ids.clone(), padded
        valid = torch.zeros(1, s, dtype=torch.bool)
        for start, length in zip(packed.cu_seqlens_padded[:-1].tolist(), real):
            valid[0, start : start + length] = True
    else:
        b, s, packed, docs = 2, 16, None, [16]
        position_ids, valid = torch.arange(s).expand(b, s).clone(), torch.ones(b, s, dtype=torch.bool)
    input_ids = torch.randint(1, VOCAB, (b, s), generator=gen)
    input_ids[torch.rand(b, s, generator=gen) < 0.3] = IMG_TOKEN
    image_feats = torch.randn(int((input_ids == IMG_TOKEN).sum()), FEAT, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (b, s), generator=gen)
    loss_mask = (valid & (torch.rand(b, s, generator=gen) < 0.8)).double()
    return dict(input_ids=input_ids, image_feats=image_feats, labels=labels, loss_mask=loss_mask,
                position_ids=position_ids, packed=packed), docs


def toy_embed(p, input_ids, image_feats):
    """Encoder on the full (unsharded) input; its outputs replace the placeholder tokens."""
    text = p["emb"][input_ids]  # [B, S, H]
    image = torch.tanh(image_feats @ p["enc_w"])  # [N_img, H]
    return text.masked_scatter((input_ids == IMG_TOKEN).unsqueeze(-1), image)  # [B, S, H]


def toy_reference(p, batch, docs):
    """Single-process LM, batch-first, the doc-causal prefix mean written as a loop over documents."""
    x = toy_embed(p, batch["input_ids"], batch["image_feats"])
    h = torch.tanh(x @ p["w1"]) + p["pos"][batch["position_ids"]]
    pieces, start = [], 0
    for length in docs:
        seg = h[:, start : start + length]
        pieces.append(seg.cumsum(1) / torch.arange(1, length + 1, dtype=h.dtype).view(1, -1, 1))
        start += length
    h = h + torch.tanh(torch.cat(pieces, 1) @ p["w_mix"])
    logits = h @ p["w_out"]  # [B, S, V]
    nll = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    return logits, (nll * batch["loss_mask"].flatten()).sum() / batch["loss_mask"].sum()


def toy_parallel(p, batch, c_group, t_group, sp, seq_dim):
    """The same LM on this rank's shard: per-token layers on the SP slice, mixing over CP."""
    tp = dist.get_world_size(t_group) if (t_group is not None and sp) else 1
    x = toy_embed(p, batch["input_ids"], batch["image_feats"])  # [B, S, H], full on every rank
    if seq_dim == 0:
        x = x.transpose(0, 1)  # [S, B, H], Megatron's sequence-first layout
    fields = {k: batch[k] for k in ("labels", "loss_mask", "position_ids", "packed")}
    out = shard_inputs(
        inputs_embeds=x, **fields, cp_group=c_group, tp_group=t_group, sequence_parallel=sp, seq_dim=seq_dim
    )
    h = torch.tanh(out.inputs_embeds @ p["w1"])  # [S/(cp*tp), B, H]
    if tp > 1:
        h = all_gather(h, t_group, seq_dim)  # [S/(cp*tp), B, H] -> [S/cp, B, H]
    pos = p["pos"][out.position_ids]  # [B, S/cp, H]
    h = h + (pos.transpose(0, 1) if seq_dim == 0 else pos)
    lay = out.packed.cp
    full = all_gather(h, c_group, seq_dim)  # [S/cp, B, H] -> [S, B, H], rank-major
    full = full.index_select(seq_dim, lay.gathered_to_sequence)  # sequence order
    doc = lay.global_seq_idx[0].long()  # [S]
    start = out.packed.cu_seqlens_padded.long()[doc]  # global start of each token's document
    csum = torch.cat([torch.zeros_like(full.narrow(seq_dim, 0, 1)), full.cumsum(seq_dim)], seq_dim)
    token = torch.arange(doc.numel())
    count = (token - start + 1).to(full.dtype).view([-1, 1, 1] if seq_dim == 0 else [1, -1, 1])
    mean = (csum.index_select(seq_dim, token + 1) - csum.index_select(seq_dim, start)) / count
    h = h + torch.tanh(mean.index_select(seq_dim, lay.local_indices) @ p["w_mix"])  # [S/cp, B, H]
    logits = h @ p["w_out"]  # [S/cp, B, V] or [B, S/cp, V]
    logits_bf = logits.transpose(0, 1) if seq_dim == 0 else logits  # [B, S/cp, V]
    nll = F.cross_entropy(logits_bf.flatten(0, 1), out.labels.flatten(), reduction="none")
    count = out.loss_mask.sum().detach().clone()
    dist.all_reduce(count, group=c_group)  # global number of valid tokens
    loss = (nll * out.loss_mask.flatten()).sum() / count / tp  # TP ranks hold the same CP-local loss
    return logits, loss, out


def check_toy_lm(results: dict, name: str, c_group, t_group, grid, sp: bool, seq_dim: int) -> None:
    for layout in ("dense", "packed"):
        batch, docs = toy_batch(layout)
        ref_p = toy_params()
        ref_logits, ref_loss = toy_reference(ref_p, batch, docs)
        ref_loss.backward()
        p = toy_params()
        logits, loss, out = toy_parallel(p, batch, c_group, t_group, sp, seq_dim)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=grid)
        key = f"{name}/{layout}"
        results[f"{key}/loss"] = abs(float(total) - float(ref_loss)) < 1e-12
        gathered = gather_outputs(logits.detach(), out.packed, c_group, seq_dim=seq_dim)
        gathered = gathered.transpose(0, 1) if seq_dim == 0 else gathered
        results[f"{key}/logits"] = torch.allclose(gathered, ref_logits.detach(), rtol=0, atol=1e-9)
        for k in p:  # replicated parameters: the sum of every rank's gradient is the full gradient
            grad = p[k].grad.clone()
            dist.all_reduce(grad, group=grid)
            results[f"{key}/grad_{k}"] = torch.allclose(grad, ref_p[k].grad, rtol=0, atol=1e-9)


# ----------------------------------------------------------------------------- the launch
def _all_checks(rank: int, world_size: int) -> dict[str, bool]:
    torch.manual_seed(0)
    results: dict[str, bool] = {}
    everyone = list(range(world_size))
    meshes = {(2, 4): grid_groups(rank, 2, 4, everyone), (4, 2): grid_groups(rank, 4, 2, everyone)}
    lm_sp = grid_groups(rank, 2, 2, [0, 1, 2, 3])  # the language model's own grid: 4 of the 8 ranks
    lm_cp = grid_groups(rank, 4, 1, [4, 5, 6, 7])
    for (cp, tp), (c, t, cp_group, tp_group, _) in meshes.items():
        check_sharding(results, f"cp{cp}xtp{tp}", c, t, cp, tp, cp_group, tp_group)
    c, t, cp_group, tp_group, _ = meshes[(2, 4)]
    evens, odds = dist.new_group([0, 2, 4, 6]), dist.new_group([1, 3, 5, 7])
    foreign = odds if rank % 2 == 0 else evens  # a group this rank is not in
    check_errors(results, cp_group, tp_group, foreign)
    if lm_sp is not None:
        _, _, c_group, t_group, grid = lm_sp
        check_toy_lm(results, "lm_cp2xtp2_sp_seqfirst", c_group, t_group, grid, sp=True, seq_dim=0)
    else:
        _, _, c_group, _, grid = lm_cp
        check_toy_lm(results, "lm_cp4_batchfirst", c_group, None, grid, sp=False, seq_dim=1)
    return results


@pytest.fixture(scope="module")
def rank_results() -> list[dict[str, bool]]:
    return run_ranks(WORLD, _all_checks, timeout_s=300)


def _failures(rank_results, prefix: str) -> tuple[int, list[str]]:
    checked, failed = 0, []
    for rank, res in enumerate(rank_results):
        for key, ok in res.items():
            if key.startswith(prefix):
                checked += 1
                if not ok:
                    failed.append(f"rank {rank}: {key}")
    return checked, failed


@pytest.mark.parametrize("mesh", ["cp2xtp4", "cp4xtp2"])
def test_per_rank_shards_match_reference(rank_results, mesh):
    checked, failed = _failures(rank_results, mesh + "/")
    assert failed == []
    assert checked == WORLD * 3 * 2 * 2 * 9  # modes x layouts x seq_dims x fields per rank


def test_bad_inputs_raise_before_any_collective(rank_results):
    checked, failed = _failures(rank_results, "errors/")
    assert failed == []
    assert checked == WORLD * 19  # 18 rules + no collective started


def test_toy_mimo_lm_on_sub_grids_matches_single_process(rank_results):
    for name, ranks in (("lm_cp2xtp2_sp_seqfirst", range(4)), ("lm_cp4_batchfirst", range(4, 8))):
        checked, failed = _failures([rank_results[r] for r in ranks], name + "/")
        assert failed == []
        assert checked == 4 * 2 * (2 + 6), name  # ranks x layouts x (loss, logits, 6 grads)


def test_without_groups_everything_passes_through():
    """No groups (size 1): nothing is sliced, a dense mask is allowed and returned, gather is identity."""
    batch, _ = make_batch("packed", 1)
    mask = torch.ones(1, sum(PACKED_PADDED), dtype=torch.bool)
    out = shard_inputs(**batch, attention_mask=mask, sequence_parallel=True)
    for field in ("input_ids", "inputs_embeds", "labels", "loss_mask", "position_ids", "packed"):
        assert getattr(out, field) is batch[field] or torch.equal(getattr(out, field), batch[field]), field
    assert out.attention_mask is mask and out.packed.cp is None
    assert gather_outputs(out.inputs_embeds, out.packed, None) is out.inputs_embeds
    assert shard_inputs(labels=None, cp_group=None).labels is None
