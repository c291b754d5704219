"""The storage seam: local paths keep the local code path; `gs://bucket/prefix` goes through fsspec (gcsfs).

Object storage has no atomic rename and no flock, so the contract is kept differently there
(docs/checkpointing.md "On object storage (gs://)"):

- a checkpoint step `gs://.../step-N` is complete iff its `manifest.json` exists (written last, by
  rank 0, after every rank's DCP files and `.metadata`) and its CRCs match; loaders ignore a
  step without one; deleting (keep_latest_k, a re-save of a step) removes the manifest first;
- the run lock is an object `.run.lock` created with a generation precondition (GCS
  `ifGenerationMatch=0`: the create fails if the object exists), holding a nonce, host and pid,
  read back after the create (a store that ignores the precondition, such as an emulator, is
  caught when two writers race far enough apart); it is deleted on release. Nothing releases it
  when the holder dies: a record of this host whose pid is gone is stale and taken over; one of
  another host is refused with the object to delete (the local lock's no-flock rule);
- errors (a missing bucket, access denied, a malformed URL) come out as one ConfigError line
  naming the key;
- every remote call is bounded by `timeout_s()` (training.startup_timeout_s, set by
  `check_storage_paths`): each call of this module as a whole (gcsfs's retries included), and every
  HTTP request gcsfs makes, DCP's transfers too, by "no connection or no bytes for that long" (a
  transfer that stalls is retried by gcsfs, at most 6 tries). An endpoint that accepts and never
  answers is `RemoteUnreachable`, "no answer from ENDPOINT within T s"; one that refuses is "cannot
  connect to ENDPOINT (Connection refused)", found at once by the start-up probe (`check_bucket`
  connects first); either is one line, and gcsfs's own log of the failure (a traceback) is dropped.

gcsfs is an optional dependency (the `[gcs]` extra); it is imported only for a `gs://` path.
`STORAGE_EMULATOR_HOST` (http://host:port) points gcsfs at an emulator (anonymous access).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import time
import uuid
import zlib
from typing import Any

SCHEME = "gs://"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
LOCK_NAME = ".run.lock"
MANIFEST = "manifest.json"
BLOCK_BYTES = 64 * 1024 * 1024
_STEP = re.compile(r"^step-(\d+)$")


def _config_error(message: str) -> Exception:
    from models.errors import ConfigError  # imported when needed: this module stays torch-free

    return ConfigError(message)


def _is_config_error(error: BaseException) -> bool:
    errors = sys.modules.get("models.errors")
    return errors is not None and isinstance(error, errors.ConfigError)


def is_remote(path: Any) -> bool:
    """Whether `path` names object storage (a `gs://` URL); any other `scheme://` is not supported."""
    return isinstance(path, str) and "://" in path


def split_url(url: str, *, key: str) -> tuple[str, str]:
    """(bucket, prefix) of `gs://bucket/prefix`; ConfigError naming `key` for anything else."""
    allowed = "allowed: a local path or gs://BUCKET/PREFIX (bucket: 3-222 lowercase letters, digits, '-', '_', '.')"
    if not url.startswith(SCHEME):
        raise _config_error(f"{key}: {url!r} is not a supported URL; {allowed}")
    bucket, _, prefix = url[len(SCHEME) :].partition("/")
    if not _BUCKET.match(bucket) or "//" in prefix:
        raise _config_error(f"{key}: {url!r} is a malformed gs:// URL; {allowed}")
    return bucket, prefix.rstrip("/")


# The bound of every remote call, in seconds: training.startup_timeout_s (its default until
# check_storage_paths sets the recipe's; tests/unit/test_gcs_timeouts.py checks they agree).
_TIMEOUT_S = [900.0]


def set_timeout(seconds: float) -> None:
    """Bound every remote call of this process by `seconds` (module docstring)."""
    _TIMEOUT_S[0] = float(seconds)


def timeout_s() -> float:
    return _TIMEOUT_S[0]


class RemoteUnreachable(ConnectionError):
    """The storage endpoint refused the connection or did not answer within `timeout_s()`; the
    message is one line naming the endpoint."""


def endpoint() -> str:
    """The HTTP endpoint gcsfs talks to: STORAGE_EMULATOR_HOST (as gcsfs reads it) or Google's."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host and host != "default":
        return host if host.startswith(("http://", "https://")) else f"http://{host}"
    return "https://storage.googleapis.com"


