"""FLA's real ``chunk_gated_delta_rule`` Triton kernels (forward and backward) on CPU under
``TRITON_INTERPRET=1``, behind hybridpar's gated DeltaNet core, against the pure-PyTorch core in float64.

Run as a script in a fresh process (``python -m tests.models.linear.fla_gdn_on_cpu``), with the
``fla-interpret`` folder on the path, as ``tests/models/mamba/fla_on_cpu.py`` (whose triton
patches it applies: none changes what a kernel computes). Prints one JSON object:

- ``contract``: our written-out contract (``gdn_contract.py``, the stand-in of the float64 tests)
  against FLA's ``naive_recurrent_gated_delta_rule`` in float32, outputs and final states;
- ``cases``: per case, ``{quantity: [FLA fp32 error, pure fp32 error]}`` against the pure core in
  float64 (max-normalized): ``core`` is ``gated_delta_core`` on two rows of 2 packed documents
  (grouped values: 1 key head, 2 value heads) with FLA's rule (``use_stand_in("fla", "gdn")``),
  output and every input's gradient; ``states`` is ``fused_gated_delta_rule`` with an initial state
  entering and a final state leaving every document (the ``state`` CP strategy's call), against
  the pure rule per document, outputs, final states and every input's gradient; ``segments`` is
  that call exactly (``parallel/context/recurrent/gdn.segment_rule``: padded segments, values ``[0 | v]``
  twice as wide as the keys, ``[I | 0]`` entering), against the pure rule's ``states_at`` /
  ``finals_at``;
- ``routes``: the ``states`` call's backward by its two routes (``fla_on_cpu.backward_routes``): FLA's
  backward alone (``models/linear/delta_backward.py``) against autograd through FLA's forward.
"""

from __future__ import annotations

import json

from tests.models.mamba.fla_on_cpu import _patch_triton, _relative, backward_routes  # TRITON_INTERPRET=1 on import

HEADS_K, HEADS_V, DK, DV, KERNEL = 1, 2, 16, 16, 4
# the core case's rows: 2 documents a row, the second of 5 tokens; flattened, the stream has 4 documents, two
# of them between others (FLA's work grows with the documents: each is a sequence of its own)
ROW, ROW_DOCS = 24, [0, 19, 24]


def _probe(shape, dtype):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)


