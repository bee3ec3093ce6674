"""FLA's real ``chunk_kda`` Triton kernels (forward and backward) on CPU under ``TRITON_INTERPRET=1``,
behind hybridpar's KDA core, against the pure-PyTorch core in float64.

Run as a script in a fresh process (``python -m tests.models.linear.fla_kda_on_cpu``), with the
``fla-interpret`` folder on the path, as ``fla_gdn_on_cpu.py`` (``tests/models/mamba/fla_on_cpu.py``'s
triton patches: none changes what a kernel computes). Prints one JSON object:

- ``contract``: our written-out contract (``kda_contract.py``, the stand-in of the float64 tests)
  against FLA's ``naive_recurrent_kda`` in float32, outputs and final states;
- ``cases``: per case, ``{quantity: [FLA fp32 error, pure fp32 error]}`` against the pure rule in
  float64 (max-normalized): ``segments`` is the CP ``state`` strategy's call
  (``parallel/context/recurrent/kda.segment_kda_rule``: three padded segments, values ``[0 | v]``
  twice as wide as the keys, ``[I | 0]`` entering, final states read) against the pure rule's
  ``states_at`` / ``finals_at``: outputs, final states, every input's gradient;
- ``compiled``: a tiny float32 Kimi Linear (one KDA layer of 2 heads, a dense MLP;
  ``install_kda_core``, so ``kimi_delta_core`` with ``use_stand_in("fla", "kda")``) on a row of 2
  packed documents (19 and 21 tokens), the decoder layer ``torch.compile(backend="aot_eager", fullgraph=True)``: the
  graph breaks and the fused calls (the forward's rule and the backward's, FLA's backward alone);
  ``model_errors``, the next-token cross-entropy and every parameter gradient (``[FLA fp32, pure fp32]``)
  against the eager pure model in float64;
- ``routes``: a rule call's backward by its two routes (``fla_on_cpu.backward_routes``): FLA's backward
  alone (``models/linear/delta_backward.py``) against autograd through FLA's forward.

Most of the time is the interpreter running the backward kernels; the core on FLA's rule is
covered by the model (one KDA layer: stacked fused layers are ``tests/distributed/context/test_fused_kda.py``'s,
with the contract standing in), the rule's states by ``segments``.
"""

from __future__ import annotations

import json

from tests.models.linear.fla_gdn_on_cpu import saturated_case
from tests.models.mamba.fla_on_cpu import _patch_triton, _relative, backward_routes  # TRITON_INTERPRET=1 on import

HEADS, D, KERNEL = 2, 16, 4  # the model's heads; the segments case runs one head
DOCS = [0, 19, 40]  # the model's row: two documents, a boundary inside FLA's 64-token chunk


def _probe(shape, dtype):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)


def contract_against_fla_naive() -> dict:
    import torch
    from fla.ops.kda.naive import naive_recurrent_kda

    from tests.models.linear.kda_contract import kda_contract

    gen = torch.Generator().manual_seed(3)
    tokens = 23
    q, k = (torch.nn.functional.normalize(torch.randn(1, tokens, HEADS, D, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, tokens, HEADS, D, generator=gen)
    g = -torch.rand(1, tokens, HEADS, D, generator=gen)
    beta = torch.rand(1, tokens, HEADS, generator=gen)
    h0 = torch.randn(1, HEADS, D, D, generator=gen)
    want_o, want_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = kda_contract(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                        cu_seqlens=torch.tensor([0, tokens]))
    return {"o": _relative(o, want_o), "final_states": _relative(s, want_s)}


def segments_case() -> dict:
    """Three chunk-padded segments (zeros after each), values ``[0 | v]`` (``2d`` columns), ``[I | 0]``
    entering each."""
    import torch

    from hybridpar.parallel.context.recurrent.kda import segment_kda_rule

    chunk, lengths = 16, [20, 1, 16]  # chunks 0-1, 2, 3
    starts, ends, padded = [0, 2, 3], [1, 2, 3], 64
    chunk_segment = torch.tensor([0, 0, 1, 2])
    real = torch.zeros(padded, dtype=torch.bool)
    for start, length in zip(starts, lengths):
        real[start * chunk:start * chunk + length] = True
    gen = torch.Generator().manual_seed(4)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=gen), dim=-1)  # noqa: E731
    h = 1
    base = dict(q=unit(1, padded, h, D), k=unit(1, padded, h, D), v=torch.randn(1, padded, h, D, generator=gen),
                g=-torch.rand(1, padded, h, D, generator=gen), beta=torch.rand(1, padded, h, generator=gen))
    base = {n: t * real.view(1, -1, *[1] * (t.dim() - 2)) for n, t in base.items()}
    results = {}
    for name, dtype, kernel in (("reference", torch.float64, "pure"), ("pure", torch.float32, "pure"),
                                ("fla", torch.float32, "fla")):
        leaves = {n: t.to(dtype).requires_grad_() for n, t in base.items()}
        v = torch.cat([torch.zeros_like(leaves["v"]), leaves["v"]], dim=-1)
        identity = torch.eye(D, 2 * D, dtype=dtype).expand(len(starts), h, D, 2 * D)
        o, final = segment_kda_rule(leaves["q"], leaves["k"], v, leaves["g"], leaves["beta"], identity, chunk_segment,
                                    starts, ends, chunk, kernel, dtype)
        loss = (o * _probe(o.shape, dtype)).sum() + (final * _probe(final.shape, dtype)).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        results[name] = {"o": o, "final_states": final, **{f"grad {n}": d for n, d in zip(leaves, grads)}}
    return {q: [_relative(results["fla"][q], want), _relative(results["pure"][q], want)]
            for q, want in results["reference"].items()}


