"""Supervised fine-tuning documents: chat conversations and prompt/completion pairs.

Each conversation (or pair) becomes one document ``{"input_ids": ids, "labels": labels}`` in
the packer's convention: labels are already shifted, ``labels[t] = ids[t+1]`` when token
``t+1`` is trained on and -100 otherwise, so ``pack_documents`` keeps every conversation in
one document and no document sees another.

Which tokens are trained on (``mask[t]`` for token ``t`` of ``ids``):

- **chat** (``messages``: a list of ``{"role", "content"}``): ``ids`` is the whole conversation
  rendered with the tokenizer's chat template. If the template marks assistant text with
  ``{% generation %}`` blocks, the mask is transformers' ``return_assistant_tokens_mask``.
  Otherwise, for every assistant message ``i``,

      start = len(render(messages[:i], add_generation_prompt=True))   # after the assistant header
      end   = len(render(messages[:i + 1]))                           # through the end-of-turn tokens
      mask[start:end] = True

  so the assistant's content and its end-of-turn tokens are learned, and the prompt, the
  other roles and the assistant header the template adds as its generation prompt are not.
  Both renders must be token prefixes of the whole conversation (templates that rewrite
  earlier turns are refused with a ValueError; give them ``{% generation %}`` tags). A
  template that ignores ``add_generation_prompt`` falls back to ``render(messages[:i])``, so
  its assistant header is learned too. When the tokens are no prefix but the texts agree (the
  prompt's last token merges with the reply's first, or the reply's rendering departs from the
  prompt part way), ``start`` is the token where the texts part (``_text_start``).
- **prompt_completion** (``prompt``, ``completion`` strings): ``ids = P + C + [EOS]`` with
  ``P`` the prompt as a document without EOS (BOS if the tokenizer adds one) and ``C`` the
  completion's tokens in ``prompt + completion`` when ``P`` begins those (else the completion
  tokenized on its own: a tokenizer that prepends ``▁`` to a text read `` Paris`` alone as
  ``▁▁`` ``Paris``); the mask covers ``C`` and EOS.

Errors name the file and line (JSONL) or the dataset row.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from hybridpar.config_rules import quoted
from hybridpar.data.packing import IGNORE_INDEX
from hybridpar.data.sources import read_jsonl, task_hint
from hybridpar.data.tokenizers import Tokenizer, as_tokenizer, render_limit

__all__ = [
    "shifted_labels",
    "assistant_mask",
    "chat_document",
    "prompt_completion_document",
    "chat_documents",
    "prompt_completion_documents",
]

Document = dict[str, list[int]]
ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")  # what chat templates render
SYNONYMS = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant"}  # ShareGPT, Gemma


def template_roles(template: str | None) -> list[str]:
    """``ROLES`` and every other role the chat template compares a message's role with."""
    named = re.findall(r"role['\"]?\]?\s*(?:==|!=)\s*['\"]([^'\"]{1,40})['\"]", template or "")
    return list(dict.fromkeys([*ROLES, *named]))


def _check_role(index: int, role: str, roles: list[str]) -> None:
    """A role outside ``roles``: a misspelling would be rendered as a header of its own (or dropped) and
    never trained on, silently."""
    if role in roles:
        return
    close = [SYNONYMS[role.strip().lower()]] if role.strip().lower() in SYNONYMS else \
        difflib.get_close_matches(role.strip().lower(), roles, n=1, cutoff=0.6)  # asistant, User, ' assistant'
    raise ValueError(f"message {index} has role {quoted(role)}, not a chat role (it would not be trained on, or be "
                     f"dropped by the template): roles are {quoted(roles, 300)}, with those the chat template names; "
                     f"{f'did you mean {quoted(close[0])}? ' if close else ''}fix the role.")


def shifted_labels(ids: Sequence[int], mask: Sequence[bool]) -> list[int]:
    """``labels[t] = ids[t+1]`` where ``mask[t+1]``, else -100 (and -100 at the last token)."""
    return [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX] * bool(ids)


