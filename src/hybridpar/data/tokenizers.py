"""Tokenizers behind one small interface: raw bytes, or a Hugging Face tokenizer directory.

``resolve_tokenizer(spec, model_path=..., vocab_size=...)`` turns a setting into a ``Tokenizer``:

    spec      model_path ships a tokenizer    model_path does not (or no model_path)
    "auto"    that tokenizer                  bytes
    "bytes"   bytes, with a warning            bytes
    <dir>     the tokenizer in <dir>           the tokenizer in <dir>

"Ships a tokenizer" means the directory holds ``tokenizer.json`` or ``tokenizer_config.json``.
``auto`` never picks bytes when a tokenizer exists, so fine-tuning a checkpoint cannot silently
train on byte ids. Every resolved tokenizer is checked against the model's embedding: an id
``>= vocab_size`` is a ``ValueError`` naming both numbers and the fix.

A document is ``encode(text)`` (the tokenizer's own special tokens, e.g. a Llama BOS) followed
by EOS when the tokenizer has one and the encoding does not already end with it, so packed
documents end where the model should learn to stop.

``train_bpe_tokenizer`` trains a small byte-level BPE with the ``tokenizers`` package and
saves a directory transformers loads (``tokenizer.json``, ``tokenizer_config.json`` with
bos/eos/pad, ``chat_template.jinja``, and a ``generation_config.json`` naming the same ids).
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridpar.config_rules import Notice, quoted, shorten
from hybridpar.data.template_clock import fixed_clock, time_limit
from hybridpar.strict_json import check_files, check_no_duplicate_keys

__all__ = [
    "ByteTokenizer",
    "TOKENIZER_SPECS",
    "Tokenizer",
    "PretrainedTokenizer",
    "ships_tokenizer",
    "render_limit",
    "load_pretrained_tokenizer",
    "as_tokenizer",
    "resolve_tokenizer",
    "check_tokenizer",
    "train_bpe_tokenizer",
    "CHATML_TEMPLATE",
]

TOKENIZER_SPECS = ("auto", "bytes")  # or a directory path
BYTES_VOCAB_LIMIT = 1024  # a byte-trained model pads 256 ids up a little; far more is another tokenizer's vocabulary
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_JSON = (*TOKENIZER_MARKERS, "special_tokens_map.json", "added_tokens.json", "vocab.json", "chat_template.json")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Tokenizer(ABC):
    """What data sources and generation need from a tokenizer.

    ``vocab_size`` is one more than the largest id the tokenizer can produce; ``bos_id``,
    ``eos_id``, ``pad_id`` are ints or None; ``chat_template`` a Jinja string or None;
    ``source_dir`` the directory its files come from (None for bytes), which export copies.
    """

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    chat_template: str | None = None
    source_dir: Path | None = None

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's own special tokens unless told not to)."""

    @abstractmethod
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False,
                            return_assistant_mask: bool = False):
        """Token ids of ``messages`` rendered with the chat template (and, if asked, the
        template's ``{% generation %}`` mask); ValueError without a template."""
        raise ValueError(f"tokenizer {self.name} has no chat template; chat data needs a tokenizer directory whose "
                         "tokenizer_config.json or chat_template.jinja defines one (see train_bpe_tokenizer).")

    @property
    def has_generation_tags(self) -> bool:
        """Whether the chat template marks assistant text with ``{% generation %}`` blocks."""
        return bool(self.chat_template and GENERATION_TAG.search(self.chat_template))

    def document(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
        """``encode(text)`` plus EOS (see the module docstring); ``add_bos``/``add_eos`` True or
        False force the token on or off, None keeps the rule. Off removes only a token the tokenizer
        added: one the text itself spells (a prompt ending in ``<|eos|>``) stays."""
        ids = self.encode(text)
        plain = None
        if (add_bos is False and ids[:1] == [self.bos_id]) or (add_eos is False and ids[-1:] == [self.eos_id]):
            plain = self.encode(text, add_special_tokens=False)  # the text's own ids
        if add_bos is not None:
            ids = self._with_special(ids, "bos", self.bos_id, add_bos, first=True, plain=plain)
        if add_eos is None:
            add_eos = self.eos_id is not None  # documents end with EOS when there is one
        return self._with_special(ids, "eos", self.eos_id, add_eos, first=False, plain=plain)

    def _with_special(self, ids: list[int], name: str, token: int | None, wanted: bool, first: bool,
                      plain: list[int] | None = None) -> list[int]:
        """``ids`` with ``token`` at its start (``first``) or end, or without it there unless ``ids`` start
        (end) with ``plain``, the text's own ids: then the token is the text's, not the tokenizer's."""
        if wanted and token is None:
            raise ValueError(f"tokenizer {self.name} has no {name.upper()} token; pass add_{name}=None or use a "
                             "tokenizer that defines one.")
        present = bool(ids) and ids[0 if first else -1] == token
        if wanted and not present:
            return [token] + ids if first else ids + [token]
        if not wanted and present:
            if plain and (ids[:len(plain)] if first else ids[-len(plain):]) == plain:
                return ids
            return ids[1:] if first else ids[:-1]
        return ids

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, pad={self.pad_id}, chat_template={self.chat_template is not None})")


