"""A chat template's render: at one fixed date, within a time limit (``data/tokenizers.render_limit``).

Llama 3.2's and Granite's chat templates write today's date into every system header
(``strftime_now("%d %b %Y")``), so a conversation's tokens, their number and so the packs changed
with the day the data was read: a run resumed another day, or ranks reading on either side of
midnight, trained other batches than the first. Every render of ``data/tokenizers.py`` and
``data/chat.py`` reads ``RENDER_DATE`` instead (Llama 3.1's own default date), for that render only.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import threading

__all__ = ["RENDER_DATE", "fixed_clock", "time_limit"]

RENDER_DATE = datetime.datetime(2024, 7, 26)


def _strftime_now(format: str) -> str:
    return RENDER_DATE.strftime(str(format))


@contextlib.contextmanager
def fixed_clock(template: str | None):
    """The compiled ``template``'s ``strftime_now`` reads ``RENDER_DATE`` while inside, and its own clock again after
    (transformers compiles a template once, cached, with ``strftime_now`` a global, and turns a function passed as a
    render variable into text, so the cached template's globals are set; a caller of transformers' own
    ``apply_chat_template`` on the same template later still gets today)."""
    names = None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        names = _compile_jinja_template(template).globals if template is not None else None
    except Exception:  # noqa: BLE001 - another transformers, or a template that does not compile (said by the render)
        pass
    previous = names.get("strftime_now") if names is not None else None
    if names is not None:
        names["strftime_now"] = _strftime_now
    try:
        yield
    finally:
        if names is not None:
            names["strftime_now"] = previous


@contextlib.contextmanager
def time_limit(name: str, seconds: float):
    """TimeoutError naming tokenizer ``name`` when a render takes more than ``seconds`` (a timer signal, in the main
    thread only: the launcher, ``--dry-run`` and every rank read data there)."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0]:
        yield  # another thread, or a timer already running: left alone
        return

    def expired(signum, frame):
        raise TimeoutError(f"the chat template of tokenizer {name} took more than {seconds:g} s to render one "
                           "conversation (a loop in the template?); fix the template (chat_template.jinja or "
                           "tokenizer_config.json).")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
