"""What verifying a checkpoint costs: seconds per GiB of the sha256 every checkpoint file gets.

Writes a file of random bytes (``--gib``, default 1) into ``--dir`` (default: a temporary
directory), reads it once to warm the page cache, then times ``checkpoint.file_sha256`` (the
streaming hash ``save_checkpoint`` writes into the manifest and ``load_checkpoint`` checks) and,
for comparison, zlib's crc32 over the same file. A save hashes each rank's own shards in
parallel; a load splits the files over the ranks; in one process the time below is paid once
per checkpoint (a verified file is remembered for its size and mtime).

    python benchmarks/checkpoint_hash.py [--gib 1] [--dir /path/on/the/checkpoint/disk]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's hybridpar first

from hybridpar.train.run.checkpoint import _VERIFIED, file_sha256  # noqa: E402


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(16 * 2**20), b""):
            value = zlib.crc32(block, value)
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path = Path(directory) / "__0_0.distcp"
        size = int(args.gib * 2**30)
        with open(path, "wb") as handle:
            for _ in range(0, size, 64 * 2**20):
                handle.write(os.urandom(min(64 * 2**20, size - handle.tell())))
        crc32(path)  # warm the page cache: the timings below are hashing, not the disk
        for name, hash_file in (("sha256 (checkpoint.file_sha256)", file_sha256), ("crc32 (zlib, for comparison)", crc32)):
            _VERIFIED.clear()
            start = time.perf_counter()
            hash_file(path)
            seconds = time.perf_counter() - start
            print(f"{name:32s} {seconds / (size / 2**30):6.2f} s/GiB  ({size / 2**30:.2f} GiB in {seconds:.2f} s)")


if __name__ == "__main__":
    main()
