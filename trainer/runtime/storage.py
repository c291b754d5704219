"""The storage seam: local paths keep the local code path; `gs://bucket/prefix` goes through fsspec (gcsfs).

What this module provides: which paths are object storage (`is_remote`, `split_url`), the bounded
gcsfs file system (`bounded_fs`), the one-line text of a failed call (`error_text`), the start-up
checks of a recipe's paths (`check_storage_paths`, `check_bucket`, `check_shared_folder`). What is
built on it lives with its concern (docs/checkpointing.md "On object storage (gs://)"): the gs://
checkpoint steps and their manifest in trainer/checkpoint/remote.py, the gs:// run lock in
trainer/runtime/runlock.py.

- errors (a missing bucket, access denied, a malformed URL) come out as one ConfigError line
  naming the key;
- every remote call is bounded by `timeout_s()` (training.startup_timeout_s, set by
  `check_storage_paths`): each call through `bounded_fs` as a whole (gcsfs's retries included), and
  every HTTP request gcsfs makes, DCP's transfers too, by "no connection or no bytes for that long" (a
  transfer that stalls is retried by gcsfs, at most 6 tries). An endpoint that accepts and never
  answers is `RemoteUnreachable`, "no answer from ENDPOINT within T s"; one that refuses is "cannot
  connect to ENDPOINT (Connection refused)", found at once by the start-up probe (`check_bucket`
  connects first); either is one line, and gcsfs's own log of the failure (a traceback) is dropped.

gcsfs is an optional dependency (the `[gcs]` extra); it is imported only for a `gs://` path.
`STORAGE_EMULATOR_HOST` (http://host:port) points gcsfs at an emulator (anonymous access).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import uuid
from typing import Any

SCHEME = "gs://"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


def _config_error(message: str) -> Exception:
    from models.errors import ConfigError  # imported when needed: this module stays torch-free

    return ConfigError(message)


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


def bounded_fs(*, key: str) -> _Bounded:
    """The gcsfs file system with every call bounded (`_Bounded`); ConfigError naming `key` if gcsfs
    is missing."""
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
    fs = bounded_fs(key=key)
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


def object_path(url: str) -> str:
    """`gs://bucket/prefix` as gcsfs names it (`bucket/prefix`); a local path unchanged."""
    return url[len(SCHEME) :].rstrip("/") if url.startswith(SCHEME) else url


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
