"""A whole ``HybridLM`` under context parallelism against the single-process model.

One 2-rank and one 4-rank gloo group. In each, ``parallelize(model, ParallelDims(cp=P))``
(context-parallel cores, then FSDP over the CP ranks so their partial gradients are summed)
runs attention strategies {allgather, ulysses} with Mamba strategies {a2a, state} on a dense
batch (B=2) and a packed row (documents crossing rank boundaries, one boundary on a zigzag chunk
edge, padding), with inputs from ``shard_inputs``: at cp=2 every pairing on both kinds, at cp=4
each strategy once on each kind (``CP4_CASES``). The float64 loss (sum of
token cross entropy / global count of valid labels, summed over ranks) and every parameter
gradient (``canonical_state_dict(grads=True)``: gathered, Mamba components fused back) equal
the single-process model's to 1e-9. The 2-rank group also runs one pairing with activation
checkpointing. The reference runs in the pytest process.

The helpers here (model, batches, reference, distributed step) are shared with
``test_parallelize.py`` and ``test_tp_hybrid.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hybrid import HybridConfig, HybridLM
from hybridpar.train.loss import IGNORE_INDEX, global_sum, token_loss_sum, valid_token_count
from tests.distributed.harness import run_ranks

TOL = 1e-9
VOCAB = 64
DENSE_BATCH, DENSE_SEQ = 2, 32
PACKED_DOCS = [8, 24, 16, 16]  # padded lengths: multiples of 2*cp for cp in {2, 4}; 64 tokens
PACKED_REAL = [7, 24, 13, 16]  # real lengths; the rest of each document is padding
MODEL = dict(
    vocab_size=VOCAB, hidden_size=32, pattern="M*-M", mamba_num_heads=8, mamba_head_dim=4, mamba_n_groups=2,
    ssm_state_size=8, conv_kernel=4, chunk_size=8, mamba_proj_bias=True, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, attention_bias=True, intermediate_size=64, mlp_activation="silu",
    mlp_gated=True, mlp_bias=True, dtype=torch.float64,
)
CP_STRATEGIES = [(a, m) for a in ("allgather", "ulysses") for m in ("a2a", "state")]
KINDS = ("dense", "packed")
# cp=4: each attention strategy and each Mamba strategy once on each batch kind (the layers' CP paths do not
# depend on one another's strategy; cp=2 runs every pairing on both kinds)
CP4_CASES = [("allgather", "a2a", "dense"), ("ulysses", "state", "dense"), ("allgather", "state", "packed"),
             ("ulysses", "a2a", "packed")]


# ---------------------------------------------------------------- model, batches, reference


def build_model(seed: int = 0, **overrides) -> HybridLM:
    """A float64 HybridLM with every parameter perturbed and Mamba states that persist
    (small |A|, large dt), so gradients reach far across rank boundaries."""
    torch.manual_seed(seed)
    model = HybridLM(HybridConfig(**{**MODEL, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(0.05, 1.0).log())
            elif name.endswith("dt_bias"):
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.add_(0.05 * torch.randn_like(param))
    return model


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def make_batch(kind: str, seed: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor, PackedSeqParams | None]:
    """``(input_ids [B, S], labels [B, S], global packed params or None)``; some labels ignored."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "dense":
        ids = torch.randint(0, vocab, (DENSE_BATCH, DENSE_SEQ), generator=gen)
        labels = torch.randint(0, vocab, (DENSE_BATCH, DENSE_SEQ), generator=gen)
        labels[:, -1] = IGNORE_INDEX
        labels[0, 3] = IGNORE_INDEX
        return ids, labels, None
    total = sum(PACKED_DOCS)
    ids = torch.randint(0, vocab, (1, total), generator=gen)
    labels = torch.randint(0, vocab, (1, total), generator=gen)
    start = 0
    for padded, real in zip(PACKED_DOCS, PACKED_REAL):
        labels[0, start + real - 1 : start + padded] = IGNORE_INDEX  # last real token and the padding
        start += padded
    return ids, labels, PackedSeqParams.from_cu_seqlens(_cu(PACKED_REAL), _cu(PACKED_DOCS))


def per_step(batches: list, steps: int) -> list[list]:
    """``batches`` for each step: one list per data-parallel rank, the same at every step, or
    already a list of such lists, one per step (e.g. dense batches, then packed rows)."""
    return batches if isinstance(batches[0], list) else [batches] * steps