def fs_kwargs() -> dict:
    """gcsfs arguments: anonymous against an emulator (STORAGE_EMULATOR_HOST), default credentials
    otherwise; every HTTP request fails after `timeout_s()` without a connection or without bytes
    (aiohttp's sock_connect / sock_read; no bound on a transfer that keeps moving)."""
    import aiohttp  # gcsfs's HTTP client, present with it

    limit = timeout_s()
    out: dict[str, Any] = {"requests_timeout": aiohttp.ClientTimeout(total=None, sock_connect=limit, sock_read=limit)}
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        out["token"] = "anon"
    return out


class _DropGcsfsTracebacks(logging.Filter):
    """gcsfs logs a failed request's traceback before raising it; the caller says it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.levelno >= logging.ERROR)


_GCSFS_LOG_FILTER = _DropGcsfsTracebacks()


def filesystem(*, key: str):
    """The gcsfs file system (one per process and timeout); ConfigError naming `key` if gcsfs is
    missing. Its calls from this module go through `_Bounded` (module docstring)."""
    # gcsfs's experimental zonal/HNS probe asks the storage-control gRPC service about every bucket
    # (a 60 s timeout per call against an emulator); plain buckets need none of it.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    try:
        import gcsfs
    except ImportError:
        raise _config_error(
            f"{key}: a gs:// path needs gcsfs, which is not installed; allowed: pip install -e '.[gcs]', or a local path"
        ) from None
    log = logging.getLogger("gcsfs")
    if _GCSFS_LOG_FILTER not in log.filters:
        log.addFilter(_GCSFS_LOG_FILTER)
    return gcsfs.GCSFileSystem(**fs_kwargs())


def _refused(error: BaseException) -> OSError | None:
    """The refused or failed connection in `error`'s chain (aiohttp's ClientConnectorError keeps it)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "os_error", None)  # aiohttp.ClientConnectorError
        if isinstance(inner, OSError):
            return inner
        if isinstance(error, (ConnectionRefusedError, socket.gaierror)):
            return error
        error = error.__cause__ or error.__context__
    return None


def _timed_out(error: BaseException) -> bool:
    import asyncio

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (asyncio.TimeoutError, TimeoutError)) or type(error).__name__ == "FSTimeoutError":
            return True
        error = error.__cause__ or error.__context__
    return False


def unreachable(error: BaseException) -> RemoteUnreachable | None:
    """`error` as RemoteUnreachable (one line naming the endpoint) when it is a timeout or a failed
    connection; None for anything else (a missing bucket, denied access...)."""
    if isinstance(error, RemoteUnreachable):
        return error
    refused = _refused(error)
    if refused is not None:
        why = refused.strerror or str(refused) or type(refused).__name__
        return RemoteUnreachable(f"cannot connect to {endpoint()} ({why})")
    if _timed_out(error):
        return RemoteUnreachable(f"no answer from {endpoint()} within {timeout_s():g} s")
    return None


class _Bounded:
    """A gcsfs file system whose calls each end within `timeout_s()`, gcsfs's retries included
    (fsspec's `timeout=`, which cancels the request), and raise RemoteUnreachable when the endpoint
    refuses or does not answer."""

    _LOCAL = frozenset({"invalidate_cache"})

    def __init__(self, fs):
        self.fs = fs

    def __getattr__(self, name: str):
        method = getattr(self.fs, name)
        if name in self._LOCAL or not callable(method):
            return method

        def call(*args, **kwargs):
            try:
                return method(*args, timeout=timeout_s(), **kwargs)
            except Exception as e:  # noqa: BLE001 - mapped or passed on unchanged
                problem = unreachable(e)
                if problem is None:
                    raise
                raise problem from None

        return call


