"""Measure what the plan predicts, on real ranks (tests and ``benchmarks/planner.py``; not the planner).

``measure_step(rank, world, overrides, output_dir)`` (a ``run_ranks`` worker) trains two steps of
the config with ``Trainer.fit`` and reads the tensor peak the trainer reports for its second
(steady-state) step in ``metrics.jsonl`` (``tensor_peak_gib``: allocator events, ``train/tensor_peak``),
then runs a third step under ``CommStats`` (bytes per collective kind and mesh dim) and one pack's
forward measuring what it keeps for backward (``_saved_bytes``: allocator events, the smallest of
four repeats under checkpointing, and saved-tensor hooks).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

__all__ = ["measure_step", "predict", "BASE_OVERRIDES"]

BASE_OVERRIDES = ["train.steps=2", "train.eval_every=0", "checkpoint.every=-1", "tensorboard=false", "plot=false",
                  "train.log_every=1000"]


def _storages(t):
    """``(data_ptr, nbytes)`` of the real storages under ``t`` (DTensor and wrapper subclasses unwrapped)."""
    import torch

    if not isinstance(t, torch.Tensor):
        return
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _storages(getattr(t, name))
        return
    storage = t.untyped_storage()
    yield storage.data_ptr(), storage.nbytes()


def _saved_bytes(trainer, pack) -> dict:
    """What one pack's forward keeps for backward, measured two ways (both exclude parameters and
    FSDP's gathered parameters):

    - ``live``: bytes the forward allocated and left live (CPU allocator events,
      ``train/tensor_peak``), minus the loss outputs: everything backward will read, under any
      checkpointing policy (a checkpoint's kept input and selective cache included), once the
      router load-balancing term is taken as the trainer takes it (``router_aux_term``);
    - ``hooks``: distinct storages autograd packs (saved-tensor hooks). A checkpointed block packs
      its tensors under its own hooks, but saves its inputs outside them: this sees everything
      under ``none`` and ``full``, not selective checkpointing's cached outputs.
    """
    import torch

    from hybridpar.models.hf.router_aux import router_aux_term
    from hybridpar.train.loss import real_token_mask
    from hybridpar.train.tensor_peak import TensorPeak

    def parameters():
        return {ptr: n for p in trainer.model.parameters() for ptr, n in _storages(p)}

    kept: dict[int, int] = {}

    def pack_hook(t):
        current = parameters()  # FSDP swaps in its gathered parameters during forward
        for ptr, nbytes in _storages(t):
            if nbytes and ptr not in current:
                kept[ptr] = nbytes
        return t.detach()  # not t: a saved output would hold its own grad_fn (a cycle gc cannot free)

    before = parameters()
    gc.collect()
    with TensorPeak() as events:
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            loss_sum, _, sharded = trainer.forward_loss_sum(pack)
        # the router load-balancing term, as the trainer takes it before backward (it drops the recorded
        # logits; at cp > 1 its own softmax replaces the model's): outside the hooks, which count the model's
        aux = router_aux_term(trainer.model, 1, trainer._cp_sum if trainer.layout.dims.cp > 1 else None,
                              real_token_mask(pack)[sharded.global_positions().cpu()])
        gc.collect()  # tensors the forward left in reference cycles are garbage, not kept for backward
    gathered = sum(n for ptr, n in parameters().items() if ptr not in before)  # FSDP's root, kept gathered
    outputs = sum(n for out in (loss_sum, aux) for _, n in _storages(out))
    live = events.net_bytes - gathered - outputs
    (loss_sum if aux is None else loss_sum + aux).backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    return {"live": live, "hooks": sum(kept.values())}


def measure_step(rank: int, world: int, overrides: list[str], output_dir: str) -> dict:
    import torch

    from hybridpar.config import load_config
    from hybridpar.parallel.comm.stats import CommStats
    from hybridpar.train.trainer import Trainer

    config = load_config(None, BASE_OVERRIDES + list(overrides) + [f"output_dir={output_dir}"])
    trainer = Trainer(config, torch.device("cpu"))
    trainer.fit()
    with CommStats(trainer.layout.mesh) as stats:
        trainer.train_step(config.train.steps)
    pack = trainer.train_data.rank_packs(0, trainer.layout.dp_rank, trainer.layout.dims.size("dp"))[0]
    # The allocator's count can catch a collective buffer whose free ran on a gloo thread the
    # profiler does not watch (tp=2 SP, full, 4096 tokens: 4.39 MB in 14 of 16 repeats, +32 KiB or
    # +512 KiB in the others), so under checkpointing it is the smallest of four repeats. The
    # hooks' count repeats exactly.
    checkpointed = config.parallel.activation_checkpointing != "none"
    gc.collect()
    gc.freeze()  # each repeat's collections then scan only what the forward made (0.25 s each with torch loaded)
    try:
        repeats = [_saved_bytes(trainer, pack) for _ in range(4 if checkpointed else 1)]
    finally:
        gc.unfreeze()
    saved = {key: min(r[key] for r in repeats) for key in ("live", "hooks")}
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731
    out = {"parameters_per_rank": sum(local(p).numel() for p in trainer.model.parameters()),
           "traffic_by_dim": {f"{k}/{d}": n for (k, d), n in sorted(stats.by_dim().items())},
           "saved_bytes": saved["live"], "saved_hook_bytes": saved["hooks"]}
    if rank == 0:
        records = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
        step = [r for r in records if r.get("step") == 2][0]
        out.update(tensor_peak_gib=step["tensor_peak_gib"], rss_peak_gib=step["peak_memory_gib"])
    return out


def predict(overrides: list[str]) -> dict:
    """``hybridpar plan --json``'s object for the same config (in this process)."""
    from hybridpar.config import load_config
    from hybridpar.plan.planner import make_plan
    from hybridpar.plan.report import plan_dict

    plan = make_plan(load_config(None, BASE_OVERRIDES + list(overrides)))
    return plan_dict(plan, "cpu")