def contract_against_fla_naive() -> dict:
    import torch
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    from tests.models.linear.gdn_contract import gated_delta_contract

    gen = torch.Generator().manual_seed(3)
    tokens, heads = 23, 2
    q, k = (torch.nn.functional.normalize(torch.randn(1, tokens, heads, DK, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, tokens, heads, DV, generator=gen)
    g = -torch.rand(1, tokens, heads, generator=gen)
    beta = torch.rand(1, tokens, heads, generator=gen)
    h0 = torch.randn(1, heads, DK, DV, generator=gen)
    want_o, want_s = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    o, s = gated_delta_contract(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                cu_seqlens=torch.tensor([0, tokens]))
    return {"o": _relative(o, want_o), "final_states": _relative(s, want_s)}


def _core_inputs():
    import torch

    gen = torch.Generator().manual_seed(1)
    width = 2 * HEADS_K * DK + HEADS_V * DV
    return dict(mixed_qkv=torch.randn(2, ROW, width, generator=gen), a=torch.randn(2, ROW, HEADS_V, generator=gen),
                b=torch.randn(2, ROW, HEADS_V, generator=gen), conv_weight=0.5 * torch.randn(width, KERNEL, generator=gen),
                conv_bias=0.1 * torch.randn(width, generator=gen), A_log=torch.rand(HEADS_V, generator=gen).log(),
                dt_bias=0.5 * torch.randn(HEADS_V, generator=gen))


def core_case() -> dict:
    import torch

    from hybridpar.models.linear.gdn_core import gated_delta_core
    from hybridpar.models.mamba.core import row_documents
    from hybridpar.models.mamba.fused import use_stand_in

    base = _core_inputs()
    cu_docs = row_documents(torch.tensor(ROW_DOCS), 2, ROW, "cpu")
    results = {}
    for name, dtype, fused in (("reference", torch.float64, False), ("pure", torch.float32, False),
                               ("fla", torch.float32, True)):
        leaves = {n: t.to(dtype).requires_grad_() for n, t in base.items()}
        with use_stand_in("fla", family="gdn") if fused else _nothing():
            o = gated_delta_core(*leaves.values(), head_k_dim=DK, head_v_dim=DV, chunk_size=16, cu_docs=cu_docs)
            grads = torch.autograd.grad((o * _probe(o.shape, dtype)).sum(), list(leaves.values()))
        results[name] = {"o": o, **{f"grad {n}": d for n, d in zip(leaves, grads)}}
    return {q: [_relative(results["fla"][q], want), _relative(results["pure"][q], want)]
            for q, want in results["reference"].items()}


STATES_CU = [0, 30, 35, 64]  # the states case's documents


def _states_inputs() -> dict:
    import torch

    gen = torch.Generator().manual_seed(2)
    tokens = STATES_CU[-1]
    return dict(q=torch.nn.functional.normalize(torch.randn(1, tokens, HEADS_K, DK, generator=gen), dim=-1),
                k=torch.nn.functional.normalize(torch.randn(1, tokens, HEADS_K, DK, generator=gen), dim=-1),
                v=torch.randn(1, tokens, HEADS_V, DV, generator=gen), g=-torch.rand(1, tokens, HEADS_V, generator=gen),
                beta=torch.rand(1, tokens, HEADS_V, generator=gen),
                initial_state=0.5 * torch.randn(len(STATES_CU) - 1, HEADS_V, DK, DV, generator=gen))


def states_case() -> dict:
    import torch

    from hybridpar.models.linear.gated_delta import chunk_gated_delta_rule
    from hybridpar.models.linear.gdn_fused import fused_gated_delta_rule

    cu, base = STATES_CU, _states_inputs()
    results = {}
    for name, dtype in (("reference", torch.float64), ("pure", torch.float32), ("fla", torch.float32)):
        leaves = {n: t.to(dtype).requires_grad_() for n, t in base.items()}
        if name == "fla":
            o, final = fused_gated_delta_rule(*list(leaves.values())[:5], cu_seqlens=torch.tensor(cu),
                                              initial_state=leaves["initial_state"], output_final_state=True)
        else:  # the pure rule, one document at a time
            parts = [chunk_gated_delta_rule(*(t[:, s:e] for t in list(leaves.values())[:5]), chunk_size=16,
                                            initial_state=leaves["initial_state"][n:n + 1], output_final_state=True)
                     for n, (s, e) in enumerate(zip(cu[:-1], cu[1:]))]
            o, final = torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts])
        loss = (o * _probe(o.shape, dtype)).sum() + (final * _probe(final.shape, dtype)).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        results[name] = {"o": o, "final_states": final, **{f"grad {n}": d for n, d in zip(leaves, grads)}}
    return {q: [_relative(results["fla"][q], want), _relative(results["pure"][q], want)]
            for q, want in results["reference"].items()}


def segments_case() -> dict:
    """``parallel/context/recurrent/gdn.segment_rule`` as the ``state`` strategy calls it: three chunk-padded
    segments (zeros after each), values ``[0 | v]`` (``dk + dv`` columns), ``[I | 0]`` entering each."""
    import torch

    from hybridpar.parallel.context.recurrent.gdn import segment_rule

    chunk, lengths = 16, [20, 1, 16]  # chunks 0-1, 2, 3
    starts, ends, padded = [0, 2, 3], [1, 2, 3], 64
    chunk_segment = torch.tensor([0, 0, 1, 2])
    real = torch.zeros(padded, dtype=torch.bool)
    for start, length in zip(starts, lengths):
        real[start * chunk:start * chunk + length] = True
    gen = torch.Generator().manual_seed(4)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=gen), dim=-1)  # noqa: E731
    base = dict(q=unit(1, padded, HEADS_K, DK), k=unit(1, padded, HEADS_K, DK), v=torch.randn(1, padded, HEADS_V, DV, generator=gen),
                g=-torch.rand(1, padded, HEADS_V, generator=gen), beta=torch.rand(1, padded, HEADS_V, generator=gen))
    base = {n: t * real.view(1, -1, *[1] * (t.dim() - 2)) for n, t in base.items()}
    results = {}
    for name, dtype, kernel in (("reference", torch.float64, "pure"), ("pure", torch.float32, "pure"),
                                ("fla", torch.float32, "fla")):
        leaves = {n: t.to(dtype).requires_grad_() for n, t in base.items()}
        v = torch.cat([torch.zeros_like(leaves["v"]), leaves["v"]], dim=-1)
        identity = torch.eye(DK, DK + DV, dtype=dtype).expand(len(starts), HEADS_V, DK, DK + DV)
        o, final = segment_rule(leaves["q"], leaves["k"], v, leaves["g"], leaves["beta"], identity, chunk_segment,
                                starts, ends, chunk, kernel, dtype)
        loss = (o * _probe(o.shape, dtype)).sum() + (final * _probe(final.shape, dtype)).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        results[name] = {"o": o, "final_states": final, **{f"grad {n}": d for n, d in zip(leaves, grads)}}
    return {q: [_relative(results["fla"][q], want), _relative(results["pure"][q], want)]
            for q, want in results["reference"].items()}