@dataclass(frozen=True)
class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as token ids (vocab 256); pad/bos/eos are the control bytes NUL/STX/ETX.

    ``encode`` appends EOS and no BOS (its special tokens). Text that contains a reserved
    byte is rejected (or, with ``errors="drop"``, stripped), so a special never stands for
    content.
    """

    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 3
    vocab_size: int = 256
    errors: str = "raise"  # or "drop": strip the reserved control bytes from the text
    name = "bytes"

    def encode(self, text: str, add_special_tokens: bool = True, *, add_bos: bool = False,
               add_eos: bool | None = None) -> list[int]:
        """Byte ids of ``text``; EOS unless ``add_special_tokens=False`` (or ``add_eos`` says otherwise)."""
        add_eos = add_special_tokens if add_eos is None else add_eos
        data = text.encode("utf-8")
        reserved = bytes((self.pad_id, self.bos_id, self.eos_id))
        if any(b in data for b in reserved):
            if self.errors != "drop":
                at = next(i for i, b in enumerate(data) if b in reserved)
                raise ValueError(
                    f"text contains reserved control byte {data[at]} (pad/bos/eos) at byte {at}; strip it or use "
                    "ByteTokenizer(errors='drop')."
                )
            data = bytes(b for b in data if b not in reserved)
        return [self.bos_id] * add_bos + list(data) + [self.eos_id] * add_eos

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """UTF-8 text of byte ids; an id outside 0-255 (a model whose vocabulary is padded past the
        bytes can sample one) is no byte: it reads as U+FFFD, as an invalid byte sequence does."""
        specials = {self.pad_id, self.bos_id, self.eos_id} if skip_special_tokens else set()
        pieces, run = [], bytearray()
        for i in (int(i) for i in ids):
            if i in specials:
                continue
            if 0 <= i < 256:
                run.append(i)
            else:
                pieces += [run.decode("utf-8", errors="replace"), "\ufffd"]
                run = bytearray()
        return "".join(pieces) + run.decode("utf-8", errors="replace")


class PretrainedTokenizer(Tokenizer):
    """A transformers tokenizer (``AutoTokenizer``), e.g. loaded from a checkpoint directory."""

    def __init__(self, hf_tokenizer, source_dir: str | Path | None = None):
        self.hf = hf_tokenizer
        self.source_dir = None if source_dir is None else Path(source_dir)
        self.name = str(self.source_dir or type(hf_tokenizer).__name__)
        self.vocab_size = max(max(hf_tokenizer.get_vocab().values(), default=-1) + 1, len(hf_tokenizer))
        self.bos_id, self.eos_id, self.pad_id = hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id
        template = hf_tokenizer.chat_template
        self.chat_template = template if isinstance(template, str) or template is None else template.get("default")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, return_assistant_mask: bool = False):
        if self.chat_template is None:
            return super().apply_chat_template(messages, add_generation_prompt)
        try:
            with render_limit(self.name, self.chat_template):
                rendered = self.hf.apply_chat_template(
                    list(messages), tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt,
                    chat_template=self.chat_template, return_assistant_tokens_mask=return_assistant_mask,
                )
        except TimeoutError as error:
            raise ValueError(str(error)) from None
        except Exception as error:  # jinja2's syntax or template errors, raise_exception(...) in the template
            first = (str(error).strip().splitlines() or [""])[0][:200]
            raise ValueError(f"the chat template of tokenizer {self.name} failed ({type(error).__name__}: {first}); "
                             "fix the template (chat_template.jinja or tokenizer_config.json) or the "
                             "conversation.") from None
        ids = list(rendered["input_ids"])
        return (ids, [bool(m) for m in rendered["assistant_masks"]]) if return_assistant_mask else ids


RENDER_SECONDS = 60.0  # one conversation; a template's nested loops (range(100000) twice) rendered for hours


@contextlib.contextmanager
def render_limit(name: str, template: str | None = None):
    """TimeoutError when rendering takes more than ``RENDER_SECONDS`` (a loop in a chat template hung the run before
    any step, with nothing said); ``template`` renders at a fixed date (both in ``data/template_clock.py``)."""
    with fixed_clock(template), time_limit(name, RENDER_SECONDS):
        yield


def ships_tokenizer(path: str | Path | None) -> bool:
    """Whether directory ``path`` holds a tokenizer (``tokenizer.json`` or ``tokenizer_config.json``; one
    that is not a regular file counts, so that loading refuses it rather than bytes replacing it)."""
    return path is not None and Path(path).is_dir() and any((Path(path) / f).exists() for f in TOKENIZER_MARKERS)


def load_pretrained_tokenizer(path: str | Path) -> PretrainedTokenizer:
    """The transformers tokenizer in directory ``path``, from local files only."""
    if not ships_tokenizer(path):
        raise ValueError(f"{path} is not a tokenizer directory (it has none of {list(TOKENIZER_MARKERS)}); pass a "
                         "directory saved by a tokenizer's save_pretrained, 'auto' or 'bytes'.")
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ImportError("loading a tokenizer directory needs transformers: pip install 'hybridpar[hf]'.") from error
    check_files(path)  # a FIFO or a link to /dev/zero: read without end by tokenizers (memory grew until killed)
    check_no_duplicate_keys(path, TOKENIZER_JSON)  # transformers would keep the last of two values silently
    try:
        loaded = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as error:  # also json's and tokenizers' errors
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"the tokenizer in {quoted(str(path))} cannot be loaded ({type(error).__name__}: "
                         f"{shorten(first, 200)}); its tokenizer files are damaged or incomplete: copy them again "
                         "from the source checkpoint.") from None
    except Exception as error:  # noqa: BLE001 - the Rust tokenizers library raises its own Exception type
        if type(error).__module__.split(".")[0] not in ("tokenizers", "builtins"):
            raise
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"the tokenizer in {quoted(str(path))} cannot be loaded ({shorten(first, 200)}); its "
                         "tokenizer files are damaged or incomplete: copy them again from the source checkpoint.") from None
    tokenizer = PretrainedTokenizer(loaded, source_dir=path)
    ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    if not ids or set(ids) == {getattr(loaded, "unk_token_id", None)}:  # every document: special tokens, or unknown
        raise ValueError(f"the tokenizer in {quoted(str(path))} encodes text to {'its unknown token only' if ids else 'no tokens'} "
                         f"({PROBE_TEXT!r} -> {shorten(str(ids), 40)}): its vocabulary is empty or damaged (tokenizer.json's "
                         "model.vocab); copy the tokenizer files again from the source checkpoint.")
    return tokenizer


PROBE_TEXT = "The quick brown fox jumps over the lazy dog."


def as_tokenizer(tokenizer) -> Tokenizer:
    """``Tokenizer`` for None (bytes), a transformers tokenizer, or a ``Tokenizer`` itself."""
    if tokenizer is None:
        return ByteTokenizer()
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if all(hasattr(tokenizer, a) for a in ("encode", "decode", "get_vocab", "eos_token_id")):
        return PretrainedTokenizer(tokenizer)
    raise ValueError(f"{type(tokenizer).__name__} is not a tokenizer; pass a hybridpar Tokenizer (e.g. "
                     "ByteTokenizer) or a transformers tokenizer.")


def check_tokenizer(tokenizer: Tokenizer, vocab_size: int, model_path: str | Path | None = None,
                    explicit_bytes: bool = False) -> None:
    """ValueError if the tokenizer's ids do not fit the embedding, or if bytes would replace the
    tokenizer ``model_path`` ships without being asked for explicitly."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name} produces ids up to {tokenizer.vocab_size - 1}, but the model's embedding has "
            f"vocab_size={vocab_size} (ids must be < {vocab_size}); use the checkpoint's own tokenizer, or a model "
            f"with vocab_size >= {tokenizer.vocab_size}."
        )
    if isinstance(tokenizer, ByteTokenizer) and ships_tokenizer(model_path) and not explicit_bytes:
        raise ValueError(
            f"the checkpoint {model_path} ships its own tokenizer, but byte ids were about to be used; set the "
            "tokenizer to 'auto' (the checkpoint's) or to 'bytes' explicitly."
        )


