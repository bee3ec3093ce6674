"""The weight files of a Hugging Face checkpoint, checked before any value is used.

safetensors files carry no checksum, so what can be checked is checked, with one line that
names the file or tensor:

- **structure** (``safetensors_problem``): the 8-byte header length, the JSON header, and
  tensor byte ranges that lie inside the file and cover it exactly. A truncated or
  overwritten-at-the-end file fails here, for both backends, before transformers or
  safetensors read it;
- **the index** of a sharded checkpoint: valid JSON with a ``weight_map``, every shard present;
- **values** (``check_finite``): every loaded tensor finite, or the tensor is named (a NaN
  or inf in a weight would otherwise surface steps later as a "non-finite loss");
- **kinds** (``check_floating``): a parameter stored as integers, booleans or float8 (a quantized
  or damaged file) is refused, naming it; loading would cast it to float without a word.

A byte flipped inside the data that leaves a finite value is not detected: safetensors has
no checksum for it (hybridpar's own training checkpoints do: ``train/run/checkpoint.py``).
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from hybridpar.config_rules import Notice, quoted, shorten
from hybridpar.strict_json import DuplicateKeyError, check_files, check_readable, loads as strict_loads

__all__ = ["safetensors_problem", "weight_files", "load_weight_file", "check_finite", "stored_dtypes", "check_floating"]

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header
FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what a trained weight may be stored in
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def safetensors_problem(file: str | Path) -> str | None:
    """What is wrong with the structure of safetensors ``file`` (truncated, not safetensors), or None."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as handle:
        start = handle.read(8)
        if len(start) < 8:
            return f"it has {size} bytes, less than the 8-byte header length (truncated or empty)"
        (header_bytes,) = struct.unpack("<Q", start)
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            return (f"its header claims {header_bytes:,} bytes but the file has {size:,} (truncated, or not a "
                    "safetensors file)")
        try:
            header = strict_loads(handle.read(header_bytes))
        except DuplicateKeyError as error:  # safetensors keeps one of the two without a word
            return f"its header describes the tensor {quoted(error.key)} twice (only one of them would be loaded)"
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            return f"its header is not valid JSON ({shorten(str(error), 80)}; not a safetensors file?)"
    if not isinstance(header, dict):
        return "its header is not a JSON object (not a safetensors file?)"
    data_bytes, covered = size - 8 - header_bytes, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            count = 1
            for dim in entry["shape"]:
                count *= int(dim)
            expected = count * _DTYPE_BYTES.get(entry["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            return f"its header entry for tensor {quoted(name)} is malformed"
        if not 0 <= begin <= end <= data_bytes:
            return (f"tensor {quoted(name)} lies at bytes [{begin:,}, {end:,}) of the data but the file holds "
                    f"{data_bytes:,} bytes of data (truncated)")
        if expected and end - begin != expected:
            return f"tensor {quoted(name)} has {end - begin:,} bytes but its shape and dtype need {expected:,}"
        covered = max(covered, end)
    if covered != data_bytes:
        return f"its tensors cover {covered:,} of its {data_bytes:,} data bytes (extra bytes appended?)"
    return None


def weight_files(path: str | Path, weights_file: str, index_file: str, say: bool = True) -> list[Path]:
    """The safetensors files of checkpoint directory ``path`` (``weights_file``, or the shards
    ``index_file`` lists), each checked by ``safetensors_problem``; ValueError naming the file.
    ``say``: warn what loads but is doubtful (both kinds of file, an index unlike its shards)."""
    path = Path(path)
    check_files(path)  # the index and weights: regular files, the index within its cap
    weight_map = None
    if (path / weights_file).is_file():
        files = [path / weights_file]
        if say and (path / index_file).is_file():  # transformers loads the one file too; the shards may be newer
            warnings.warn(f"{path} holds both {weights_file} and a sharded {index_file}: {weights_file} is loaded, as "
                          "transformers loads it, and the shards are not read; remove whichever is stale", Notice,
                          stacklevel=2)
    elif (path / index_file).is_file():
        index = path / index_file
        try:
            weight_map = strict_loads(index.read_text(encoding="utf-8"), str(index))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except DuplicateKeyError:
            raise
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError, RecursionError) as error:
            raise ValueError(f"{index} is not a valid safetensors index (a JSON object with a weight_map of tensor -> "
                             f"shard file; {shorten(str(error), 80)}); restore it from the checkpoint.") from None
        files = []
        for shard in shards:
            if isinstance(shard, str) and (Path(shard).is_absolute() or ".." in Path(shard).parts):
                raise ValueError(f"{index} lists the shard {quoted(shard)}, outside {path}; a checkpoint's shards are "
                                 "files in its own directory: restore the index from the checkpoint.")
            if isinstance(shard, str):
                check_readable(path / shard, None)  # a FIFO or a device link: named as such, not "not found"
            if not isinstance(shard, str) or not (path / shard).is_file():
                raise FileNotFoundError(f"{path / str(shard)} not found; {index_file} lists it as a shard.")
            files.append(path / shard)
    else:
        raise FileNotFoundError(f"{path / weights_file} not found (nor a sharded {index_file}); "
                                "save the weights in safetensors format there.")
    for file in files:
        problem = safetensors_problem(file)
        if problem:
            raise ValueError(f"{file} cannot be read: {problem}; copy or export the checkpoint again.")
    holder: dict[str, Path] = {}
    for file in files if weight_map is not None else ():  # a tensor in two shards: a loader keeps one of them silently
        for name in _header(file):
            if name != "__metadata__" and holder.setdefault(name, file) != file:
                raise ValueError(f"the tensor {quoted(name)} is stored in two shards, {holder[name].name} and "
                                 f"{file.name} (in {path}); only one of them would be loaded: restore the checkpoint "
                                 "(each tensor in exactly one shard).")
    if weight_map is not None:
        _check_index(path / index_file, weight_map, holder, say)
    return files


def _check_index(index: Path, weight_map: dict, holder: dict[str, Path], say: bool) -> None:
    """The index against what the shards hold: a tensor listed under a shard that does not hold it while another does
    was loaded as missing ("check config.json"); one no shard holds, or one a shard holds that the index does not list
    (transformers loads only what the index lists), is said."""
    moved = [(name, shard) for name, shard in weight_map.items() if name in holder and holder[name] != index.parent / shard]
    if moved:
        name, shard = moved[0]
        raise ValueError(f"{index} lists the tensor {quoted(name)} in {shard}, but {holder[name].name} holds it "
                         f"({len(moved)} such tensor(s)): the index does not describe these shards; restore the "
                         "checkpoint's index (save_pretrained writes it with the shards).")
    unheld, unlisted = sorted(set(weight_map) - set(holder)), sorted(set(holder) - set(weight_map))
    if say and (unheld or unlisted):
        said = [f"lists {len(unheld)} tensor(s) no shard holds ({quoted(unheld[:3], 200)})"] if unheld else []
        said += [f"does not list {len(unlisted)} tensor(s) the shards hold ({quoted(unlisted[:3], 200)}: transformers skips them)"] \
            if unlisted else []
        warnings.warn(f"{index} {' and '.join(said)}; the index may be stale: restore the checkpoint's index", Notice,
                      stacklevel=3)


def _header(file: Path) -> dict:
    """The JSON header of safetensors ``file``, which ``safetensors_problem`` has checked."""
    with open(file, "rb") as handle:
        (header_bytes,) = struct.unpack("<Q", handle.read(8))
        return strict_loads(handle.read(header_bytes))


def load_weight_file(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; ValueError naming the file for anything unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except (SafetensorError, OSError, RuntimeError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"{file} cannot be read: {shorten(first, 160)}; copy or export the checkpoint "
                         "again.") from None


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """ValueError naming the first tensors (with their counts of NaN and inf) that are not finite."""
    bad = []
    for name, tensor in tensors:
        if tensor.is_floating_point() or tensor.is_complex():
            finite = torch.isfinite(tensor)
            if not bool(finite.all()):
                nan = int(torch.isnan(tensor).sum())
                bad.append(f"{name} ({nan} NaN, {int((~finite).sum()) - nan} inf of {tensor.numel():,})")
    if bad:
        more = f" and {len(bad) - 3} more tensors" if len(bad) > 3 else ""
        raise ValueError(f"{source} holds non-finite weights: {', '.join(bad[:3])}{more}; training or generating from "
                         "them would only produce NaN. The file is damaged or was saved after a divergence: use an "
                         "earlier checkpoint or export it again.")


def stored_dtypes(files: Iterable[Path]) -> dict[str, str]:
    """Tensor name -> safetensors dtype (``"F32"``, ``"I32"``, ...) from the headers of ``files``,
    which ``weight_files`` has checked."""
    dtypes = {}
    for file in files:
        header = _header(file)
        dtypes.update({name: entry["dtype"] for name, entry in header.items() if name != "__metadata__"})
    return dtypes


def check_floating(dtypes: dict[str, str | torch.dtype], parameters: Iterable[str], source: str) -> None:
    """ValueError naming the ``parameters`` that ``dtypes`` (torch dtypes, or safetensors' names from
    ``stored_dtypes``) holds in a kind a float parameter cannot take without losing its values:
    integers, booleans, float8 (a quantized or damaged file; loading would cast it without a word)."""
    floating = {*FLOATING, "F16", "BF16", "F32", "F64"}
    bad = [f"{name} ({str(dtypes[name]).removeprefix('torch.')})" for name in parameters
           if name in dtypes and dtypes[name] not in floating]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(f"{source} stores weights that are not floating point: {', '.join(bad[:3])}{more}; "
                         "hybridpar trains weights stored as float16, bfloat16, float32 or float64. A quantized or "
                         "damaged file: use the unquantized checkpoint, or export it again.")