def _fs(*, key: str) -> _Bounded:
    return _Bounded(filesystem(key=key))


def probe_endpoint() -> None:
    """Connect to the endpoint once (a TCP connection, no request): RemoteUnreachable at once when
    it refuses, cannot be resolved, or does not accept within `timeout_s()`."""
    from urllib.parse import urlsplit

    url = urlsplit(endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s()).close()
    except TimeoutError:
        raise RemoteUnreachable(f"no answer from {endpoint()} within {timeout_s():g} s") from None
    except OSError as e:
        raise RemoteUnreachable(f"cannot connect to {endpoint()} ({e.strerror or e})") from None


def error_text(error: BaseException, url: str) -> str:
    """One line for a failed object-storage call on `url`: missing bucket, access denied, or the first line."""
    bucket = url[len(SCHEME) :].split("/", 1)[0] if url.startswith(SCHEME) else url
    far = unreachable(error)
    if far is not None:
        return str(far)
    text = str(error)
    if isinstance(error, FileNotFoundError) and f"b/{bucket}/" in text + "/" and "/o/" not in text:
        return f"bucket {bucket} does not exist"
    code = getattr(error, "code", None)
    if isinstance(error, PermissionError) or code in (401, 403) or text.startswith("Forbidden"):
        return f"access to gs://{bucket} denied (check the credentials' roles on the bucket: storage.objectAdmin)"
    lines = text.strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__


def check_bucket(url: str, *, key: str) -> None:
    """ConfigError naming `key` unless `url`'s bucket exists and this process may list and write it
    (a probe object is created and deleted)."""
    bucket, prefix = split_url(url, key=key)
    fs = _fs(key=key)
    probe = f"{bucket}/{prefix + '/' if prefix else ''}.write-check-{uuid.uuid4().hex}"
    try:
        probe_endpoint()  # a refusal at once, not after gcsfs's retries
        fs.ls(bucket, detail=False, refresh=True)
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except Exception as e:  # noqa: BLE001 - any failure here is the user's bucket or credentials
        why = error_text(e, url)
        if why.startswith("bucket") and "does not exist" in why:
            why = f"{why} (create it: gcloud storage buckets create gs://{bucket})"
        allowed = "a gs:// bucket this job can write"
        if isinstance(unreachable(e), RemoteUnreachable):
            allowed += f", at an endpoint that answers within training.startup_timeout_s ({timeout_s():g} s)"
        raise _config_error(f"{key}: cannot use {url}: {why}; allowed: {allowed}") from None


def _path(url: str) -> str:
    return url[len(SCHEME) :].rstrip("/") if url.startswith(SCHEME) else url


# -- checkpoints -----------------------------------------------------------------------------


def complete_steps(url: str) -> list[int]:
    """Steps under `url` whose `step-N/manifest.json` exists (the commit point), ascending."""
    fs = _fs(key="checkpoint.folder")
    root = _path(url)
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
    fs = _fs(key="checkpoint.folder")
    root = _path(url)
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
    fs = _fs(key="checkpoint.folder")
    root = _path(url)
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
    fs = _fs(key="checkpoint.folder")
    root = _path(url)
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
    from trainer.checkpoint.manifest import CorruptCheckpointError

    fs = _fs(key="checkpoint.folder")
    root = _path(url)
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


# -- the run lock ----------------------------------------------------------------------------

_HELD: dict[str, RemoteLock] = {}


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True
    return True


def describe_owner(record: dict | None) -> str:
    if not record:
        return "owner unknown (its record is being written or was damaged)"
    return f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, started {record.get('started', '?')}" + (
        f", command: {record['command']}" if record.get("command") else ""
    )


