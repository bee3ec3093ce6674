"""``parallel.compile``: each block compiled, no graph break, float64 results equal to eager.
Under selective checkpointing a block compiles after the forward that teaches its policy.

The tests use the ``aot_eager`` backend: dynamo traces each block exactly as for inductor (the
graph breaks are dynamo's) and AOT autograd traces its backward, without inductor's C++
code generation, which takes minutes per graph on this machine (``benchmarks/compile.py``
times inductor). Parity is float64: the loss and every parameter gradient.

- one process: a packed row through the tiny model, compiled against eager; parameter names
  do not change;
- the default job (at the tiny preset's widths, one block of each kind: ``M*-``) on 4 gloo ranks
  (cp=2 x tp=2, sequence parallel, FSDP over cp, two packs per rank): two training steps,
  compiled against eager, and ``torch._dynamo.utils.counters["graph_break"]`` empty on every
  rank (one block of each kind: further blocks share the graphs and add only their run time);
- blocks of a kind share one graph whatever their hooks' ids (one process);
- the GPU's path on CPU (bf16, the fused Mamba op with a stand-in scan, the steps inside custom ops
  compiled as on CUDA) compiled against eager, bit for bit (one process);
- tp=2 without sequence parallelism (2 gloo ranks), where the first block's input is a view:
  a dense then a packed AdamW step (two shapes) against one process; and the same under selective
  checkpointing, whose Mamba2 mixers swap their shards in and out inside the checkpoint;
- a checkpoint dynamo cannot trace runs eagerly and recomputes to its end, so its blocks' hooks
  put back what they swapped (one process); a run called from Python gives dynamo its settings back.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks

DEFAULT = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")
TOL = 1e-10


def _max_error(got: dict, want: dict) -> float:
    return max(((got[n] - w).abs().max() / w.abs().max().clamp_min(1.0)).item() for n, w in want.items())


def test_compiled_blocks_match_eager_in_float64_without_graph_breaks():
    from torch._dynamo.utils import counters

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    torch.manual_seed(0)
    base = HybridLM(HybridConfig.from_preset("tiny", dtype=torch.float64))
    eager = parallelize(copy.deepcopy(base), ParallelDims())
    compiled = parallelize(copy.deepcopy(base), ParallelDims(), compile="aot_eager")
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 20, 52, 64], dtype=torch.int32))
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    weight = torch.randn(1, 64, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    counters.clear()
    losses = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        losses[name] = (model(ids, packed=packed) * weight).sum()
        losses[name].backward()
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 3  # one per block kind: Mamba2, attention, MLP
    assert abs(losses["compiled"].item() - losses["eager"].item()) < TOL * abs(losses["eager"].item())
    grads = {name: {n: p.grad for n, p in model.named_parameters()}
             for name, model in (("eager", eager), ("compiled", compiled))}
    assert list(grads["compiled"]) == list(grads["eager"])  # compiled in place: parameter names unchanged
    assert _max_error(grads["compiled"], grads["eager"]) < TOL


@pytest.mark.parametrize("layout", [{"compile": "aot_eager"}, {"activation_checkpointing": "selective"}])
def test_compiled_model_runs_the_compiled_steps_inside_its_custom_ops(fresh_compiled_steps, layout):
    """The GPU's path on CPU: bf16 mixed precision, the fused Mamba op (FLA's contract standing in for its
    scan) and the LM head loss, the blocks compiled (or run under selective checkpointing, whose dispatch
    mode is active around the steps), and the steps that ``cuda_compile`` compiles on CUDA compiled too
    (``aot_eager``): no graph break, no step fell back to eager, and the loss and every gradient equal
    the eager model's bit for bit."""
    from torch._dynamo.utils import counters

    import tests.models.mamba.test_fused  # noqa: F401  (registers the "contract" scan)
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.models.mamba.fused import use_stand_in
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    cuda_compile = fresh_compiled_steps
    torch.manual_seed(0)
    base = HybridLM(HybridConfig.from_preset("tiny"))
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 40, 104, 128], dtype=torch.int32))
    ids = torch.randint(0, 256, (1, 129), generator=torch.Generator().manual_seed(1))
    counters.clear()
    results = {}
    with use_stand_in("contract"):
        for name, options in (("eager", {}), ("compiled", layout)):
            checkpointing = layout.get("activation_checkpointing", "none")
            model = parallelize(copy.deepcopy(base), ParallelDims(), mixed_precision="bf16", compile=options.get(
                "compile", False), activation_checkpointing=checkpointing)
            with cuda_compile.compile_steps("aot_eager" if options else None):
                loss, count = model(ids[:, :-1], packed=packed, labels=ids[:, 1:])
                (loss / count).backward()
            results[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert dict(counters["graph_break"]) == {} and not cuda_compile._FAILED
    inside_ops = {"Mamba scan gradients", "LM head loss gradient"}  # a compiled block fuses its relu2 itself
    assert {step for step, _ in cuda_compile._COMPILED} >= inside_ops | ({"relu2"} if "compile" not in layout else set())
    assert torch.equal(results["compiled"][0], results["eager"][0])
    assert all(torch.equal(results["compiled"][1][n], g) for n, g in results["eager"][1].items())


class _Block(torch.nn.Module):
    def __init__(self, activation):
        super().__init__()
        self.linear, self.activation = torch.nn.Linear(4, 4), activation

    def forward(self, x):
        return x + self.activation(self.linear(x))


def test_blocks_stay_compiled_through_shape_and_grad_mode_changes():
    """Three block kinds, each seen in training and evaluation at changing lengths: 12 graphs,
    over dynamo's default of 8 per code object (shared by all blocks), so without the raised
    limit the later ones would silently run eagerly."""
    from torch._dynamo.utils import counters

    from hybridpar.parallel.compiled_blocks import apply_compile

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(_Block(a) for a in (torch.nn.ReLU(), torch.nn.Tanh(), torch.nn.SiLU()))
    apply_compile(model, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    for length in (3, 5, 7):
        x = torch.randn(length, 4)
        for layer in model.layers:
            x = layer(x)
        x.sum().backward()
        with torch.no_grad():
            for layer in model.layers:
                layer(torch.randn(length, 4))
    assert counters["stats"]["unique_graphs"] == 12
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 12, dict(counters["frames"])


class _HookedBlock(torch.nn.Module):
    """A block whose linear has an always-call forward hook, as the TP styles register theirs."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.linear.register_forward_hook(lambda module, args, output: 2 * output, always_call=True)

    def forward(self, x):
        return x + self.linear(x)


def test_blocks_of_a_kind_share_one_graph_whatever_their_hook_ids():
    """Hook ids come from one global counter, and dynamo guarded those of always-call hooks: each
    block compiled its own graph, and past the recompile limit the rest ran eagerly. Four blocks of
    one kind: one graph, and the hooks still run (``compiled_blocks.py``)."""
    from torch._dynamo.utils import counters

    from hybridpar.parallel.compiled_blocks import apply_compile

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(_HookedBlock() for _ in range(4))
    x = torch.randn(3, 4, requires_grad=True)  # every block's input requires grad, the first's too
    want = x
    for layer in model.layers:
        want = layer(want)
    apply_compile(model, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    got = x
    for layer in model.layers:
        got = layer(got)
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _two_shapes() -> list[list]:
    """A dense batch ``[2, 32]``, then a packed row ``[1, 64]``: the second shape compiles again."""
    from tests.distributed.test_parallelize import batches_for

    return batches_for(dict(tp=2))


def tp2_compiled_steps(rank: int, world_size: int, pattern: str, checkpointing: str = "none") -> dict:
    from torch._dynamo.utils import counters

    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.distributed.context.test_model import build_model, distributed_run

    dims = ParallelDims(tp=2)
    mesh = dims.build_mesh()
    model = parallelize(build_model(pattern=pattern), dims, mesh=mesh, compile="aot_eager",
                        activation_checkpointing=checkpointing)
    torch._dynamo.reset()
    counters.clear()
    records = distributed_run(model, mesh, _two_shapes(), lr=1e-2)
    return {"records": records, "graph_breaks": dict(counters["graph_break"])}


def test_tp2_without_sequence_parallelism_compiles_and_matches_one_process():
    """At tp=2 without sequence parallelism the first block's input is the vocab-parallel
    embedding's ``to_local()``, a view of a DTensor's local tensor, whose backward through AOT
    autograd raised, and a second hidden-state shape failed to recompile with dynamic sizes
    (``compiled_blocks.py``). A dense then a packed AdamW step, blocks compiled: the float64 loss,
    every gradient and the parameters equal one process's, no graph break."""
    from tests.distributed.context.test_model import build_model, compare, reference_run

    pattern = "M*-"
    results = run_ranks(2, tp2_compiled_steps, pattern, timeout_s=600)
    reference = reference_run(build_model(pattern=pattern), _two_shapes(), lr=1e-2)
    assert results[0]["graph_breaks"] == {}
    assert not compare("tp2 compiled", results[0]["records"], reference)


def test_tp2_compiled_checkpointed_mamba_blocks_match_one_process():
    """Before: under compile with checkpointing at tp=2 every Mamba2 mixer parameter got no gradient (the mixer's TP
    hook swaps its shards in for one forward; the recomputation stopped early, before the hook that puts the parameters
    back, which compile had made skippable) and the checkpoint broke the graph on that swap. Now: the float64 loss,
    every gradient and the parameters of a dense then a packed AdamW step equal one process's, with no graph break."""
    from tests.distributed.context.test_model import build_model, compare, reference_run

    pattern = "M-"
    results = run_ranks(2, tp2_compiled_steps, pattern, "selective", timeout_s=600)
    reference = reference_run(build_model(pattern=pattern), _two_shapes(), lr=1e-2)
    assert results[0]["graph_breaks"] == {}
    assert not compare("tp2 compiled checkpointed", results[0]["records"], reference)


def test_an_eagerly_run_checkpoint_recomputes_to_the_end_and_its_hooks_put_back_what_they_swapped():
    """A checkpointed block dynamo cannot trace (here a graph break) runs torch's checkpoint eagerly. Its recomputation
    stopped at the last saved tensor, raising past the block's forward hooks, which compile had made skippable: a
    parameter a pre-hook swapped out stayed swapped (no gradient; ``named_parameters`` gave the stand-in)."""
    import torch.nn as nn

    from hybridpar.parallel.checkpointing import apply_activation_checkpointing
    from hybridpar.parallel.compiled_blocks import apply_compile

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4, dtype=torch.float64)

        def forward(self, x):
            torch._dynamo.graph_break()
            return self.linear(x)

    def swap_in(module, args):  # a TP style's swap: a stand-in computed from the parameter, for one forward
        module.__dict__["kept"] = module._parameters["weight"]
        module._parameters["weight"] = module._parameters["weight"] * 1.0

    def put_back(module, args, output):
        module._parameters["weight"] = module.__dict__.pop("kept")
        return output

    model = nn.Module()
    model.layers = nn.ModuleList([Block()])
    weight = model.layers[0].linear.weight
    model.layers[0].linear.register_forward_pre_hook(swap_in)
    model.layers[0].linear.register_forward_hook(put_back, always_call=True)
    apply_compile(apply_activation_checkpointing(model, "full"), backend="eager")
    torch._dynamo.reset()
    model.layers[0](torch.randn(3, 4, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert model.layers[0].linear.weight is weight and weight.grad is not None


def test_a_run_called_from_python_gives_dynamo_its_settings_back():
    """``apply_compile`` raises dynamo's recompile limit and has it skip a checkpoint's side effects in the
    recomputation; a run called from Python (``cli.main`` in a notebook) left both changed for the caller's own
    ``torch.compile`` afterwards. ``worker.process_state_kept`` puts them back."""
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.parallel.checkpointing import apply_activation_checkpointing
    from hybridpar.parallel.compiled_blocks import apply_compile
    from hybridpar.worker import process_state_kept

    def compiled():
        apply_compile(apply_activation_checkpointing(HybridLM(HybridConfig.from_preset("tiny")), "full"),
                      backend="eager")

    config = torch._dynamo.config
    with config.patch(recompile_limit=9, skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        compiled()  # the caller's own use of the API: its changes are the caller's to keep
        config.recompile_limit, config.skip_fwd_side_effects_in_bwd_under_checkpoint = 12, False  # and its own
        with process_state_kept():
            compiled()
            assert (config.recompile_limit, config.skip_fwd_side_effects_in_bwd_under_checkpoint) == (24, True)
        assert (config.recompile_limit, config.skip_fwd_side_effects_in_bwd_under_checkpoint) == (12, False)


def test_selective_checkpointing_compiles_after_the_forward_that_teaches_it():
    """Selective checkpointing learns from a block's first forward which matmuls to keep; dynamo
    traces those decisions into the graph, so a block compiles after that forward (eager until
    then). Over three steps the float64 loss and every gradient equal eager selective
    checkpointing; the compiled steps have no graph break, one graph per block kind; and what a
    forward keeps for backward is selective's, not ``none``'s (allocator count; the compiled
    attention core keeps its output and log-sum-exp, which the eager CPU core recomputes)."""
    from torch._dynamo.utils import counters

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.parallel.checkpointing import apply_activation_checkpointing, selective_policy
    from hybridpar.parallel.compiled_blocks import apply_compile
    from hybridpar.train.tensor_peak import TensorPeak

    torch.manual_seed(0)
    base = HybridLM(HybridConfig.from_preset("tiny", dtype=torch.float64))
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 300, 700, 1024], dtype=torch.int32))
    ids = torch.randint(0, 256, (1, 1024), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    models = {"eager": apply_activation_checkpointing(copy.deepcopy(base), "selective"),
              "compiled": apply_compile(apply_activation_checkpointing(copy.deepcopy(base), "selective"),
                                        backend="aot_eager"),
              "none": apply_compile(copy.deepcopy(base), backend="aot_eager")}
    torch._dynamo.reset()
    counters.clear()
    for step in range(3):
        runs = {}
        for name, model in models.items():
            with TensorPeak() as peak:
                loss, _ = model(ids, packed=packed, labels=labels)
            loss.backward()
            runs[name] = (loss.item(), {n: p.grad for n, p in model.named_parameters()}, peak.net_bytes)
            model.zero_grad(set_to_none=True)
        assert abs(runs["compiled"][0] - runs["eager"][0]) < TOL * abs(runs["eager"][0])
        assert _max_error(runs["compiled"][1], runs["eager"][1]) < TOL
        if step == 0:
            assert all(selective_policy(block).learned for block in models["compiled"].backbone.layers)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 6  # Mamba2, attention, MLP: selective and none
    kept = {name: run[2] for name, run in runs.items()}
    assert kept["compiled"] < 0.6 * kept["none"], kept
    assert abs(kept["compiled"] / kept["eager"] - 1) < 0.1, kept


def _two_steps(overrides: list) -> dict:
    from torch._dynamo.utils import counters

    from hybridpar.config import load_config
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.trainer import Trainer

    base = ["model.preset=tiny", "model.overrides={pattern: M*-}", "model.dtype=float64", "data.pack_size=128", "data.packs_per_step=2",
            "train.eval_every=0", "checkpoint.every=-1", "tensorboard=false", "plot=false", "output_dir=unused",
            "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]  # the 4-rank layout
    trainer = Trainer(load_config(DEFAULT, base + overrides), torch.device("cpu"))
    torch._dynamo.reset()
    counters.clear()
    first = trainer.step_gradients(0)
    grads = canonical_state_dict(trainer.model, grads=True)
    trainer.optimizer.zero_grad(set_to_none=True)
    second = trainer.train_step(1)["loss"]  # after the first step's update, through the optimizer
    return {"losses": [float(first), second], "grads": grads, "graph_breaks": dict(counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"]}


def default_job_compiled_and_eager(rank: int, world_size: int) -> dict:
    return {"eager": _two_steps([]), "compiled": _two_steps(["parallel.compile=aot_eager"])}


def test_default_job_compiles_without_graph_breaks_and_matches_eager():
    for rank, result in enumerate(run_ranks(4, default_job_compiled_and_eager, timeout_s=900)):
        eager, compiled = result["eager"], result["compiled"]
        assert compiled["graph_breaks"] == {}, (rank, compiled["graph_breaks"])
        assert 3 <= compiled["graphs"] <= 8, compiled["graphs"]  # per block kind, within dynamo's recompile limit
        assert eager["graphs"] == 0
        for got, want in zip(compiled["losses"], eager["losses"]):
            assert abs(got - want) < TOL * abs(want), (rank, compiled["losses"], eager["losses"])
        assert _max_error(compiled["grads"], eager["grads"]) < TOL, rank
