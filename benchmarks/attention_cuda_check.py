"""CUDA check: every fused attention kernel against the pure-PyTorch core, on packed rows.

For each dtype (bfloat16, float32) and layout it runs ``attention_core(..., kernel=K)`` for
``K`` in {varlen, flex} and the pure-PyTorch ``blockwise`` core on the same inputs, and prints
the largest differences of the output and of dq, dk, dv (relative to the largest reference
value), forward+backward time (CUDA events, median of 5 after 2 warm-ups) and the peak memory
the step adds (``torch.cuda.max_memory_allocated``). Layouts:

- ``sequence``: one process (and ulysses): a packed row of several documents in sequence order;
- ``allgather``: rank 1 of cp=4: zigzag-ordered local queries against all keys in sequence
  order, as ``AllGatherAttention`` calls the core (only FlexAttention and blockwise apply).

It also prints which kernel ``attention_core`` picks by itself, and exits 1 when a kernel fails or
is off the reference past ``TOLERANCE``; 0 with a message on a machine without CUDA. torch 2.11's
``varlen_attn`` takes no grouped heads: the default 12/4 heads check the repeat ``attention_core``
does there.

    python benchmarks/attention_cuda_check.py [--tokens 16384] [--docs 7] [--heads 12 4] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import harness  # noqa: F401  (this checkout's hybridpar first)
import torch
from cuda_check import packed as growing_documents

from hybridpar.models.attention.kernels import attention_core, choose_kernel
from hybridpar.models.attention.layout import AttentionLayout
from hybridpar.models.attention.mixer import sequence_layout
from hybridpar.parallel.context.zigzag import localize


TOLERANCE = {torch.bfloat16: 5e-2, torch.float32: 1e-2}  # of the largest reference value; fp32 flex may use TF32


def layouts(tokens: int, docs: int, device) -> dict[str, tuple[AttentionLayout, torch.Tensor]]:
    """``name -> (layout, query token indices)`` for a row of ``docs`` documents (lengths multiples of 8)."""
    packed = growing_documents(tokens, docs, "cpu")
    packed.seq_idx, packed.position_ids = packed.seq_idx.to(device), packed.position_ids.to(device)
    sequence = sequence_layout(packed, tokens, device)
    local = localize(packed, 4, 1)  # rank 1 of cp=4
    query_index = local.cp.local_indices.to(device)
    allgather = AttentionLayout(query_index, local.seq_idx[0].to(device), sequence.k_pos, sequence.k_doc)
    return {"sequence": (sequence, torch.arange(tokens, device=device)), "allgather": (allgather, query_index)}


def timed_step(fn, q, k, v, grad_out):
    """Output and grads of one forward+backward; median ms over 5 runs; peak bytes it adds."""
    def step():
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        out.backward(grad_out)
        return out

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() - base
    return [out.detach().float(), *(t.grad.float() for t in (q, k, v))], statistics.median(times), peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--docs", type=int, default=7)
    parser.add_argument("--heads", type=int, nargs=2, default=[12, 4], metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("attention_cuda_check: no CUDA device here; nothing to check (run it on a GPU machine).")
        return 0
    device = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}, tokens {args.tokens}, "
          f"docs {args.docs}, heads {args.heads[0]}/{args.heads[1]} x {args.head_dim}")
    print(f"{'dtype':9} {'layout':10} {'kernel':10} {'auto':6} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9} "
          f"{'ms':>9} {'peak MiB':>9}")
    failures = 0
    for dtype in (torch.bfloat16, torch.float32):
        for name, (layout, query_index) in layouts(args.tokens, args.docs, device).items():
            gen = torch.Generator(device=device).manual_seed(0)
            rows = query_index.numel()
            q = torch.randn(1, rows, args.heads[0], args.head_dim, device=device, dtype=dtype, generator=gen)
            k, v = (torch.randn(1, args.tokens, args.heads[1], args.head_dim, device=device, dtype=dtype,
                                generator=gen) for _ in "kv")
            grad_out = torch.randn_like(q)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            auto = choose_kernel(q, layout)[0]
            reference, ref_ms, ref_peak = timed_step(
                lambda q, k, v: attention_core(q, k, v, layout, kernel="blockwise"), q, k, v, grad_out)
            scale = [r.abs().max().item() for r in reference]
            print(f"{str(dtype)[6:]:9} {name:10} {'blockwise':10} {'*' if auto == 'blockwise' else '':6} "
                  f"{'-':>9} {'-':>9} {'-':>9} {'-':>9} {ref_ms:9.2f} {ref_peak / 2**20:9.1f}")
            for kernel in ("varlen", "flex"):
                if kernel == "varlen" and (not layout.sequence_ordered or dtype == torch.float32):
                    continue  # flash has no float32; varlen needs sequence order
                try:
                    got, ms, peak = timed_step(lambda q, k, v: attention_core(q, k, v, layout, kernel=kernel),
                                               q, k, v, grad_out)
                except Exception as error:  # noqa: BLE001 - report and go on
                    failures += 1
                    print(f"{str(dtype)[6:]:9} {name:10} {kernel:10} FAILED: {type(error).__name__}: {error}")
                    continue
                errors = [(g - r).abs().max().item() / s for g, r, s in zip(got, reference, scale)]
                wrong = max(errors) > TOLERANCE[dtype]
                failures += wrong
                print(f"{str(dtype)[6:]:9} {name:10} {kernel:10} {'*' if auto == kernel else '':6} "
                      + " ".join(f"{e:9.2e}" for e in errors) + f" {ms:9.2f} {peak / 2**20:9.1f}"
                      + (f"  WRONG: over {TOLERANCE[dtype]:.0e}" if wrong else ""))
    print("errors: max |kernel - blockwise| / max |blockwise| per tensor (a kernel fails past "
          f"{TOLERANCE[torch.bfloat16]:.0e} in bf16, {TOLERANCE[torch.float32]:.0e} in fp32, where a wrong mask or head "
          "mapping gives errors of order 1); '*': the kernel attention_core picks itself")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
