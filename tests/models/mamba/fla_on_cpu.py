"""FLA's real Triton kernels on CPU: ``TRITON_INTERPRET=1`` plus four patches, then the fused
Mamba op (``scan="fla"``: FLA's ``causal_conv1d`` and ``chunk_simple_gla``) and the fused gated
norm (FLA's gated group RMSNorm) against the pure-PyTorch core and norm in float64.

Run as a script in a fresh process (``python -m tests.models.mamba.fla_on_cpu``): the environment
variable must be set before triton and FLA import, and the patches change triton's interpreter
for the whole process. It prints one JSON object: per case, the relative error (max-normalized)
of FLA in float32 and of the pure core in float32, each against the pure core in float64, for the
outputs, the final states and every input's gradient (FLA's backward kernels included); and for
the tiny hybrid compiled with its Mamba layers on FLA's kernels, the graph breaks and the loss's
and every parameter gradient's errors; and the fused op's backward by its two routes on FLA's kernels
(``run_routes``: FLA's backward alone against autograd through FLA's forward, the route before).

Why the patches (triton 3.6, fla-core 0.6.0):

- the autotuner benchmarks its configs through the active driver, and a CPU has none: a
  stand-in driver times every config alike without running it (a benchmark run would launch each
  kernel twice on its first call), and only one config is run: the one with the widest
  blocks (the product of its integer meta-parameters; ties keep the first), since the interpreter
  runs every program of the grid one after another in Python, and wider blocks mean fewer
  programs (the conv's 16-channel blocks made its grid six times larger). A GPU's autotuner may
  pick any of the configs: each computes the same thing;
- the interpreter's ``tensor.__index__`` needs a 0-d array, and FLA's ``range(NT)`` over a length
  loaded from ``cu_seqlens`` is a one-element array: take its element;
- the interpreter hands out loop indices as Python ints, and FLA's kernels call ``.to(tl.int64)``
  on them (compiled Triton's loop indices are tensors): an int with that method;
- the interpreter patches ``triton.language`` again at every device-function call inside a
  kernel (a fifth of the time); inside a kernel whose launch patched the same modules, skip it.

None of them changes what a kernel computes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"


def _patch_triton() -> None:
    import triton.runtime.driver  # noqa: F401  (the package exports a DriverConfig under the same name)
    import triton.runtime.interpreter as interpreter

    class CPUDriver:
        def get_benchmarker(self):
            def bench(fn, quantiles=None, **kwargs):
                return [1.0] * len(quantiles) if quantiles else 1.0
            return bench

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    config = sys.modules["triton.runtime.driver"].driver
    config.set_active(CPUDriver())
    config._default = config._active
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def widest_blocks(self, kwargs):  # the fewest programs to interpret; any config is one a GPU may pick
        blocks = lambda config: math.prod(v for v in config.kwargs.values() if type(v) is int)  # noqa: E731
        return [max(prune(self, kwargs), key=blocks)]  # ties (warps, stages, precision): the first

    Autotuner.prune_configs = widest_blocks

    class LoopIndex(int):
        def to(self, *args, **kwargs):
            return self

    def loop_range(*args):
        return (LoopIndex(i) for i in range(*(int(a) for a in args)))

    patch_tensor, patch_lang = interpreter._patch_lang_tensor, interpreter._patch_lang

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched: set = set()  # the language modules patched for the kernel now interpreted

    def patched_lang(fn):
        fn.__globals__["range"] = loop_range
        langs = {id(v) for v in fn.__globals__.values() if v is interpreter.tl or v is interpreter.tl.core}
        if langs and langs <= patched:  # a device function of that kernel: patching them again only costs time
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        restore = scope.restore

        def restore_and_forget():
            patched.clear()
            restore()
        scope.restore = restore_and_forget
        patched.update(langs)
        return scope

    interpreter._patch_lang_tensor = patched_tensor
    interpreter._patch_lang = patched_lang


def _relative(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _case(groups: int, with_states: bool, seed: int, saturated: bool = False) -> tuple[dict, dict, dict]:
    """``(inputs by name, states keywords but the initial states and histories, sizes)`` of a case:
    three documents, one over FLA's 64-token chunk edge, one of 5. ``saturated``: token 3's ``dt``
    saturates the softplus (1e6, at ``A = -e^2``: ``dt A`` ~ -7e6) among steps of about -5e-2."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    heads, head_dim, state, kernel, tokens = 2, 16, 16, 4, 80
    width = heads * head_dim + 2 * groups * state
    cu = torch.tensor([0, 66, 71, 80])  # three documents: one over FLA's 64-token chunk edge, one of 5
    base = dict(xBC=torch.randn(1, tokens, width, generator=gen), dt=torch.randn(1, tokens, heads, generator=gen) - 1,
                conv_weight=0.5 * torch.randn(width, kernel, generator=gen),
                conv_bias=0.1 * torch.randn(width, generator=gen),
                dt_bias=0.5 * torch.randn(heads, generator=gen), A_log=torch.rand(heads, generator=gen).log(),
                D=torch.randn(heads, generator=gen))
    if saturated:
        base["dt"][:, 3] = 1e6
        base["A_log"].fill_(2.0)
    if with_states:
        base.update(conv_history=torch.randn(3, kernel - 1, width, generator=gen),
                    init_states=0.3 * torch.randn(3, heads, head_dim, state, generator=gen))
    states = dict(init_at=torch.tensor([0, -1, 71]), final_at=cu[1:] - 1) if with_states else {}  # doc 2: zeros
    return base, states, dict(head_dim=head_dim, state_size=state, cu_docs=cu)