def _check_messages(messages: Any, template: str | None = None, specials: Sequence[str] = ()) -> list[dict[str, str]]:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} objects, got {quoted(messages, 80)}; "
                         'write it as [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}], '
                         "or remove the record.")
    roles = template_roles(template)
    messages = [_tool_call_content(m) for m in messages]
    for index, message in enumerate(messages):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            parts = isinstance(message, Mapping) and isinstance(message.get("content"), list)
            sharegpt = isinstance(message, Mapping) and {"from", "value"} <= set(message)
            raise ValueError(f"message {index} is {quoted(message, 80)}; every message needs string 'role' and "
                             "'content'" + ("; hybridpar trains on text: join the text of the content parts into one "
                                            "string" if parts else "; this is ShareGPT's {'from', 'value'}: convert each "
                                            "message to {'role', 'content'} (human -> user, gpt -> assistant)" if sharegpt
                                            else ": fix or remove the message") + ".")
        _check_role(index, message["role"], roles)
        _check_extras(index, message, template, specials)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"no message has role 'assistant' (roles: {quoted([m['role'] for m in messages], 200)}), so "
                         "nothing would be trained on; drop the conversation or add the assistant's reply")
    _check_order([m["role"] for m in messages])
    return [dict(m) for m in messages]


RENDERED_KEYS = ("tool_calls", "function_call", "reasoning_content", "reasoning", "thinking")  # text a template may render


def _tool_call_content(message: Any) -> Any:
    """An assistant tool call written as OpenAI writes it (``content: null`` beside ``tool_calls``) with content ''."""
    if isinstance(message, Mapping) and message.get("content") is None and message.get("tool_calls"):
        return {**message, "content": ""}
    return message


def _weight(message: Mapping) -> int:
    """OpenAI's fine-tuning ``weight`` of an assistant message: 0 (not trained) or 1 (trained, the default; None too: a
    dataset's table fills a field some messages lack with None)."""
    return 1 if message.get("weight") is None else message["weight"]


def _check_extras(index: int, message: Mapping, template: str | None, specials: Sequence[str]) -> None:
    """A message's ``weight`` (0 or 1, on an assistant reply), its keys a template renders (``tool_calls``, reasoning),
    and content that holds a special token's text: each was trained silently wrong (a reply marked weight 0 trained
    on, a call dropped by a template that never reads ``tool_calls``, ``<|eos|>`` in a reply read as the end token)."""
    where = f"message {index} ({message['role']!r})"
    if message.get("weight") is not None and (message["role"] != "assistant" or type(message["weight"]) not in (int, float)
                                or message["weight"] not in (0, 1)):
        raise ValueError(f"{where} has weight {quoted(message['weight'], 40)}; a weight is 0 (do not train on this reply) "
                         "or 1 (train on it), on an assistant message only (OpenAI's fine-tuning format): fix or remove it.")
    for key in RENDERED_KEYS:
        if message.get(key) and not re.search(rf"\b{key}\b", template or ""):
            raise ValueError(f"{where} has {key!r}, which the chat template never reads: it would be dropped from the "
                             f"conversation without a word (a reply trained without the call or reasoning it rests on); use "
                             f"a chat template that renders {key!r} (the model's own), or move it into the content.")
    for text in specials:
        if text in message["content"]:
            raise ValueError(f"{where} holds {quoted(text)} in its content, the text of the tokenizer's special token, which "
                             "the tokenizer reads as that token, not as text (a reply would end there, or a header be "
                             "forged); remove it from the content (a conversation already rendered with a template goes "
                             "in data.task=jsonl as text), or remove the record.")


