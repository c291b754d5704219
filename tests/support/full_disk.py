"""A full disk for the write-contract tests: a real one (a tiny tmpfs, where this process may mount:
root) and a simulated one (a file whose writes stop after a byte budget with ENOSPC, anywhere).

`tiny_tmpfs(path, kib)` mounts a tmpfs of `kib` KiB on `path` and unmounts it on exit (pytest.skip
where mount is refused). `fill(folder, leave=...)` then leaves about `leave` bytes free in it (page
granular). `LimitedFile` is a binary file whose writes take at most `budget` bytes in all, then
write part of a buffer and raise ENOSPC on the next call, as a full disk does.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

PAGE = 4096


@contextlib.contextmanager
def tiny_tmpfs(path: Path, kib: int = 256) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(folder: Path, *, leave: int = 0) -> Path:
    """Write a filler file in `folder` until the file system is full, then give back `leave` bytes
    (rounded up to pages); returns the filler."""
    filler = folder / "filler"
    chunk = b"\0" * (64 * 1024)
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                if f.write(chunk) == 0:
                    break
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                break
        if leave:
            size = f.seek(0, os.SEEK_END)
            f.truncate(max(0, size - -(-leave // PAGE) * PAGE))
    return filler


class LimitedFile(io.FileIO):
    """A binary file that takes `budget` bytes in all, then fails like a full disk (module docstring)."""

    def __init__(self, path, mode: str = "ab", *, budget: int, code: int = errno.ENOSPC):
        super().__init__(path, mode.replace("b", ""))
        self.budget, self.code = budget, code

    def write(self, data) -> int:
        if self.budget <= 0:
            raise OSError(self.code, os.strerror(self.code))
        part = bytes(data)[: self.budget]
        n = super().write(part)
        self.budget -= n
        return n
