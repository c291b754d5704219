"""Writes that never leave half a file or folder at their destination, and one line when a write fails.

- `atomic_dir(dest)` / `atomic_file(dest)` / `atomic_path(dest)`: write under a temporary name next to `dest` (same
  folder, so the same file system) and rename onto `dest` only when the block finishes; on any
  error the temporary output is removed and `dest` is as it was. An OSError (disk full, file too
  large, permission) comes out as `WriteFailed`, one line with the errno text.
- `write_error_text(error, path)`: the errno text of a failed write ("No space left on device",
  "File too large", "Permission denied"), found in the exception's chain, in DCP's per-rank
  failures, or (for torch's zip writer, which reports a full disk as "unexpected pos N vs M")
  from the free space left under `path`.
- `check_writable_dir(path, key=...)`: make the folder if missing and prove a file can be created
  in it; ConfigError naming the key and the errno text otherwise. The trainer runs it on the
  dump and checkpoint folders before step 1.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

# torch's zip writer (torch.save, PyTorchStreamWriter) drops the errno of a failed write and says
# only that the file position is not where it should be.
_LOST_ERRNO_MARKERS = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")
_FULL_BELOW_BYTES = 1 << 20
_ALLOWED_DIR = "allowed: a folder this process can create and write"


class WriteFailed(RuntimeError):
    """A write failed; its temporary output is removed and the destination is untouched. The
    message is one line: what was written, where, and the errno text."""


def _errno_in(error: BaseException | None, seen: set[int] | None = None) -> int | None:
    """The first errno in `error`, its cause/context chain and DCP's per-rank failures."""
    seen = set() if seen is None else seen
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return error.errno
        failures = getattr(error, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            for _, failure in sorted(failures.items(), key=lambda item: item[0]):
                cause = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(cause, BaseException) and (code := _errno_in(cause, seen)) is not None:
                    return code
        error = error.__cause__ or error.__context__
    return None


def _free_bytes(path: str | os.PathLike) -> int | None:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def errno_text(error: BaseException, path: str | os.PathLike) -> str | None:
    """The errno text of a failed write under `path`, or None when the error carries none."""
    code = _errno_in(error)
    if code is None and any(marker in str(error) for marker in _LOST_ERRNO_MARKERS):
        free = _free_bytes(path)
        if free is not None and free < _FULL_BELOW_BYTES:
            code = errno_codes.ENOSPC
    return None if code is None else os.strerror(code)


def write_error_text(error: BaseException, path: str | os.PathLike) -> str:
    """The reason a write under `path` failed, as one line: the errno text when there is one."""
    text = errno_text(error, path)
    if text is not None:
        return text
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def publish(tmp: Path, dest: Path, *, replace: bool) -> None:
    """Rename the finished folder or file `tmp` to `dest` (the one publisher: `atomic_dir`,
    `atomic_path` and the checkpoint manager's save all end here). An empty folder at `dest` is
    taken over; an occupied one raises FileExistsError unless `replace`, which moves the old copy
    aside (`.old-<name>-*`) first, so `dest` is at every instant either the old or the new one."""
    if _is_empty_dir(dest):
        os.rmdir(dest)  # an empty folder made for the output: taken over (fails if it filled meanwhile)
    if dest.exists() or dest.is_symlink():
        if not replace:
            raise FileExistsError(errno_codes.EEXIST, os.strerror(errno_codes.EEXIST), str(dest))
        if dest.is_dir() and not dest.is_symlink():
            # A folder cannot be renamed over a non-empty one: move the old copy aside first, so
            # `dest` is at every instant either the old output or the new one, never a mix.
            old = Path(tempfile.mkdtemp(prefix=f".old-{dest.name}-", dir=dest.parent))
            os.rename(dest, old / dest.name)
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
            return
    os.replace(tmp, dest)


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike, *, what: str = "output", replace: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder next to `dest`; rename it to `dest` when the block ends.

    replace: an existing `dest` is replaced (moved aside, then removed); otherwise only an empty
    folder is (the caller refuses occupied destinations before doing any work). On any exception the
    temporary folder is removed; an OSError becomes WriteFailed with the errno text.
    """
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    except OSError as e:
        raise WriteFailed(f"writing {what} {dest} failed: {write_error_text(e, dest.parent)}") from e
    try:
        yield tmp
        publish(tmp, dest, replace=replace)
    except BaseException as e:
        _remove(tmp)
        if _is_write_error(e):
            raise WriteFailed(
                f"writing {what} {dest} failed: {write_error_text(e, dest.parent)}; nothing was left at the destination"
            ) from e
        raise


@contextlib.contextmanager
def atomic_file(dest: str | os.PathLike, *, what: str = "file", mode: str = "wb") -> Iterator:
    """Yield a file object open on a temporary name next to `dest`; flush, fsync and rename it to
    `dest` when the block ends (replacing an older `dest`). Removed on any error (see atomic_dir)."""
    with atomic_path(dest, what=what) as tmp, open(tmp, mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike, *, what: str = "file") -> Iterator[Path]:
    """Yield a temporary path beside `dest` with the same suffix (for writers that take a path and
    read the format from its extension, e.g. PIL's `Image.save`); renamed to `dest` when the block
    ends, removed on any error (see atomic_dir)."""
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".tmp-{dest.stem}-", suffix=dest.suffix, dir=dest.parent)
        os.close(fd)
    except OSError as e:
        raise WriteFailed(f"writing {what} {dest} failed: {write_error_text(e, dest.parent)}") from e
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        publish(tmp, dest, replace=True)
    except BaseException as e:
        _remove(tmp)
        if _is_write_error(e):
            raise WriteFailed(
                f"writing {what} {dest} failed: {write_error_text(e, dest.parent)}; {dest} is unchanged"
            ) from e
        raise


def _is_write_error(error: BaseException) -> bool:
    """A failure of the write itself (wrapped as WriteFailed), not a refusal of bad input
    (ConfigError) or an earlier WriteFailed, which pass through unchanged."""
    errors = sys.modules.get("models.errors")  # nothing raised a ConfigError if it was never imported
    if isinstance(error, WriteFailed) or (errors is not None and isinstance(error, errors.ConfigError)):
        return False
    return (
        isinstance(error, OSError)
        or _errno_in(error) is not None
        or any(marker in str(error) for marker in _LOST_ERRNO_MARKERS)
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _config_error(message: str) -> Exception:
    from models.errors import ConfigError  # imported when needed: this module stays torch-free

    return ConfigError(message)


def make_dir(path: str | os.PathLike, *, key: str) -> None:
    """Make folder `path` (and its parents) if missing; ConfigError naming `key`, the path and the
    errno text if it cannot be (a file in its place, a path under a regular file, no permission)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise _config_error(
            f"{key}: cannot use {path}: {os.strerror(errno_codes.ENOTDIR)} (a file is in its place); {_ALLOWED_DIR}"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _config_error(f"{key}: cannot create {path}: {write_error_text(e, path)}; {_ALLOWED_DIR}") from None


def check_writable_dir(path: str | os.PathLike, *, key: str, keep: bool = True) -> None:
    """`make_dir`, then create (and remove) a file in the folder; ConfigError naming `key`, the
    path and the errno text if either fails. keep=False: folders made for the check are removed
    again (a run that stops on bad input later leaves no empty checkpoint folder behind)."""
    path = Path(path).absolute()
    first_missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        first_missing = p
    make_dir(path, key=key)
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _config_error(f"{key}: cannot write to {path}: {write_error_text(e, path)}; {_ALLOWED_DIR}") from None
    finally:
        if not keep and first_missing is not None:
            with contextlib.suppress(OSError):
                for p in (path, *path.parents):
                    os.rmdir(p)
                    if p == first_missing:
                        break