def compiled_case() -> dict:
    import contextlib
    import copy
    import warnings

    import torch
    import transformers as hf
    from torch._dynamo.utils import counters

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mixers.kda import install_kda_core
    from hybridpar.models.linear.delta_backward import kda_backward
    from hybridpar.models.linear.kda_fused import fla_kda, register_kda_rule
    from hybridpar.models.mamba.fused import use_stand_in

    calls = []
    register_kda_rule("fla_counted", lambda *a, **kw: calls.append(1) or fla_kda()[0](*a, **kw),
                      backward=lambda *a, **kw: calls.append(1) or kda_backward()(*a, **kw))
    config = hf.KimiLinearConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, linear_head_dim=D, linear_num_heads=HEADS, linear_conv_kernel_dim=KERNEL,
        layer_types=["linear_attention"], mlp_layer_types=["dense"], use_cache=False, pad_token_id=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = hf.KimiLinearForCausalLM(config).float().train()
    with torch.no_grad():
        for param in base.parameters():
            param.add_(0.05 * torch.randn_like(param))
    install_kda_core(base)
    ids = torch.randint(0, 97, (1, DOCS[-1]), generator=torch.Generator().manual_seed(1))
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    runs, breaks = {}, None
    for name, dtype, fused in (("reference", torch.float64, False), ("pure", torch.float32, False),
                               ("fla", torch.float32, True)):
        model = copy.deepcopy(base).to(dtype)
        if fused:
            torch._dynamo.reset()
            for layer in model.model.layers:
                layer.compile(backend="aot_eager", fullgraph=True)
        counters.clear()
        with use_stand_in("fla_counted", family="kda") if fused else contextlib.nullcontext():
            logits = model(input_ids=ids, position_ids=packed.position_ids, packed_seq_params=packed).logits
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])  # no cancelling sum
            loss.backward()
        runs[name] = {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}
        if fused:
            breaks = sum(counters["graph_break"].values())
    errors = {name: [_relative(runs["fla"][name], want), _relative(runs["pure"][name], want)]
              for name, want in runs["reference"].items()}
    return {"graph_breaks": breaks, "fused_calls": len(calls)}, errors


def routes_case() -> dict:
    """``backward_routes`` of one rule call: two documents (19 and 21 tokens), grouped values (1 key head,
    2 value heads), initial states entering and final states leaving, both seeded; counting
    ``chunk_gla_fwd_o_gk`` (``chunk_kda``'s output kernel)."""
    import fla.ops.kda.chunk as chunk
    import fla.ops.kda.chunk_fwd as chunk_fwd
    import torch

    from hybridpar.models.linear.kda_fused import fused_kda_rule, register_kda_rule

    register_kda_rule("fla_autograd", chunk.chunk_kda)  # FLA's kernels, no backward of their own
    gen = torch.Generator().manual_seed(5)
    tokens, cu = DOCS[-1], torch.tensor(DOCS)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=gen), dim=-1)  # noqa: E731
    leaves = {n: t.requires_grad_() for n, t in dict(
        q=unit(1, tokens, 1, D), k=unit(1, tokens, 1, D), v=torch.randn(1, tokens, 2, D, generator=gen),
        g=-torch.rand(1, tokens, 2, D, generator=gen), beta=torch.rand(1, tokens, 2, generator=gen),
        initial_state=0.5 * torch.randn(len(DOCS) - 1, 2, D, D, generator=gen)).items()}

    def run(rule):
        o, final = fused_kda_rule(*list(leaves.values())[:5], cu_seqlens=cu, initial_state=leaves["initial_state"],
                                  output_final_state=True, rule=rule)
        return (o * _probe(o.shape, o.dtype)).sum() + (final * _probe(final.shape, final.dtype)).sum()

    return backward_routes(chunk_fwd, "chunk_gla_fwd_o_gk", run, leaves, "fla_autograd")


def main() -> None:
    _patch_triton()
    import fla

    compiled, model_errors = compiled_case()
    report = {"fla": fla.__version__, "contract": contract_against_fla_naive(),
              "cases": {"segments": segments_case(), "saturated": saturated_case("kda")}, "compiled": compiled,
              "model_errors": model_errors, "routes": routes_case()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