def _fused_args(leaves: dict, states: dict) -> tuple[list, dict]:
    """``fused_conv_scan``'s tensors and state keywords from a case's leaves."""
    args = [leaves[name] for name in ("xBC", "dt", "conv_weight", "conv_bias", "dt_bias", "A_log", "D")]
    if states:
        states = dict(states, init_states=leaves["init_states"], conv_history=leaves["conv_history"])
    return args, states


def run_case(groups: int, with_states: bool, seed: int, saturated: bool = False) -> dict:
    """``{quantity: [FLA fp32 error, pure fp32 error]}`` against the pure core in float64."""
    import torch

    from hybridpar.models.mamba.core import mamba_conv_scan
    from hybridpar.models.mamba.fused_op import fused_conv_scan

    base, given, sizes = _case(groups, with_states, seed, saturated)
    results: dict = {}
    for dtype in (torch.float64, torch.float32):
        leaves = {name: t.to(dtype).requires_grad_() for name, t in base.items()}
        args, states = _fused_args(leaves, given)
        runs = {"pure": lambda: mamba_conv_scan(*args, **sizes, chunk_size=64, **states)}
        if dtype == torch.float32:
            runs["fla"] = lambda: fused_conv_scan(*args, **sizes, scan="fla", **states)
        for kernel_name, run in runs.items():
            out = run()
            outs = list(out) if isinstance(out, tuple) else [out]
            weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)
                       for o in outs]
            grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), list(leaves.values()))
            names = ["y", "final_states"][:len(outs)] + [f"grad {name}" for name in leaves]
            results[kernel_name, dtype] = dict(zip(names, outs + list(grads)))
    reference = results["pure", torch.float64]
    return {name: [_relative(results["fla", torch.float32][name], want),
                   _relative(results["pure", torch.float32][name], want)] for name, want in reference.items()}


@contextlib.contextmanager
def counting_launches():
    """Within the block, every Triton kernel launch counted by the kernel's name (a ``Counter``)."""
    from collections import Counter

    from triton.runtime.interpreter import InterpretedFunction

    launches, run = Counter(), InterpretedFunction.run

    def counted(self, *args, warmup, **kwargs):
        launches[self.fn.__name__] += not warmup
        return run(self, *args, warmup=warmup, **kwargs)

    InterpretedFunction.run = counted
    try:
        yield launches
    finally:
        InterpretedFunction.run = run


