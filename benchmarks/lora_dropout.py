"""What layout-exact LoRA dropout costs: token-keyed masks (``models/token_dropout.py``) against
``torch.nn.functional.dropout`` on the same input, forward only (the mask is what differs).

For each ``tokens x features`` input (float32, p = 0.1): the median seconds of
``TokenDropout`` with keys set, as the trainer runs it, and of ``F.dropout``, interleaved in one
process, and their ratio. On CUDA the keyed masks run compiled (one kernel); elsewhere eager.

    python benchmarks/lora_dropout.py [--shapes 2048x1024 8192x1024 8192x4096] [--threads 1]
"""

from __future__ import annotations

import argparse

import harness


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["2048x1024", "8192x1024", "8192x4096"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(harness.RESULTS))
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from hybridpar.models.token_dropout import DropoutTokens, TokenDropout, set_dropout_tokens, token_keys

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = {**harness.environment(__file__), "threads": args.threads}
    rows = []
    for shape in args.shapes:
        tokens, features = (int(n) for n in shape.split("x"))
        x = torch.randn(1, tokens, features, device=device)
        holder = torch.nn.Module()
        holder.dropout_tokens = DropoutTokens(seed=0)
        set_dropout_tokens(holder, 1, token_keys(torch.tensor([0]), torch.arange(tokens)))
        keyed = TokenDropout(0.1, "benchmark.lora_dropout", holder.dropout_tokens).train()

        def sync(value):
            if device.type == "cuda":
                torch.cuda.synchronize()
            return value

        samples = harness.interleaved({"keyed": lambda: sync(keyed(x)), "F.dropout": lambda: sync(F.dropout(x, 0.1))},
                                      repeats=args.repeats)
        keyed_s, plain_s = (sorted(samples[k])[len(samples[k]) // 2] for k in ("keyed", "F.dropout"))
        rows.append({"tokens": tokens, "features": features, "keyed_s": keyed_s, "dropout_s": plain_s,
                     "ratio": keyed_s / plain_s})
    lines = harness.header("LoRA dropout: token-keyed masks against F.dropout", meta)
    lines += ["", f"float32, p = 0.1, forward, {args.threads} thread(s); median of {args.repeats} interleaved rounds.", "",
              "| tokens x features | keyed masks (ms) | F.dropout (ms) | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['tokens']} x {r['features']} | {r['keyed_s'] * 1e3:.1f} | {r['dropout_s'] * 1e3:.1f} | "
              f"{r['ratio']:.1f}x |" for r in rows]
    harness.write_results("lora_dropout", {"meta": meta, "rows": rows}, "\n".join(lines), out=args.out)


if __name__ == "__main__":
    main()