class RemoteLock:
    """One writer per gs:// run folder (module docstring). `acquire()` raises FolderInUse naming
    the holder, or ConfigError naming `key` for a missing bucket or denied access."""

    def __init__(self, folder: str, *, key: str, in_use=None):
        self.folder = folder.rstrip("/")
        self.key = key
        # The refusal's exception type (runlock's FolderInUse; a ConfigError by default): passed in,
        # so this module imports neither runlock nor, at import time, torch.
        self.in_use = in_use or _config_error
        split_url(self.folder, key=key)
        self.path = f"{_path(self.folder)}/{LOCK_NAME}"
        self.record: dict | None = None

    def _read(self, fs) -> dict | None:
        try:
            record = json.loads(fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return record if isinstance(record, dict) else {}

    def _refuse(self, record: dict | None) -> Exception:
        return self.in_use(
            f"{self.key}: {self.folder} is in use by another run ({describe_owner(record)}); object storage "
            f"cannot tell whether a run on another host still lives: delete {SCHEME}{self.path} if that run has "
            "ended; allowed: a folder no other run writes: wait for that run, stop it, or choose another folder"
        )

    def acquire(self) -> RemoteLock:
        if self.folder in _HELD:
            return _HELD[self.folder]
        check_bucket(self.folder, key=self.key)
        try:
            return self._acquire()
        except Exception as e:  # noqa: BLE001 - a refusal passes; a failed call is one line naming the key
            if _is_config_error(e):
                raise
            raise _config_error(
                f"{self.key}: cannot take the lock {SCHEME}{self.path}: {error_text(e, self.folder)}; "
                "allowed: a gs:// folder this job can write"
            ) from None

    def _acquire(self) -> RemoteLock:
        fs = _fs(key=self.key)
        mine = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": " ".join(sys.argv)[:120],
            "nonce": uuid.uuid4().hex,
        }
        for _ in range(2):
            fs.invalidate_cache(self.path)
            record = self._read(fs)  # looked at first: an emulator may ignore the precondition
            if record is not None:
                if not self._stale(record, mine):
                    raise self._refuse(record)
                fs.rm_file(self.path)  # a dead holder of this host: taken over
            try:
                fs.pipe_file(self.path, json.dumps(mine).encode(), mode="create")  # ifGenerationMatch=0
            except FileExistsError:
                pass
            except Exception as e:  # noqa: BLE001
                raise _config_error(
                    f"{self.key}: cannot create the lock {SCHEME}{self.path}: {error_text(e, self.folder)}; "
                    "allowed: a gs:// folder this job can write"
                ) from None
            fs.invalidate_cache(self.path)
            record = self._read(fs)
            if record and record.get("nonce") == mine["nonce"]:
                self.record = mine
                _HELD[self.folder] = self
                return self
            if record is not None and not self._stale(record, mine):
                raise self._refuse(record)  # another writer created it first
        raise self._refuse(self._read(fs))

    @staticmethod
    def _stale(record: dict, mine: dict) -> bool:
        """A record of this host whose process is gone (another host's cannot be checked)."""
        return (
            record.get("host") == mine["host"]
            and record.get("pid") != mine["pid"]
            and not _pid_alive(record.get("pid"))
        )

    def release(self, *, undo: bool = False) -> None:
        """Delete the lock object if it is still this process's."""
        if _HELD.get(self.folder) is not self:
            return
        del _HELD[self.folder]
        fs = _fs(key=self.key)
        try:
            fs.invalidate_cache(self.path)
            record = self._read(fs)
            if record and self.record and record.get("nonce") == self.record["nonce"]:
                fs.rm_file(self.path)
        except Exception:  # noqa: BLE001 - a lock left behind is reported by the next run
            pass


def release_all() -> None:
    for lock in list(_HELD.values()):
        lock.release()