def auto_bytes_note(spec, model_path, vocab_size: int | None) -> str | None:
    """A warning when ``auto`` reads bytes for ``model_path`` (it ships no tokenizer) whose vocabulary
    is far larger than the 256 bytes: most likely a model of another tokenizer, read as other tokens."""
    if spec != "auto" or model_path is None or ships_tokenizer(model_path) or (vocab_size or 0) <= BYTES_VOCAB_LIMIT:
        return None
    return (f"{model_path} ships no tokenizer (no {' or '.join(TOKENIZER_MARKERS)}), so tokenizer='auto' reads byte ids, "
            f"but its vocabulary has {vocab_size:,} ids: a model trained on another tokenizer would read them as other "
            "tokens; pass that tokenizer's directory (data.tokenizer, generate --tokenizer), or 'bytes' if the model "
            "was trained on bytes.")


def resolve_tokenizer(spec: str | Path = "auto", model_path: str | Path | None = None,
                      vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer for setting ``spec`` (``"auto"``, ``"bytes"`` or a directory; see the module
    docstring), checked against ``vocab_size`` when given."""
    if not isinstance(spec, (str, Path)) or not str(spec):
        raise ValueError(f"tokenizer={quoted(spec)} must be 'auto', 'bytes' or a tokenizer directory path.")
    spec = str(spec)
    if spec == "bytes":
        tokenizer = ByteTokenizer()
        if ships_tokenizer(model_path):
            warnings.warn(f"tokenizer='bytes' was asked for, so the tokenizer shipped in {model_path} is not used; "
                          "the model will read byte ids.", Notice, stacklevel=2)
    elif spec == "auto":
        tokenizer = load_pretrained_tokenizer(model_path) if ships_tokenizer(model_path) else ByteTokenizer()
        if note := auto_bytes_note(spec, model_path, vocab_size):
            warnings.warn(note, Notice, stacklevel=2)
    elif Path(spec).is_dir():
        tokenizer = load_pretrained_tokenizer(spec)
    else:
        raise ValueError(f"tokenizer={quoted(spec)} is neither 'auto', 'bytes' nor an existing directory; pass one of "
                         f"{list(TOKENIZER_SPECS)} or the directory of a saved tokenizer.")
    if vocab_size is not None:
        check_tokenizer(tokenizer, vocab_size, model_path, explicit_bytes=spec == "bytes")
    return tokenizer


# ChatML turns, each closed by the EOS token, so one end token serves documents and turns.
CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BPE_SPECIALS = {"pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|eos|>", "turn": "<|im_start|>"}


def train_bpe_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 4096, min_frequency: int = 2,
                        chat_template: str | None = CHATML_TEMPLATE) -> PretrainedTokenizer:
    """Train a byte-level BPE on ``texts``, save it to ``out_dir`` and load it back.

    Ids 0-3 are ``<|pad|>``, ``<|bos|>``, ``<|eos|>``, ``<|im_start|>``; ``encode`` adds BOS (as
    Llama's tokenizer does) and documents add EOS. The saved directory loads with
    ``AutoTokenizer.from_pretrained`` and carries the chat template and a
    ``generation_config.json`` with the bos/eos/pad ids.
    """
    try:
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import decoders, models, pre_tokenizers, processors, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError as error:
        raise ImportError("train_bpe_tokenizer needs tokenizers and transformers: pip install 'hybridpar[hf]'.") from error
    specials = list(BPE_SPECIALS.values())
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the 256 byte symbols plus {len(specials)} special "
                         f"tokens; use at least {256 + len(specials)}.")
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(texts, trainer)
    bos = BPE_SPECIALS["bos"]
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, raw.token_to_id(bos))])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=BPE_SPECIALS["eos"],
                                 pad_token=BPE_SPECIALS["pad"], additional_special_tokens=[BPE_SPECIALS["turn"]])
    hf.chat_template = chat_template
    out_dir = Path(out_dir)
    hf.save_pretrained(str(out_dir))
    ids = {f"{k}_token_id": raw.token_to_id(BPE_SPECIALS[k]) for k in ("bos", "eos", "pad")}
    (out_dir / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    return load_pretrained_tokenizer(out_dir)
