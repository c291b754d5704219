"""Checkpoint steps on object storage (`gs://.../step-N`), through the storage seam
(trainer/runtime/storage.py).

Object storage has no atomic rename, so the commit point is an object (docs/checkpointing.md "On
object storage (gs://)"): a step is complete iff its `manifest.json` exists (written last, by rank
0, after every rank's DCP files and `.metadata`) and its CRCs match; loaders ignore a step without
one; deleting (keep_latest_k, a re-save of a step) removes the manifest first. The manifest has the
local one's format (trainer/checkpoint/manifest.py): each file's size and per-64-MiB-block CRC-32.
"""

from __future__ import annotations

import json
import re
import time
import zlib

from trainer.checkpoint.manifest import BLOCK_BYTES, MANIFEST, CorruptCheckpointError
from trainer.runtime.storage import SCHEME, bounded_fs, object_path

_STEP = re.compile(r"^step-(\d+)$")
_KEY = "checkpoint.folder"


def complete_steps(url: str) -> list[int]:
    """Steps under `url` whose `step-N/manifest.json` exists (the commit point), ascending."""
    fs = bounded_fs(key=_KEY)
    root = object_path(url)
    try:
        entries = fs.ls(root, detail=False, refresh=True)
    except FileNotFoundError:
        return []
    steps = []
    for entry in entries:
        match = _STEP.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if match and fs.exists(f"{root}/{match.group(0)}/{MANIFEST}"):
            steps.append(int(match.group(1)))
    return sorted(steps)


def incomplete_steps(url: str) -> list[str]:
    """Step prefixes under `url` without a manifest (a save that was killed or failed)."""
    fs = bounded_fs(key=_KEY)
    root = object_path(url)
    try:
        entries = fs.ls(root, detail=False, refresh=True)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if _STEP.match(name) and not fs.exists(f"{root}/{name}/{MANIFEST}"):
            out.append(f"{SCHEME}{root}/{name}")
    return out


def remove_step(url: str) -> None:
    """Delete a step: the manifest first (the step is incomplete from then on), then the rest."""
    fs = bounded_fs(key=_KEY)
    root = object_path(url)
    try:
        fs.rm_file(f"{root}/{MANIFEST}")
    except FileNotFoundError:
        pass
    try:
        fs.rm(root, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(root)


def _crc_blocks(data_at, size: int) -> list[str]:
    out = []
    for start in range(0, size, BLOCK_BYTES) if size else [0]:
        out.append(f"{zlib.crc32(data_at(start, min(size, start + BLOCK_BYTES))):08x}")
    return out


def _files(fs, root: str) -> dict[str, int]:
    fs.invalidate_cache(root)
    return {
        info["name"].rsplit("/", 1)[-1]: int(info["size"])
        for info in fs.ls(root, detail=True, refresh=True)
        if info.get("type") == "file" and not info["name"].endswith("/" + MANIFEST)
    }


def write_manifest(url: str) -> dict:
    """Write `url/manifest.json` (the local manifest's format: each file's size and per-64-MiB-block
    CRC-32) as the step's last object: its existence publishes the step."""
    fs = bounded_fs(key=_KEY)
    root = object_path(url)
    t0 = time.perf_counter()
    files = {}
    for name, size in sorted(_files(fs, root).items()):
        path = f"{root}/{name}"
        files[name] = {"size": size, "crc32": _crc_blocks(lambda a, b: fs.cat_file(path, start=a, end=b), size)}
    manifest = {
        "format": 1,
        "algorithm": "crc32",
        "block_bytes": BLOCK_BYTES,
        "files": files,
        "hash_seconds": round(time.perf_counter() - t0, 3),
    }
    fs.pipe_file(f"{root}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    return manifest


def verify_checkpoint(url: str) -> bool:
    """The local verify_checkpoint for a gs:// step: False without a manifest, True when every file
    matches, CorruptCheckpointError naming the first that does not."""
    fs = bounded_fs(key=_KEY)
    root = object_path(url)
    try:
        manifest = json.loads(fs.cat_file(f"{root}/{MANIFEST}"))
    except FileNotFoundError:
        return False
    except ValueError as e:
        raise CorruptCheckpointError(f"{url}/{MANIFEST} is unreadable ({e})") from None
    sizes = _files(fs, root)
    for name, entry in sorted(manifest["files"].items()):
        path = f"{root}/{name}"
        if name not in sizes:
            raise CorruptCheckpointError(f"{SCHEME}{path} is missing (listed in {MANIFEST})")
        if sizes[name] != entry["size"]:
            raise CorruptCheckpointError(f"{SCHEME}{path} has {sizes[name]} bytes, {MANIFEST} says {entry['size']}")
        got = _crc_blocks(lambda a, b: fs.cat_file(path, start=a, end=b), sizes[name])
        if got != entry["crc32"]:
            raise CorruptCheckpointError(f"{SCHEME}{path} fails its checksum ({MANIFEST} says {entry['crc32']})")
    return True