def saturated_case(family: str) -> dict:
    """A delta rule (``"gdn"``: ``g [1, T, H]``, ``"kda"``: ``g [1, T, H, dk]``) through ``rule_on_rows`` after a
    saturated decay: token 5's ``g`` is -7e6 among steps of -5e-2 or less; two documents, one over FLA's
    64-token chunk edge. ``{quantity: [FLA fp32 error, pure fp32 error]}`` against the pure rule in float64."""
    import torch

    from hybridpar.models.linear.gated_delta import chunk_gated_delta_rule
    from hybridpar.models.linear.gdn_core import rule_on_rows
    from hybridpar.models.linear.gdn_fused import fused_gated_delta_rule
    from hybridpar.models.linear.kda import chunk_kda_rule
    from hybridpar.models.linear.kda_fused import fused_kda_rule
    from hybridpar.models.mamba.core import row_documents

    tokens, heads = 72, 1  # small: the interpreter runs KDA's backward kernels program by program
    fused, pure, g_shape = {"gdn": (fused_gated_delta_rule, chunk_gated_delta_rule, (1, tokens, heads)),
                            "kda": (fused_kda_rule, chunk_kda_rule, (1, tokens, heads, DK))}[family]
    gen = torch.Generator().manual_seed(3)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=gen), dim=-1)  # noqa: E731
    base = dict(q=unit(1, tokens, heads, DK), k=unit(1, tokens, heads, DK), v=torch.randn(1, tokens, heads, DV, generator=gen),
                g=-0.05 * torch.rand(*g_shape, generator=gen), beta=torch.rand(1, tokens, heads, generator=gen))
    base["g"][:, 5] = -7e6
    cu_docs = row_documents(torch.tensor([0, 66, tokens]), 1, tokens, "cpu")
    results = {}
    for name, dtype, kernel in (("reference", torch.float64, "pure"), ("pure", torch.float32, "pure"),
                                ("fla", torch.float32, "fla")):
        leaves = {n: t.to(dtype).requires_grad_() for n, t in base.items()}
        o = rule_on_rows(*leaves.values(), cu_docs, kernel, fused, pure, 16, dtype)
        grads = torch.autograd.grad((o * _probe(o.shape, dtype)).sum(), list(leaves.values()))
        results[name] = {"o": o, **{f"grad {n}": d for n, d in zip(leaves, grads)}}
    return {q: [_relative(results["fla"][q], want), _relative(results["pure"][q], want)]
            for q, want in results["reference"].items()}


def routes_case() -> dict:
    """``backward_routes`` of the ``states`` call (both outputs seeded), counting ``chunk_fwd_o``."""
    import fla.ops.gated_delta_rule.chunk as chunk
    import torch

    from hybridpar.models.linear.gdn_fused import fused_gated_delta_rule, register_rule

    register_rule("fla_autograd", chunk.chunk_gated_delta_rule)  # FLA's kernels, no backward of their own
    leaves = {n: t.requires_grad_() for n, t in _states_inputs().items()}

    def run(rule):
        o, final = fused_gated_delta_rule(*list(leaves.values())[:5], cu_seqlens=torch.tensor(STATES_CU),
                                          initial_state=leaves["initial_state"], output_final_state=True, rule=rule)
        return (o * _probe(o.shape, o.dtype)).sum() + (final * _probe(final.shape, final.dtype)).sum()

    return backward_routes(chunk, "chunk_fwd_o", run, leaves, "fla_autograd")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    _patch_triton()
    import fla

    report = {"fla": fla.__version__, "contract": contract_against_fla_naive(),
              "cases": {"core": core_case(), "states": states_case(), "segments": segments_case(),
                        "saturated": saturated_case("gdn")},
              "routes": routes_case()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
