"""Documents of a file-based task: one entry point for every local-data ``data.task``.

    task                 reads                                   options (default)
    text                 plain text files                        split ("paragraph"): file | line | paragraph
    jsonl                JSON lines, a string field              text_field ("text")
    chat                 JSON lines with a ``messages`` list     messages_field ("messages")
    prompt_completion    JSON lines with prompt / completion     prompt_field ("prompt"), completion_field ("completion")
    hf_dataset           ``datasets`` files or saved dataset     kind ("text"), field, split ("train"), builder,
                                                                 prompt_field, completion_field (prompt_completion)
    python_stdlib        the .py files under a directory         max_bytes, max_file_bytes, eval_fraction, exclude
                         (null: this Python's standard library)  (``data/stdlib.py``)

Text tasks give token lists (labels: the next tokens); chat, prompt/completion and
``hf_dataset`` with kind messages/prompt_completion give ``{"input_ids", "labels"}`` with
labels only on the trained tokens (``data/chat.py``). ``python_stdlib`` holds files out by a
hash of their path (``data/stdlib.py``), every other task its last 10% of documents
(``train/batches.py``).
"""

from __future__ import annotations

from pathlib import Path

from hybridpar.config_rules import quoted
from hybridpar.data.chat import chat_documents, prompt_completion_documents
from hybridpar.data.empty_documents import drop_empty
from hybridpar.data.hf_datasets import hf_dataset_documents
from hybridpar.data.sources import jsonl_documents, text_documents
from hybridpar.data.stdlib import STDLIB_OPTIONS, stdlib_corpus
from hybridpar.data.tokenizers import as_tokenizer

__all__ = ["FILE_TASKS", "file_documents"]

FILE_TASKS = {  # task -> its options and their defaults
    "text": {"split": "paragraph"},
    "jsonl": {"text_field": "text"},
    "chat": {"messages_field": "messages"},
    "prompt_completion": {"prompt_field": "prompt", "completion_field": "completion"},
    "hf_dataset": {"kind": "text", "field": None, "split": "train", "builder": None, "prompt_field": "prompt",
                   "completion_field": "completion"},
    "python_stdlib": STDLIB_OPTIONS,
}


def file_documents(task: str, path: str | Path | None, tokenizer, options: dict | None = None) -> list:
    """Every document of ``task`` at ``path`` through ``tokenizer`` (a ``Tokenizer``, or None for bytes)."""
    if task not in FILE_TASKS:
        raise ValueError(f"data.task={quoted(task)} is not a file task; choose one of {sorted(FILE_TASKS)}.")
    options = dict(options or {})
    unknown = sorted(set(options) - set(FILE_TASKS[task]))
    if unknown:
        raise ValueError(f"data.task_options {unknown} do not apply to task {quoted(task)}; it takes {sorted(FILE_TASKS[task])}.")
    if task == "python_stdlib":  # training files, then held-out ones (batches.load_documents takes one part)
        corpus = stdlib_corpus(path, **options)
        return [as_tokenizer(tokenizer).document(f.text) for f in corpus.train + corpus.held_out]
    if not path or not Path(path).exists():
        raise ValueError(f"data.path={quoted(path)} does not exist; task {quoted(task)} needs a local file"
                         f"{' or dataset directory' if task == 'hf_dataset' else ''}.")
    options = {**FILE_TASKS[task], **options}
    if task == "text":
        documents = text_documents(path, split=options["split"], tokenizer=tokenizer)
    elif task == "jsonl":
        documents = jsonl_documents(path, text_field=options["text_field"], tokenizer=tokenizer)
    elif task == "chat":
        documents = chat_documents(path, tokenizer, **options)
    elif task == "prompt_completion":
        documents = prompt_completion_documents(path, tokenizer, **options)
    else:
        documents = hf_dataset_documents(path, tokenizer, **options)
    return drop_empty(documents, as_tokenizer(tokenizer), task, path) if documents else documents
