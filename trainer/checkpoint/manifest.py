"""Checksums: a manifest of per-file CRC-32s, written with each checkpoint and checked on load."""

from __future__ import annotations

import json
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from models.errors import ConfigError
from trainer.checkpoint.state import short_error
from trainer.runtime.atomic import atomic_file

# ---------------------------------------------------------------------------------------------
# Checksums: a manifest of per-file CRC-32s, written with each checkpoint and checked on load.

MANIFEST = "manifest.json"
BLOCK_BYTES = 64 * 1024 * 1024
_CHUNK = 8 * 1024 * 1024


class CorruptCheckpointError(ConfigError):
    """A checkpoint file is missing, truncated or differs from its checksum in manifest.json."""


def hash_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _block_crc32(path: Path, offset: int, length: int) -> int:
    """CRC-32 of bytes [offset, offset + length) of a file, read in 8 MiB chunks. zlib and
    os.pread release the GIL, so blocks hash in parallel threads."""
    crc = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        end = offset + length
        while offset < end:
            data = os.pread(fd, min(_CHUNK, end - offset), offset)
            if not data:
                break
            crc = zlib.crc32(data, crc)
            offset += len(data)
    finally:
        os.close(fd)
    return crc


def _blocks(size: int) -> list[tuple[int, int]]:
    return [(start, min(BLOCK_BYTES, size - start)) for start in range(0, size, BLOCK_BYTES)] or [(0, 0)]


def crc32_blocks(paths: list[Path]) -> dict[Path, list[str]]:
    """For each file, the CRC-32 of each 64 MiB block as 8-digit hex strings. All blocks of all
    files go to one thread pool (zlib and os.pread release the GIL): ~1.1-1.5 GB/s per core
    here, see docs/checkpointing.md."""
    tasks = [(p, offset, n) for p in paths for offset, n in _blocks(p.stat().st_size)]
    with ThreadPoolExecutor(hash_threads(), thread_name_prefix="ckpt-crc") as pool:
        crcs = list(pool.map(lambda t: _block_crc32(*t), tasks))
    out: dict[Path, list[str]] = {p: [] for p in paths}
    for (p, _, _), crc in zip(tasks, crcs):
        out[p].append(f"{crc:08x}")
    return out


def write_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """Write folder/manifest.json: for every file in the folder its size and the CRC-32 of each
    64 MiB block (hashed in parallel threads), atomically: a temporary file, fsync, rename.
    Call after every rank's files and .metadata are written."""
    folder = Path(folder)
    t0 = time.perf_counter()
    paths = [
        p for p in sorted(folder.iterdir(), key=lambda p: p.name) if p.is_file() and not p.name.startswith(MANIFEST)
    ]
    crcs = crc32_blocks(paths)
    files = {p.name: {"size": p.stat().st_size, "crc32": crcs[p]} for p in paths}
    manifest = {
        "format": 1,
        "algorithm": "crc32",
        "block_bytes": BLOCK_BYTES,
        "files": files,
        "hash_seconds": round(time.perf_counter() - t0, 3),
    }
    with atomic_file(folder / MANIFEST, what="checkpoint manifest", mode="w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def verify_checkpoint(folder: str | os.PathLike) -> bool:
    """Check every file listed in folder/manifest.json (presence and size, then the CRC-32 of
    each block, in parallel threads).

    Returns False when there is no manifest (a checkpoint written before manifests existed:
    nothing to check), True when every file matches; raises CorruptCheckpointError naming the
    first file (and byte range) that is missing, of another size, or fails its checksum.
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        assert manifest.get("algorithm") == "crc32" and manifest.get("block_bytes") == BLOCK_BYTES
    except Exception as e:  # noqa: BLE001 - a damaged manifest is a damaged checkpoint
        raise CorruptCheckpointError(f"{path} is unreadable ({type(e).__name__}: {short_error(e)})") from None
    for name, entry in sorted(files.items()):
        file = folder / name
        if not file.is_file():
            raise CorruptCheckpointError(f"{file} is missing (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CorruptCheckpointError(f"{file} has {size} bytes, {MANIFEST} says {entry['size']}")
    crcs = crc32_blocks([folder / name for name in sorted(files)])
    for name in sorted(files):
        entry, got = files[name], crcs[folder / name]
        for i, (a, b) in enumerate(zip(got, entry["crc32"])):
            if a != b:
                start, n = _blocks(entry["size"])[i]
                where = f" in bytes {start}-{start + n - 1}" if len(got) > 1 else ""
                raise CorruptCheckpointError(
                    f"{folder / name} fails its checksum{where} (crc32 {a}, {MANIFEST} says {b})"
                )
        if len(got) != len(entry["crc32"]):
            raise CorruptCheckpointError(
                f"{folder / name}: {MANIFEST} lists {len(entry['crc32'])} blocks, not {len(got)}"
            )
    return True