# -- several hosts, a local folder -----------------------------------------------------------

NONCE_NAME = ".host-check-"


def check_shared_folder(folder: str, *, key: str, timeout_s: float) -> None:
    """When the job spans several hosts and `folder` is local, every host's local rank 0 must see
    a nonce file rank 0 wrote into it; otherwise every rank raises the same ConfigError (a
    collective: call it on every rank). The nonce file is removed."""
    import torch.distributed as dist

    if is_remote(folder) or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # torchrun's GROUP_WORLD_SIZE is its node count; otherwise ranks over processes per host.
    hosts = max(int(os.environ.get("GROUP_WORLD_SIZE", "0") or 0), -(-world // max(local_world, 1)))
    if hosts <= 1:
        return
    from trainer.runtime.device import cpu_backend

    group = dist.new_group(backend=cpu_backend(), timeout=_timedelta(timeout_s))
    rank = dist.get_rank()
    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    name = os.path.join(folder, NONCE_NAME + box[0])
    made = None
    if rank == 0:
        try:
            os.makedirs(folder, exist_ok=True)
            with open(name, "w") as f:
                f.write(socket.gethostname())
            made = name
        except OSError:
            pass
    dist.barrier(group=group)
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(local_world, 1)))
    seen = 1
    if local_rank == 0:
        seen = int(os.path.isfile(name))
    import torch

    flag = torch.tensor([seen], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    dist.barrier(group=group)
    if made:
        try:
            os.unlink(made)
        except OSError:
            pass
    dist.destroy_process_group(group)
    if int(flag.item()) == 0:
        raise _config_error(
            f"{key}: {folder} is a local folder that not every host of this {hosts}-host job sees (a file rank 0 "
            "wrote there is missing on another host); allowed: a shared file system mounted on every host at the "
            "same path, or a gs:// URL"
        )


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


# -- which keys take gs:// --------------------------------------------------------------------

# Keys whose files this trainer writes or reads with local-file APIs; a gs:// value is refused
# (docs/checkpointing.md "On object storage (gs://)": checkpoints go to gs://, these stay local).
_LOCAL_ONLY = {
    "job.dump_folder": "metrics.jsonl, config.toml, TensorBoard and traces are written with local-file APIs",
    "training.dataset": "the data loaders read local files or the Hugging Face hub",
    "validation.dataset": "the data loaders read local files or the Hugging Face hub",
}


def check_storage_paths(cfg) -> None:
    """Before the process group: checkpoint.folder may be gs://BUCKET/PREFIX (checked for form
    here, for the bucket and access at the run lock), and so may compile.cache_dir (form only:
    torch-tpu's cache reads it); the keys of _LOCAL_ONLY must be local. One ConfigError naming
    the key otherwise. Sets the bound of every remote call of the run to
    training.startup_timeout_s (module docstring)."""
    training = getattr(cfg, "training", None)
    if training is not None:
        set_timeout(training.startup_timeout_s)
    for key, why in _LOCAL_ONLY.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section, None), name, None)
        if is_remote(value):
            raise _config_error(
                f"{key}: {value!r} is object storage, which this key does not take ({why}); allowed: a local "
                "or shared-file-system path (copy the data to each host first); checkpoint.folder takes gs://"
            )
    ck = getattr(getattr(cfg, "checkpoint", None), "folder", None)
    if getattr(cfg.checkpoint, "enable", False) and is_remote(ck):
        split_url(ck, key="checkpoint.folder")
    # torch-tpu's tier-3 compilation cache root takes a gs:// prefix as well as a path (its C++
    # reads TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT itself: trainer/runtime/tpu_env.py); only the form
    # is checked here, torch-tpu reads and writes the bucket.
    cache = getattr(getattr(cfg, "compile", None), "cache_dir", None)
    if is_remote(cache):
        split_url(cache, key="compile.cache_dir")