def special_texts(tokenizer: Tokenizer) -> list[str]:
    """The texts a pretrained tokenizer reads as one of its special tokens (none for bytes), cached on it."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return []
    cached = getattr(tokenizer, "_special_texts", None)
    if cached is None:
        texts = set(getattr(hf, "all_special_tokens", None) or ())
        texts |= {t.content for t in (getattr(hf, "added_tokens_decoder", None) or {}).values() if getattr(t, "special", False)}
        cached = sorted(t for t in texts if isinstance(t, str) and t.strip())
        tokenizer._special_texts = cached
    return cached


def _check_order(roles: list[str]) -> None:
    """Turns in the order every chat template assumes: system (or developer) messages first, then a user
    message, then user and assistant turns alternating (tool results after the assistant's call), ending
    on the assistant. Templates render other orders without a word (or fail with their own jinja message),
    and a reply out of order is trained on as the answer to a prompt it does not follow. Roles the chat
    template names beyond ``ROLES`` are not ordered."""
    kinds = {"system": "head", "developer": "head", "user": "user", "assistant": "assistant", "tool": "tool",
             "function": "tool", "ipython": "tool"}
    turns = [(i, role, kinds[role]) for i, role in enumerate(roles) if role in kinds]
    sequence = f"(roles: {quoted(roles, 200)})"
    previous = None
    for i, role, kind in turns:
        rule = None
        if kind == "head" and previous not in (None, "head"):
            rule = "a system message goes before the conversation: move it to the front (or merge it into the first)"
        elif previous in (None, "head") and kind != "user" and kind != "head":
            rule = "the conversation must open with a user message (after any system message): add the prompt it answers"
        elif kind == previous and kind in ("user", "assistant"):
            rule = f"it follows another {role!r} message; user and assistant turns alternate: merge the two"
        elif kind == "tool" and previous not in ("assistant", "tool"):
            rule = "a tool result follows the assistant message that called the tool"
        if rule:
            raise ValueError(f"message {i} has role {role!r} out of order {sequence}: {rule}, or remove the record.")
        previous = kind
    if previous != "assistant":
        i, role, _ = turns[-1]
        raise ValueError(f"the conversation ends with message {i} ({role!r}) after the last reply {sequence}: it would "
                         "be read and never trained on; add its reply or drop it.")


def _is_prefix(prefix: list[int], ids: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[:len(prefix)] == prefix


def _turn_span(messages: list[dict[str, str]], i: int, tokenizer: Tokenizer, ids: list[int]) -> tuple[int, int]:
    """``(start, end)`` in ``ids`` of assistant message ``i``: after its header, through its end of turn.
    Each render is a tokenization (most of the cost): the whole conversation's ``ids`` stand for the last
    message's, and the render without the generation prompt is made only when the one with it is no prefix."""
    end = ids if i == len(messages) - 1 else tokenizer.apply_chat_template(messages[:i + 1])
    prompted = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)  # i > 0
    if _is_prefix(prompted, end) and _is_prefix(end, ids):
        return len(prompted), len(end)
    start = _text_start(messages, i, tokenizer, ids)
    if start is None:
        plain = tokenizer.apply_chat_template(messages[:i])  # a template that ignores add_generation_prompt
        start = len(plain) if _is_prefix(plain, end) else None
    if start is None or not _is_prefix(end, ids):
        raise ValueError(
            f"the chat template does not render message {i} as a continuation of the messages before it, so the "
            "assistant tokens cannot be found by prefix; use a template with {% generation %} tags"
        )
    return start, len(end)


