"""Chat templates render at one fixed date.

Llama 3.2's and Granite's chat templates write today's date into every system header
(``strftime_now("%d %b %Y")``), so a conversation's tokens, their number and so the packs changed
with the day the data was read: a run resumed another day, or ranks reading on either side of
midnight, trained other batches than the first. Every render of ``data/tokenizers.py`` and
``data/chat.py`` reads ``RENDER_DATE`` instead (Llama 3.1's own default date).
"""

from __future__ import annotations

import datetime

__all__ = ["RENDER_DATE", "fixed_clock"]

RENDER_DATE = datetime.datetime(2024, 7, 26)


def _strftime_now(format: str) -> str:
    return RENDER_DATE.strftime(str(format))


def fixed_clock(template: str) -> None:
    """Point the compiled ``template``'s ``strftime_now`` at ``RENDER_DATE``. transformers compiles a template once
    (cached) with its own ``strftime_now`` global, and turns a function passed as a render variable into text, so the
    cached template's globals are set."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(template).globals["strftime_now"] = _strftime_now
    except Exception:  # noqa: BLE001 - another transformers, or a template that does not compile (said by the render)
        pass
