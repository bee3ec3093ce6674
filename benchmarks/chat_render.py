"""What reading chat data costs: milliseconds per conversation of ``data/chat.chat_document``.

A conversation of ``k`` replies becomes one document whose labels are the assistant's tokens. Without
``{% generation %}`` tags, the assistant spans are found by rendering prefixes of the conversation with
the chat template, and each render is a tokenization (most of the cost). ``chat_document`` renders
``2k`` times (the whole conversation; per reply the prefix up to its header and, unless it is the last
message, the prefix through its end of turn). The baseline is the ``1 + 3k`` renders of the rule before
(the prefix through each reply's end of turn, and the prefix to its header both with and without the
generation prompt), timed in the same process on the same tokenizer: a byte-level BPE trained on the
suite's text (``tests/data/bpe.py``) with a ChatML template. Both give the same document (checked).

    python benchmarks/chat_render.py [--replies 1 3 8] [--repeats 5]

Prints a table and writes benchmarks/results/chat_render.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import harness

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.data.bpe

from hybridpar.data.chat import assistant_mask, chat_document  # noqa: E402
from tests.data.bpe import train_tiny_bpe  # noqa: E402

CALLS = 50  # conversations per timed sample


def conversation(replies: int) -> list[dict]:
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(replies):
        messages += [{"role": "user", "content": f"question number {i} about the fox " * 5},
                     {"role": "assistant", "content": f"answer {i} jumps over the lazy dog " * 8}]
    return messages


def renders_before(messages: list[dict], tokenizer) -> list[int]:
    """The ``1 + 3k`` renders of the rule before (the whole, then per reply its end and both header prefixes)."""
    ids = tokenizer.apply_chat_template(messages)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            tokenizer.apply_chat_template(messages[:i + 1])
            for prompt in (True, False):
                tokenizer.apply_chat_template(messages[:i], add_generation_prompt=prompt)
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replies", type=int, nargs="+", default=[1, 3, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    meta = harness.environment(__file__)
    with tempfile.TemporaryDirectory() as directory:
        tokenizer = train_tiny_bpe(directory)
        rows = []
        for replies in args.replies:
            messages = conversation(replies)
            assert renders_before(messages, tokenizer) == assistant_mask(messages, tokenizer)[0]
            samples = harness.interleaved({
                "before": lambda: [renders_before(messages, tokenizer) for _ in range(CALLS)],
                "now": lambda: [chat_document(messages, tokenizer) for _ in range(CALLS)]}, repeats=args.repeats)
            before, now = (statistics.median(samples[k]) / CALLS * 1e3 for k in ("before", "now"))
            rows.append({"replies": replies, "tokens": len(tokenizer.apply_chat_template(messages)),
                         "renders_before": 1 + 3 * replies, "renders_now": 2 * replies,
                         "ms_before": before, "ms_now": now, "speedup": before / now})
    lines = harness.header("Chat data: milliseconds per conversation", meta) + [
        "", "| replies | tokens | renders before | renders now | ms before | ms now | speed-up |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['replies']} | {r['tokens']} | {r['renders_before']} | {r['renders_now']} | {r['ms_before']:.2f} | "
              f"{r['ms_now']:.2f} | {r['speedup']:.2f}x |" for r in rows]
    lines += ["", "\"ms before\" is the renders alone, without the mask and checks, so the speed-up is a lower bound."]
    harness.write_results("chat_render", {"meta": meta, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
