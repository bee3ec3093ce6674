"""Documents from Hugging Face ``datasets`` on local files (the ``data`` extra).

``path`` is one of

- a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read with
  ``load_from_disk``; a ``DatasetDict`` gives its ``split``),
- a data file (``.json``/``.jsonl``/``.txt``/``.csv``/``.parquet``; the builder follows the
  extension) or a directory of them (``load_dataset(path, split=split)``).

``kind`` says what a row holds: ``"text"`` (a string column, default ``"text"``; one document
per row, see ``Tokenizer.document``), ``"messages"`` (a chat column, default ``"messages"``;
``chat.chat_document``) or ``"prompt_completion"`` (columns ``prompt_field`` and ``completion_field``,
default ``prompt`` and ``completion``; ``chat.prompt_completion_document``). Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from hybridpar.config_rules import quoted, shorten
from hybridpar.data.chat import chat_document, prompt_completion_document
from hybridpar.data.tokenizers import as_tokenizer
from hybridpar.strict_json import check_json_data_file

__all__ = ["HF_KINDS", "load_hf_dataset", "hf_options_problem", "hf_dataset_documents"]

HF_KINDS = {"text": "text", "messages": "messages", "prompt_completion": None}  # kind -> default column
HF_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet"}
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _datasets():
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            "data.task=hf_dataset needs the optional Hugging Face 'datasets' package: pip install 'hybridpar[data]' "
            "(or pip install datasets); plain text and JSONL files work without it (tasks text, jsonl, chat)."
        ) from error
    return datasets


def _within(name, path: Path) -> bool:
    """Whether file ``name`` (an OSError's) is ``path`` or inside it."""
    name = Path(str(name)).absolute()
    return name == path.absolute() or path.absolute() in name.parents


@contextlib.contextmanager
def _reading(datasets, path: Path, split: str = "train"):
    """datasets' progress bars and log lines held back; what it cannot read (a CSV quote left open, a
    file that is not parquet, a split it does not have) one ValueError naming ``path`` and the root cause, not a
    traceback; a file datasets could not write outside ``path`` is named as its cache; memory running out is raised
    as it is."""
    bars, level = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors: said below, in one line
    try:
        yield
    except Exception as error:  # noqa: BLE001 (datasets raises IndexError, AttributeError... of what it cannot read)
        root = error
        while root.__cause__ is not None:  # DatasetGenerationError wraps the parser's own error
            root = root.__cause__
        if isinstance(root, MemoryError):  # the machine, not the file
            raise
        first = (str(root).strip().splitlines() or [type(root).__name__])[0]
        if isinstance(root, OSError) and root.filename and not _within(root.filename, path):  # its cache, not the data
            cache = datasets.config.HF_DATASETS_CACHE
            raise ValueError(f"dataset {path}: datasets could not write its cache ({type(root).__name__}: "
                             f"{shorten(first, 160)}); point HF_DATASETS_CACHE (now {shorten(str(cache), 160)}) at a "
                             "writable folder with room.") from None
        if "corresponds to no data" in first:  # a CSV of its header alone: datasets' split instruction failed
            raise ValueError(f"dataset {path} holds no rows (a header, or nothing, and no record under it); write the "
                             "data into it, or point data.path at the file that holds it.") from None
        if first.startswith("Unknown split"):  # load_dataset: "Unknown split "x". Should be one of ['train']."
            have = first.partition("one of ")[2].rstrip(".") or "['train']"
            alone = " (a data file alone is the split 'train')" if path.is_file() else ""
            raise ValueError(f"dataset {path} has splits {shorten(have, 200)}, not {quoted(split)}{alone}; pass one of "
                             "them as data.task_options.split.") from None
        raise ValueError(f"dataset {path} cannot be read ({type(root).__name__}: {shorten(first, 200)}); fix the file "
                         "(or convert it to JSON lines for data.task=jsonl, chat or prompt_completion).") from None
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def load_hf_dataset(path: str | Path, split: str = "train", builder: str | None = None):
    """The ``datasets.Dataset`` of ``split`` at local ``path`` (see the module docstring)."""
    datasets = _datasets()
    path = Path(path)
    if not path.exists():
        raise ValueError(f"dataset path {path} does not exist; pass a local data file or a save_to_disk directory.")
    if path.is_dir() and any((path / m).is_file() for m in SAVED_MARKERS):
        folder = _saved_split(path, split)  # only the split asked for is read: another, empty one failed the whole load
        with _reading(datasets, path, split):
            return datasets.load_from_disk(str(folder))
    if path.is_dir():
        for file in sorted(path.rglob("*.json*")):  # datasets' JSON reader keeps the last of two equal keys
            if file.suffix in (".json", ".jsonl"):
                check_json_data_file(file)
        with _reading(datasets, path, split):
            return datasets.load_dataset(str(path), split=split)
    builder = builder or HF_BUILDERS.get(path.suffix)
    if builder is None:
        raise ValueError(f"cannot infer the datasets builder of {path}; pass builder= one of "
                         f"{sorted(set(HF_BUILDERS.values()))}.")
    if builder == "json":
        check_json_data_file(path)
    if builder == "parquet":
        _check_parquet_rows(path)
    with _reading(datasets, path, split):
        return datasets.load_dataset(builder, data_files=[str(path)], split=split)


def _saved_split(path: Path, split: str) -> Path:
    """The folder of ``split`` in a ``save_to_disk`` folder; a split it does not have (or a split asked of a saved
    ``Dataset``, which has none) and a split saved with no rows are one ValueError naming the splits there."""
    import json

    fix = "pass one of them as data.task_options.split"
    if not (path / "dataset_dict.json").is_file():  # one saved Dataset: its rows are the whole of it
        if split != "train":
            raise ValueError(f"{path} is one saved Dataset (no splits), not a DatasetDict, so it has no split "
                             f"{quoted(split)}; leave data.task_options.split unset (train: every row).")
        return path
    try:
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        splits = [str(name) for name in splits]
    except (OSError, ValueError, KeyError, TypeError):  # damaged: datasets names the reason in _reading
        return path
    if split not in splits:
        raise ValueError(f"{path} has splits {quoted(sorted(splits))}, not {quoted(split)}; {fix}.")
    folder = path / split
    try:
        empty = json.loads((folder / "state.json").read_text(encoding="utf-8")).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        empty = False
    if empty:
        raise ValueError(f"split {quoted(split)} of {path} holds no rows (saved empty); {fix} "
                         f"({quoted([s for s in splits if s != split])}), or save the rows into it.")
    return folder


def _check_parquet_rows(path: Path) -> None:
    """A parquet file with no rows is one line (datasets' reader said "BatchSize must be greater than 0")."""
    try:
        import pyarrow.parquet as pq

        metadata = pq.read_metadata(str(path))
    except Exception:  # not parquet, damaged: datasets names the parser's reason in _reading
        return
    if metadata.num_rows == 0:
        raise ValueError(f"dataset {path} holds no rows (a parquet file with {metadata.num_columns} column(s) and 0 "
                         "rows); write the data into it, or point data.path at the file that holds it.")


def hf_options_problem(kind: str = "text", field: str | None = None, prompt_field: str = "prompt",
                       completion_field: str = "completion", **_) -> str | None:
    """Why options of ``hf_dataset`` do not go together (the launcher asks before any process starts)."""
    if kind not in HF_KINDS:
        return f"kind={quoted(kind)} is unknown; choose one of {sorted(HF_KINDS)}."
    if kind == "prompt_completion" and field is not None:  # the fix the missing-column message named was refused here
        return (f"field={quoted(field)} does not apply to kind='prompt_completion', which reads two columns; name them "
                "with data.task_options.prompt_field and completion_field (default 'prompt', 'completion').")
    pair = {"prompt_field": prompt_field, "completion_field": completion_field}
    if kind == "prompt_completion" and prompt_field == completion_field:
        return (f"prompt_field and completion_field both name {quoted(prompt_field)}: the prompt would be trained on as "
                "its own completion; name the completion's column in completion_field.")
    if kind != "prompt_completion" and (prompt_field, completion_field) != ("prompt", "completion"):
        return (f"{quoted(pair)} apply to kind='prompt_completion' only, not kind={quoted(kind)}; name the column with "
                "data.task_options.field, or set kind='prompt_completion'.")
    return None


def hf_dataset_documents(path: str | Path, tokenizer=None, kind: str = "text", field: str | None = None,
                         split: str = "train", builder: str | None = None, prompt_field: str = "prompt",
                         completion_field: str = "completion") -> list:
    """Documents of every row of a local dataset: token lists (``text``) or ``{"input_ids",
    "labels"}`` (``messages``, ``prompt_completion``: columns ``prompt_field`` and ``completion_field``)."""
    if problem := hf_options_problem(kind, field, prompt_field, completion_field):
        raise ValueError(problem)
    tokenizer = as_tokenizer(tokenizer)
    dataset = load_hf_dataset(path, split, builder)
    columns = [field or HF_KINDS[kind]] if kind != "prompt_completion" else [prompt_field, completion_field]
    absent = [c for c in columns if c not in dataset.column_names]
    if absent:
        option = ("data.task_options.prompt_field / completion_field" if kind == "prompt_completion"
                  else "the field option (data.task_options.field)")
        raise ValueError(f"dataset {path} (split {quoted(split)}) has columns {dataset.column_names}, not {absent}; "
                         f"pass {option} naming the right column{'s' if kind == 'prompt_completion' else ''}.")
    docs = []
    for row, record in enumerate(dataset.select_columns(columns)):
        try:
            if kind == "text":
                value = record[columns[0]]
                if not isinstance(value, str):
                    what = "nothing (null: an empty cell?)" if value is None else type(value).__name__
                    raise ValueError(f"column {quoted(columns[0])} holds {what}, not a string; fill it or remove the row")
                docs.append(tokenizer.document(value))  # a blank one is counted and skipped (empty_documents.py)
            elif kind == "messages":
                docs.append(chat_document(record[columns[0]], tokenizer))
            else:
                docs.append(prompt_completion_document(record[prompt_field], record[completion_field], tokenizer))
        except ValueError as error:
            raise ValueError(f"{path} row {row + 1} of {len(dataset)} (counted from 1; a CSV header is no row): "
                             f"{error}") from None
    return docs