def _render_text(tokenizer: Tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    with render_limit(tokenizer.name, tokenizer.chat_template):
        return tokenizer.hf.apply_chat_template(messages, tokenize=False, chat_template=tokenizer.chat_template,
                                                add_generation_prompt=add_generation_prompt)


def _text_start(messages: list[dict[str, str]], i: int, tokenizer: Tokenizer, ids: list[int]) -> int | None:
    """The first token of assistant message ``i`` found on the rendered text, when the generation prompt's tokens are
    no prefix of the conversation's: its last token merges with the reply's first (a prompt ending in a space,
    ``Assistant: `` + ``Hi`` -> ``:`` `` Hi``), or the reply's rendering departs from it (DeepSeek-R1's prompt
    ``<|Assistant|><think>\n`` before a reply rendered without thinking). The reply starts where the prompt's text and
    the conversation's part, at the token that ends past it (as transformers' ``{% generation %}`` mask takes a token
    the reply begins in); the header before is not learned. None when the template adds no generation prompt or the
    texts part at once (then the render without it is the start). Without it the header was learned, silently."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not getattr(hf, "is_fast", False) or tokenizer.chat_template is None:
        return None
    try:
        whole, prompt = _render_text(tokenizer, messages), _render_text(tokenizer, messages[:i], True)
        plain = _render_text(tokenizer, messages[:i])
        agree = len(os.path.commonprefix([prompt, whole]))
        if prompt == plain or not whole.startswith(plain) or agree <= len(plain):
            return None
        encoded = hf(whole, add_special_tokens=False, return_offsets_mapping=True)
    except TimeoutError as error:
        raise ValueError(str(error)) from None
    except Exception:  # noqa: BLE001 - the template's own error is said by the tokenized render
        return None
    if list(encoded["input_ids"]) != list(ids):
        return None
    return next((t for t, (_, stop) in enumerate(encoded["offset_mapping"]) if stop > agree), None)


def _check_rendered(messages: list[dict[str, str]], tokenizer: Tokenizer) -> None:
    """Every message's text is in the rendered conversation: a template that skips a role it does not know (a
    ``developer`` or ``tool`` message) or drops a reply's text rendered the rest without a word (an assistant
    turn trained as its header and end token, a prompt missing from the context)."""
    if getattr(tokenizer, "hf", None) is None or tokenizer.chat_template is None:
        return
    try:
        with render_limit(tokenizer.name, tokenizer.chat_template):
            text = tokenizer.hf.apply_chat_template(messages, tokenize=False, chat_template=tokenizer.chat_template)
    except TimeoutError as error:
        raise ValueError(str(error)) from None
    except Exception:  # the template's own error: said by the render of the ids that follows
        return
    for index, message in enumerate(messages):
        content = message["content"].strip()
        if content and isinstance(text, str) and content not in text:
            effect = "trained as an empty reply" if message["role"] == "assistant" else "missing from the prompt"
            raise ValueError(f"the chat template drops message {index} ({message['role']!r}: {quoted(content, 60)}): its "
                             f"text is not in the rendered conversation, so it would be {effect} without a word; use a "
                             f"template that renders every {message['role']!r} message (the model's own), or merge the "
                             "message into another or remove it.")


def assistant_mask(messages: Sequence[Mapping[str, str]], tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """``(ids, mask)`` of a conversation: its rendered tokens and which are assistant tokens.

    An assistant message with empty (or whitespace) content beside replies with text trains no
    token, not even its end of turn (that would teach the model to answer with nothing); a
    conversation whose every reply is empty is left to ``empty_documents`` (skipped, counted)."""
    messages = _check_messages(messages, tokenizer.chat_template, special_texts(tokenizer))
    _check_rendered(messages, tokenizer)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant" and _weight(m)]  # weight 0: not trained
    if not replies:
        ids = tokenizer.apply_chat_template(messages)
        return ids, [False] * len(ids)
    blank = [i for i in replies if not messages[i]["content"].strip() and not messages[i].get("tool_calls")]
    if len(blank) == len(replies):
        blank = []
    blank += [i for i, m in enumerate(messages) if m["role"] == "assistant" and not _weight(m)]
    if tokenizer.has_generation_tags:
        ids, mask = tokenizer.apply_chat_template(messages, return_assistant_mask=True)
        for i in blank:
            start, end = _turn_span(messages, i, tokenizer, ids)
            mask[start:end] = [False] * (end - start)
        return ids, mask
    ids = tokenizer.apply_chat_template(messages)
    mask = [False] * len(ids)
    for i in replies:
        if i not in blank:
            start, end = _turn_span(messages, i, tokenizer, ids)
            mask[start:end] = [True] * (end - start)
    return ids, mask


def chat_document(messages: Sequence[Mapping[str, str]], tokenizer) -> Document:
    """One conversation as ``{"input_ids", "labels"}`` with labels on assistant tokens only."""
    ids, mask = assistant_mask(messages, as_tokenizer(tokenizer))
    if not any(mask[1:]) and any(_weight(m) for m in messages if m["role"] == "assistant"):  # all weight 0: empty
        if any(m["content"].strip() for m in messages if m["role"] == "assistant" and _weight(m)):
            raise ValueError("the chat template's {% generation %} tags wrap none of the assistant's replies, so no token "
                             "would be trained on; fix the template so that each tag wraps the assistant's content")
        raise ValueError("the chat template left no assistant token to train on (is the reply empty?)")
    return {"input_ids": ids, "labels": shifted_labels(ids, mask)}


def prompt_completion_document(prompt: str, completion: str, tokenizer) -> Document:
    """``prompt + completion + EOS`` as ``{"input_ids", "labels"}`` with labels on the completion and EOS."""
    tokenizer = as_tokenizer(tokenizer)
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got a {type(value).__name__} ({quoted(value, 60)}); write it as "
                             "a JSON string, or fix or remove the record.")
    if tokenizer.eos_id is None:
        raise ValueError(f"tokenizer {tokenizer.name} has no EOS token to end the completion; use one that defines it")
    for name, value in (("prompt", prompt), ("completion", completion)):
        if special := next((t for t in special_texts(tokenizer) if t in value), None):
            raise ValueError(f"the {name} holds {quoted(special)}, the text of the tokenizer's special token, which the "
                             "tokenizer reads as that token, not as text (a completion would end there); remove it, or "
                             "remove the record.")
    prompt_ids = tokenizer.document(prompt, add_eos=False)
    completion_ids = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_id]
    joint = tokenizer.document(prompt + completion, add_eos=False) if prompt_ids and completion else []
    if joint[:len(prompt_ids)] == prompt_ids and len(joint) > len(prompt_ids):  # the completion's tokens after the prompt
        completion_ids = joint[len(prompt_ids):] + [tokenizer.eos_id]
    ids = prompt_ids + completion_ids
    mask = [False] * len(prompt_ids) + [True] * len(completion_ids)
    if not prompt_ids:
        raise ValueError("the prompt is empty; the first trained token needs a token before it")
    return {"input_ids": ids, "labels": shifted_labels(ids, mask)}


def _build(where: str, build, *args) -> Document:
    try:
        return build(*args)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def chat_documents(paths, tokenizer, messages_field: str = "messages") -> list[Document]:
    """One document per JSONL record's ``messages`` list (see the module docstring)."""
    tokenizer = as_tokenizer(tokenizer)
    docs = []
    for where, record in read_jsonl(paths):
        if messages_field not in record:
            raise ValueError(f"{where} has no {quoted(messages_field)} field (keys: {quoted(sorted(record))})"
                             f"{task_hint(record, 'chat')}; pass messages_field= (data.task_options.messages_field).")
        docs.append(_build(where, chat_document, record[messages_field], tokenizer))
    return docs


def prompt_completion_documents(paths, tokenizer, prompt_field: str = "prompt",
                                completion_field: str = "completion") -> list[Document]:
    """One document per JSONL record's ``prompt``/``completion`` pair (see the module docstring)."""
    tokenizer = as_tokenizer(tokenizer)
    if prompt_field == completion_field:
        raise ValueError(f"prompt_field and completion_field both name {quoted(prompt_field)}: the prompt would be trained "
                         "on as its own completion; name the completion's field in completion_field.")
    docs = []
    for where, record in read_jsonl(paths):
        absent = [f for f in (prompt_field, completion_field) if f not in record]
        if absent:
            raise ValueError(f"{where} has no {absent} field (keys: {quoted(sorted(record))})"
                             f"{task_hint(record, 'prompt_completion')}; pass prompt_field= / completion_field=.")
        docs.append(_build(where, prompt_completion_document, record[prompt_field], record[completion_field], tokenizer))
    return docs