def backward_routes(module, output_kernel: str, run, leaves: dict, stand_in: str) -> dict:
    """One backward call of a fused op on FLA's kernels by each route: ``"direct"`` (``"fla"``: FLA's
    backward alone) and ``"autograd"`` (``stand_in``: the same kernels registered without a backward,
    so autograd through FLA's forward, the route before). ``run(name) -> loss`` runs the forward;
    ``output_kernel`` is the forward's output function ``module`` looks up (counted by wrapping it).
    ``{"same_bits": every gradient equal bit for bit, "forward_output_calls": {route: calls within the
    backward}, "launches": {route: {Triton kernel: launches within the backward}}}``."""
    import torch

    calls, forward = [], getattr(module, output_kernel)
    setattr(module, output_kernel, lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    found = {}
    try:
        for route, name in (("direct", "fla"), ("autograd", stand_in)):
            loss = run(name)
            calls.clear()
            with counting_launches() as launches:
                grads = torch.autograd.grad(loss, list(leaves.values()))
            found[route] = grads, len(calls), dict(sorted(launches.items()))
    finally:
        setattr(module, output_kernel, forward)
    same = all(torch.equal(a, b) for a, b in zip(found["direct"][0], found["autograd"][0]))
    return {"same_bits": same, "forward_output_calls": {route: f[1] for route, f in found.items()},
            "launches": {route: f[2] for route, f in found.items()}}


def run_routes(seed: int = 4) -> dict:
    """``backward_routes`` of the fused Mamba op with the CP ``state`` strategy's states (2 groups), both
    outputs seeded, counting ``chunk_fwd_o`` (``chunk_simple_gla``'s output kernel)."""
    import fla.ops.simple_gla.chunk as chunk
    import torch
    from fla.modules.causal_conv1d import causal_conv1d

    from hybridpar.models.mamba.fused_op import fused_conv_scan, register_scan

    register_scan("fla_autograd", chunk.chunk_simple_gla, causal_conv1d)
    base, given, sizes = _case(2, True, seed)
    leaves = {name: t.requires_grad_() for name, t in base.items()}
    args, states = _fused_args(leaves, given)

    def run(scan):
        y, final = fused_conv_scan(*args, **sizes, scan=scan, **states)
        return sum((t * torch.randn(t.shape, generator=torch.Generator().manual_seed(7))).sum() for t in (y, final))

    return backward_routes(chunk, "chunk_fwd_o", run, leaves, "fla_autograd")


def run_gated_norm(seed: int = 3) -> dict:
    """Mamba2's gated group norm ``rmsnorm(y * silu(z))`` through FLA's kernels
    (``models/norm_kernels.py``: ``layer_norm_fwd``/``layer_norm_bwd`` of ``fla.modules.norm.layernorm_gated``)
    against the pure norm in float64, the gate a strided view of a wider projection as in the mixer:
    ``{"kernel": the norm kernel chosen, "errors": {quantity: [FLA fp32 error, pure fp32 error]}}``
    (as in ``run_case``)."""
    import torch

    from hybridpar.models.blocks import gated_rms_norm
    from hybridpar.models.mamba.fused import use_stand_in
    from hybridpar.models.norm_kernels import norm_kernel

    gen = torch.Generator().manual_seed(seed)
    rows, width, group = 37, 48, 24  # two groups; 24 channels: FLA's block of 32 is masked at its edge
    base = dict(x=torch.randn(2, rows, width, generator=gen), projection=torch.randn(2, rows, 2 * width + 5, generator=gen),
                weight=1 + 0.3 * torch.randn(width, generator=gen))
    dy = torch.randn(2, rows, width, generator=gen, dtype=torch.float64)
    results = {}
    for name, dtype in (("reference", torch.float64), ("pure", torch.float32), ("fla", torch.float32)):
        leaves = {k: t.to(dtype).requires_grad_() for k, t in base.items()}
        gate = leaves["projection"][..., width + 3:2 * width + 3]  # a view: rows strided by the projection
        with use_stand_in("fla", family="gated_norm") if name == "fla" else contextlib.nullcontext():
            y = gated_rms_norm(leaves["x"], gate, leaves["weight"], group, 1e-5)
        grads = torch.autograd.grad((y * dy.to(y.dtype)).sum(), list(leaves.values()))
        results[name] = {"y": y, **{f"grad {k}": g for k, g in zip(leaves, grads)}}
        if name == "fla":
            with use_stand_in("fla", family="gated_norm"):
                kernel = norm_kernel("gated_norm", (leaves["x"], gate, leaves["weight"]), group)
    reference = results["reference"]
    return {"kernel": kernel, "errors": {k: [_relative(results["fla"][k], want), _relative(results["pure"][k], want)]
                                         for k, want in reference.items()}}


def run_model() -> dict:
    """The tiny hybrid in float32 on packed rows, blocks compiled (aot_eager), its Mamba layers on
    FLA's kernels: graph breaks, and the loss's and every gradient's error against the eager pure
    model in float64 (``[FLA fp32, pure fp32]`` as in ``run_case``)."""
    import copy

    import torch
    from torch._dynamo.utils import counters

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.models.mamba.fused import use_stand_in
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    torch.manual_seed(0)
    # one block of each kind (tiny's pattern is M*-M-: a second Mamba layer only doubles the interpreted kernels;
    # stacked fused layers: tests/models/mamba/test_fused.py); 2 heads: 2 groups
    base = HybridLM(HybridConfig.from_preset("tiny", pattern="M*-", mamba_num_heads=2, dtype=torch.float64))
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 30, 35, 64], dtype=torch.int32))
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    weight = torch.randn(1, 64, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    runs = {}
    for name, dtype, fused in (("reference", torch.float64, False), ("pure", torch.float32, False),
                               ("fla", torch.float32, True)):
        model = parallelize(copy.deepcopy(base).to(dtype), ParallelDims(), compile="aot_eager" if fused else False)
        counters.clear()
        with use_stand_in("fla") if fused else contextlib.nullcontext():
            loss = (model(ids, packed=packed) * weight.to(dtype)).sum()
            loss.backward()
        runs[name] = {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}
        if fused:
            breaks = sum(counters["graph_break"].values())
    errors = {name: [_relative(runs["fla"][name], want), _relative(runs["pure"][name], want)]
              for name, want in runs["reference"].items()}
    return {"graph_breaks": breaks, "errors": errors}


def main() -> None:
    _patch_triton()
    import fla

    cases = {"1 group, no states": (1, False, 0), "2 groups, CP states": (2, True, 1),
             "2 groups, CP states, saturated dt": (2, True, 5, True)}
    report = {"fla": fla.__version__, "cases": {name: run_case(*args) for name, args in cases.items()},
              "gated_norm": run_gated_norm(), "model": run_model(), "routes": run_routes()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