def reference_run(model: HybridLM, batches: list, steps: int = 1, lr: float = 0.0) -> list[dict]:
    """Single process: per step the loss over all ``batches`` (one per data-parallel rank, or
    one such list per step: ``per_step``), the gradients, and (with ``lr``) the parameters
    after an AdamW step. One thread: the
    model is tiny and the machine is shared, so more threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_steps(model, batches, steps, lr)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(model: HybridLM, batches: list, steps: int, lr: float) -> list[dict]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False) if lr else None
    out = []
    for step_batches in per_step(batches, steps):
        model.zero_grad(set_to_none=True)
        count = sum(valid_token_count(labels) for _, labels, _ in step_batches)
        loss = sum(token_loss_sum(model(ids, packed=packed), labels) for ids, labels, packed in step_batches) / count
        loss.backward()
        record = {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
        if optimizer is not None:
            optimizer.step()
            record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append(record)
    return out


# ---------------------------------------------------------------- the distributed step


def distributed_run(model, mesh, batches: list, steps: int = 1, lr: float = 0.0,
                    sequence_parallel: bool = False) -> list[dict]:
    """The same as ``reference_run`` on a parallelized model: this rank's data-parallel batch of
    each step, sharded with ``shard_inputs``; loss divided by the global valid count over dp x cp.
    Every rank must call it (canonical dicts are collectives); rank 0's record is complete."""
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.state import canonical_state_dict

    dp_rank = ParallelDims.mesh(mesh, "dp").get_local_rank()
    dp_cp = ParallelDims.group(mesh, "dp_cp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False) if lr else None
    out = []
    for step_batches in per_step(batches, steps):
        ids, labels, packed = step_batches[dp_rank]
        local = shard_inputs(ids, labels=labels, packed=packed, cp_group=mesh["cp"].get_group(),
                             tp_group=mesh["tp"].get_group(), sequence_parallel=sequence_parallel)
        model.zero_grad(set_to_none=True)
        count = global_sum(valid_token_count(local.labels), dp_cp)
        loss_sum = token_loss_sum(model(local.input_ids, packed=local.packed), local.labels)
        (loss_sum / count).backward()
        record = {"loss": (global_sum(loss_sum, dp_cp) / count).item(),
                  "grads": canonical_state_dict(model, grads=True)}
        if optimizer is not None:
            optimizer.step()
            record["params"] = canonical_state_dict(model)
        out.append(record)
    return out


def compare(name: str, got: list[dict], want: list[dict]) -> list[str]:
    """Differences above ``TOL`` (relative to each tensor's scale) between two runs' records."""
    failures = []
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        where = f"{name} step {step}"
        if abs(g["loss"] - w["loss"]) > TOL * max(1.0, abs(w["loss"])):
            failures.append(f"{where}: loss {g['loss']!r} != {w['loss']!r}")
        for key in ("grads", "params"):
            if key not in w:
                continue
            if set(g[key]) != set(w[key]):
                failures.append(f"{where}: {key} names differ: {sorted(set(g[key]) ^ set(w[key]))}")
                continue
            for param_name, expected in w[key].items():
                actual = g[key][param_name]
                if actual.shape != expected.shape:
                    failures.append(f"{where}: {key} {param_name} shape {tuple(actual.shape)} != {tuple(expected.shape)}")
                    continue
                err = (actual - expected).abs().max().item()
                if err > TOL * max(1.0, expected.abs().max().item()):
                    failures.append(f"{where}: {key} {param_name} max error {err:.3e}")
    return failures


# ---------------------------------------------------------------- ranks


def cp_worker(rank: int, world_size: int) -> dict | None:
    """cp=2: every strategy pairing and batch kind (plus one with checkpointing); cp=4: ``CP4_CASES``."""
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    dims = ParallelDims(cp=world_size)
    mesh = dims.build_mesh()
    base = build_model()
    results = {}
    if world_size == 2:
        cases = [(a, m, kind, False) for a, m in CP_STRATEGIES for kind in KINDS]
        cases.append(("ulysses", "state", "packed", True))
    else:
        cases = [(a, m, kind, False) for a, m, kind in CP4_CASES]
    for attention, mamba, kind, checkpointing in cases:
        model = parallelize(copy.deepcopy(base), dims, mesh=mesh, cp_attention=attention, cp_mamba=mamba,
                            activation_checkpointing=checkpointing)
        batches = [make_batch(kind, seed=10)]
        results[(attention, mamba, kind, checkpointing)] = distributed_run(model, mesh, batches)
    return results if rank == 0 else None


@pytest.mark.parametrize("cp", [2, 4])
def test_hybrid_lm_context_parallel_matches_single_process(cp):
    results = run_ranks(cp, cp_worker, timeout_s=300)[0]
    references = {kind: reference_run(build_model(), [make_batch(kind, seed=10)]) for kind in KINDS}
    assert len(results) == (len(CP_STRATEGIES) * len(KINDS) + 1 if cp == 2 else len(CP4_CASES))
    failures = []
    for (attention, mamba, kind, checkpointing), got in results.items():
        name = f"cp={cp} {attention}+{mamba} {kind}{' checkpointed' if checkpointing else ''}"
        failures += compare(name, got, references[kind])
    assert not failures, "\n".join(failures[:40])
