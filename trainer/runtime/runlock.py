"""One writer per run folder: a lock file that the OS releases when its holder dies.

`RunLock(folder, key=...)` holds an exclusive `flock` on `folder/.run.lock`, a file that also
records the holder (host, pid, start time, command) for the message a second run gets. The OS
drops an flock when the holding process exits for any reason (normal end, error, SIGTERM and
exit 75, SIGKILL, a crash), so a lock left by a dead run never blocks: the next run takes it and
overwrites the owner record. Where the file system has no flock (some network mounts), the
record alone decides: a holder on this host whose pid is gone is stale; one on another host is
reported with the file to delete.

`lock_run(locks=..., writable=...)` is the trainer's start-up step (trainer/job.py, right after
the process group exists, before anything in the run folder is read or written): rank 0 alone
takes the locks and checks that the folders are writable, and its verdict is broadcast, so a
refusal reaches every rank and every rank raises the same ConfigError (exit 2, one `error:`
line) before any collective of the run. A lock file whose owner record cannot be written (a full
disk, a quota) is put back as it was found and every rank raises the same WriteFailed (exit 1, one
`error:` line naming the file and the errno text): not bad input, and nothing left that blocks a
relaunch. Every rank must share the run folder (as DCP needs for
the checkpoint folder), so one lock on rank 0 covers the job on every host.

A run's lock covers its folder and everything under it: a folder is refused while another live
run holds the same folder, a folder above it (a checkpoint folder inside another run's dump
folder) or a folder below it (a dump folder that contains another run's checkpoint folder).
Paths are compared resolved (realpath), so two spellings of one folder collide. Folders below are
found by a bounded walk (`_NESTED_DEPTH` levels, at most `_NESTED_DIRS` folders, not into hidden
folders or `step-N` checkpoints): a live run's folder deeper than that is not seen.

Locks are per process and re-entrant: a process that already holds a folder's lock (a test that
builds two jobs in one process) gets it again; `release_all()` (the trainer's exit) drops them.

On object storage (`RemoteLock`, a gs:// checkpoint folder; docs/checkpointing.md "On object
storage (gs://)") there is no flock: the lock is an object `.run.lock` created with a generation
precondition (GCS `ifGenerationMatch=0`: the create fails if the object exists), holding a nonce,
host and pid, read back after the create (a store that ignores the precondition, such as an
emulator, is caught when two writers race far enough apart); it is deleted on release. Nothing
releases it when the holder dies: a record of this host whose pid is gone is stale and taken over;
one of another host is refused with the object to delete (the no-flock rule above). Its calls go
through the storage seam (trainer/runtime/storage.py), each bounded in time.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import fcntl
import json
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from models.errors import ConfigError
from trainer.runtime import storage
from trainer.runtime.atomic import WriteFailed, check_writable_dir, make_dir, write_error_text

LOCK_NAME = ".run.lock"
_NO_FLOCK = (errno_codes.ENOLCK, errno_codes.EOPNOTSUPP, errno_codes.ENOSYS, errno_codes.EINVAL)
_ALLOWED = "a folder no other run writes: wait for that run, stop it, or choose another folder"
_BUSY = (errno_codes.EWOULDBLOCK, errno_codes.EAGAIN, errno_codes.EACCES)
_NESTED_DEPTH = 3  # levels below a folder searched for another run's lock
_NESTED_DIRS = 2000  # folders looked into at most
_SKIP_DIR = re.compile(r"^(\.|step-\d+$)")  # hidden folders (tmp/old saves), checkpoints


class FolderInUse(ConfigError):
    """Another live process holds the folder's lock."""


def _owner_record() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(sys.argv)[:120],
    }


def read_owner(path: str | os.PathLike) -> dict | None:
    """The owner record of lock file `path` (None if absent or unreadable)."""
    try:
        with open(path) as f:
            record = json.loads(f.read() or "null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


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


_HELD: dict[str, RunLock] = {}


def _read_settled(path: str | os.PathLike) -> dict | None:
    """The holder's record; a holder that just took the lock may not have written it yet."""
    for _ in range(20):
        record = read_owner(path)
        if record:
            return record
        time.sleep(0.05)
    return None


def _record_live(record: dict | None) -> bool:
    """Without flock: whether an owner record names a live holder (another host cannot be checked)."""
    if not record:
        return False
    if record.get("host") != socket.gethostname():
        return True
    return record.get("pid") != os.getpid() and _pid_alive(record.get("pid"))


def _live_owner(folder: str) -> tuple[bool, dict | None]:
    """Whether another live process holds the lock of (resolved) `folder`, and its owner record.
    A shared, non-blocking probe that takes nothing: a folder this process holds is not another's."""
    if folder in _HELD:
        return False, None
    path = os.path.join(folder, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False, None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in _BUSY:
                return True, _read_settled(path)
            if e.errno not in _NO_FLOCK:
                return False, None
            record = read_owner(path)
            return _record_live(record), record
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, None
    finally:
        os.close(fd)


def _nested_folders(root: str):
    """Folders below `root` (resolved, existing) within the walk's bounds (module docstring)."""
    level, seen = [root], 0
    for _ in range(_NESTED_DEPTH):
        below = []
        for parent in level:
            try:
                with os.scandir(parent) as entries:
                    for entry in entries:
                        if _SKIP_DIR.match(entry.name) or not entry.is_dir(follow_symlinks=False):
                            continue
                        seen += 1
                        if seen > _NESTED_DIRS:
                            return
                        yield entry.path
                        below.append(entry.path)
            except OSError:
                continue
        level = below


def _flock_retrying(fd: int) -> None:
    """An exclusive, non-blocking flock; a busy lock is tried again for 0.2 s, since another run's
    `_live_owner` probe holds it shared for an instant."""
    for attempt in range(5):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in _BUSY or attempt == 4:
                raise
            time.sleep(0.05)


def other_run(folder: str | os.PathLike, *, itself: bool = True, above: bool = True) -> str | None:
    """What another live run holds of `folder` (the folder itself unless `itself` is False, one
    above it unless `above` is False, or one below it) as the rest of a refusal after the folder's
    name ("is inside X, the folder of another run (owner)"); None if nothing. Takes no lock and
    writes nothing."""
    real = os.path.realpath(folder)
    if itself:
        live, record = _live_owner(real)
        if live:
            return f"is in use by another run ({describe_owner(record)})"
    for parent in map(str, Path(real).parents if above else ()):
        live, record = _live_owner(parent)
        if live:
            return f"is inside {parent}, the folder of another run ({describe_owner(record)})"
    if os.path.isdir(real):
        for below in _nested_folders(real):
            live, record = _live_owner(below)
            if live:
                return f"contains {below}, the folder of another run ({describe_owner(record)})"
    return None


class RunLock:
    """The lock of one folder (see the module docstring). `acquire()` raises FolderInUse naming
    the owner, or ConfigError naming `key` when the folder or its lock file cannot be made."""

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        key: str = "job.dump_folder",
        allowed: str = _ALLOWED,
        lock_path: str | os.PathLike | None = None,
        who: str = "run",
    ):
        self.folder = Path(folder)
        self.key = key
        self.allowed = allowed
        self.who = who
        # A destination not made yet (a conversion's output, a data-set build) is locked through
        # a file beside it, removed on release (lock_destination).
        self.path = Path(lock_path) if lock_path is not None else self.folder / LOCK_NAME
        self._remove_on_release = lock_path is not None
        self._fd: int | None = None
        self._count = 0

    def _refuse(self, record: dict | None, extra: str = "", *, where: str | None = None) -> FolderInUse:
        where = where or f"is in use by another {self.who} ({describe_owner(record)})"
        return FolderInUse(f"{self.key}: {self.folder} {where}{extra}; allowed: {self.allowed}")

    def acquire(self) -> RunLock:
        real = os.path.realpath(self.folder)
        held = _HELD.get(real)
        if held is not None:  # this process holds it already
            held._count += 1
            return held
        nested = not self._remove_on_release  # a run folder: one above or below it may be another run's
        if nested and (where := other_run(self.folder, itself=False)):
            raise self._refuse(None, where=where)  # before anything is made or opened
        made = [p for p in (self.path.parent.absolute(), *self.path.parent.absolute().parents) if not p.exists()]
        make_dir(self.path.parent, key=self.key)
        existed = self.path.exists()
        if existed:  # kept, so that a run stopped by bad input can leave the file as it found it
            try:
                st = os.stat(self.path)
                self._before = (made, self.path.read_bytes(), st.st_atime_ns, st.st_mtime_ns)
            except OSError:
                self._before = (made, None, 0, 0)
        else:
            self._before = (made, None, 0, 0)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(
                f"{self.key}: cannot create the lock file {self.path}: {write_error_text(e, self.folder)}; "
                "allowed: a folder this process can write"
            ) from None
        try:
            try:
                _flock_retrying(fd)
            except OSError as e:
                if e.errno in _BUSY:
                    raise self._refuse(_read_settled(self.path)) from None
                if e.errno not in _NO_FLOCK:
                    raise
                self._check_record_only()
            # Checked again now that the lock is held: of two runs starting at once on nested
            # folders, each locks before it looks, so at least one sees the other.
            if nested and (where := other_run(self.folder, itself=False)):
                self._undo(fd)
                raise self._refuse(None, where=where)
            self._write_record(fd)
            check_writable_dir(self.path.parent, key=self.key)  # the lock file may be old: prove a file can be made
        except FolderInUse:
            os.close(fd)  # only opened (or put back by _undo): nothing changed
            raise
        except BaseException:
            self._undo(fd)
            os.close(fd)
            raise
        self._fd, self._count = fd, 1
        _HELD[real] = self
        return self

    def _write_record(self, fd: int) -> None:
        """This process's owner record, whole; a write that fails (a full disk, a quota) is
        WriteFailed naming the lock file and the errno text (acquire then puts the file back)."""
        data = memoryview((json.dumps(_owner_record()) + "\n").encode())
        try:
            os.ftruncate(fd, 0)
            written = 0
            while written < len(data):  # pwrite may write part
                written += os.pwrite(fd, data[written:], written)
        except OSError as e:
            raise WriteFailed(
                f"{self.key}: writing the lock file {self.path} failed: {write_error_text(e, self.path.parent)}; "
                "the lock file was put back as it was found (it does not block a relaunch)"
            ) from None

    def _check_record_only(self) -> None:
        """No flock on this file system: decide from the owner record."""
        record = read_owner(self.path)
        if not record:
            return
        if record.get("host") == socket.gethostname():
            if record.get("pid") != os.getpid() and _pid_alive(record.get("pid")):
                raise self._refuse(record)
            return  # its holder is gone: stale
        raise self._refuse(
            record,
            extra=f"; this file system has no flock, so a run on another host cannot be "
            f"checked: delete {self.path} if that run has ended",
        )

    def _undo(self, fd: int) -> None:
        """Put the lock file (and the folders made for it) back as acquire found them."""
        made, old, atime_ns, mtime_ns = self._before
        try:
            if old is None:
                self.path.unlink(missing_ok=True)
                for p in made:  # deepest first; stops at the first that is not empty
                    os.rmdir(p)
            else:
                os.ftruncate(fd, 0)
                written = 0
                while written < len(old):
                    written += os.pwrite(fd, old[written:], written)
                os.utime(self.path, ns=(atime_ns, mtime_ns))
        except OSError:
            pass

    def release(self, *, undo: bool = False) -> None:
        """Drop the lock (the last of a re-entrant count). undo: a run stopped by bad input; the
        lock file and any folder made for it are put back as they were (nothing touched)."""
        if self._fd is None:
            return
        self._count -= 1
        if self._count > 0:
            return
        fd, self._fd = self._fd, None
        _HELD.pop(os.path.realpath(self.folder), None)
        if undo:
            self._undo(fd)
            os.close(fd)
            return
        try:
            if self._remove_on_release:
                # A beside-file would be litter. (A run opening it in this instant may lock the
                # unlinked file; the atomic publish, which never replaces occupied output, is the
                # last guard then.)
                self.path.unlink(missing_ok=True)
            else:
                # Emptied, not deleted: deleting would let a waiting opener lock an unlinked
                # inode while a third process creates a new file (two holders).
                os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # drops the flock

    def __enter__(self) -> RunLock:
        return self if self._fd is not None else self.acquire()  # `with lock_destination(...)`: taken

    def __exit__(self, *exc) -> None:
        self.release()


def lock_destination(dest: str | os.PathLike, *, key: str, who: str) -> RunLock:
    """The lock of an output that is written elsewhere and renamed into place (a conversion's
    folder, a data-set build): `.NAME.lock` beside `dest`, removed on release. FolderInUse names
    the process that holds it."""
    dest = Path(dest)
    return RunLock(
        dest,
        key=key,
        who=who,
        lock_path=dest.parent / f".{dest.name}.lock",
        allowed=f"a destination no other {who} writes: wait for it or choose another",
    ).acquire()


@contextlib.contextmanager
def released_on_error():
    """Locks this process takes inside the block are released if the block raises (a run that
    stops on bad input after taking its lock frees the folder at once, and leaves the lock file
    and the folders made for it as they were)."""
    before = set(_HELD)
    try:
        yield
    except BaseException:
        for folder in set(_HELD) - before:
            lock = _HELD[folder]
            lock._count = 1
            lock.release(undo=True)
        raise


def release_all(*, undo: bool = False) -> None:
    """Drop every lock this process holds (the trainer's exit; the OS would at process exit).
    undo: the run stopped on bad input; put each lock file back as it was found."""
    for remote in list(_REMOTE_HELD.values()):
        remote.release()  # gs:// locks: deleted (nothing releases them when a process ends)
    for lock in list(_HELD.values()):
        lock._count = 1
        lock.release(undo=undo)


def lock_run(
    *,
    locks: Sequence[tuple[str, str | os.PathLike]],
    claims: Sequence[tuple[str, str | os.PathLike]] = (),
    writable: Sequence[tuple[str, str | os.PathLike]] = (),
) -> list[RunLock | RemoteLock]:
    """Rank 0 checks that no other live run holds, contains or is inside each (key, folder) of
    `claims` (folders covered by one of `locks`, such as a checkpoint folder inside the dump
    folder: checked first, so that the refusal names the folder the runs share), takes a RunLock
    on each (key, folder) of `locks`, and checks each (key, folder) of `writable` (made if missing,
    a file created in it); the verdict is broadcast from rank 0, and every rank raises the same
    ConfigError if it is a refusal. A collective: call it on every rank, before anything in the
    folders is read or written."""
    import torch.distributed as dist

    from models.common import distributed

    multi = distributed.multi_rank()
    rank = distributed.rank()
    held: list[RunLock | RemoteLock] = []
    problem = None
    if rank == 0:
        try:
            for key, folder in claims:
                if storage.is_remote(folder):
                    continue
                if where := other_run(folder, above=False):  # above: the lock that covers it looks
                    raise FolderInUse(f"{key}: {folder} {where}; allowed: {_ALLOWED}")
            for key, folder in locks:
                if storage.is_remote(folder):
                    held.append(RemoteLock(folder, key=key).acquire())
                else:
                    held.append(RunLock(folder, key=key).acquire())
            for key, folder in writable:
                if storage.is_remote(folder):
                    storage.check_bucket(folder, key=key)
                else:
                    check_writable_dir(folder, key=key, keep=False)  # proved writable, made when first used
        except ConfigError as e:
            problem = ("bad input", str(e))
        except WriteFailed as e:  # a full disk under the lock file: not bad input (exit 1)
            problem = ("write", str(e))
    if multi:
        from trainer.runtime.device import cpu_backend

        on_cpu = dist.get_backend() in ("gloo", cpu_backend())
        group = dist.group.WORLD if on_cpu else dist.new_group(backend=cpu_backend())
        box = [problem]
        dist.broadcast_object_list(box, src=0, group=group)
        problem = box[0]
        if not on_cpu:
            dist.destroy_process_group(group)
    if problem is not None:
        for lock in held:
            lock.release(undo=True)
        kind, message = problem
        raise (WriteFailed if kind == "write" else ConfigError)(message)
    return held


# -- on object storage -------------------------------------------------------------------------

_REMOTE_HELD: dict[str, RemoteLock] = {}


class RemoteLock:
    """One writer per gs:// run folder (module docstring). `acquire()` raises FolderInUse naming
    the holder, or ConfigError naming `key` for a missing bucket or denied access."""

    def __init__(self, folder: str, *, key: str):
        self.folder = folder.rstrip("/")
        self.key = key
        storage.split_url(self.folder, key=key)
        self.path = f"{storage.object_path(self.folder)}/{LOCK_NAME}"
        self.record: dict | None = None

    def _read(self, fs) -> dict | None:
        try:
            record = json.loads(fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return record if isinstance(record, dict) else {}

    def _refuse(self, record: dict | None) -> FolderInUse:
        return FolderInUse(
            f"{self.key}: {self.folder} is in use by another run ({describe_owner(record)}); object storage "
            f"cannot tell whether a run on another host still lives: delete {storage.SCHEME}{self.path} if that "
            f"run has ended; allowed: {_ALLOWED}"
        )

    def acquire(self) -> RemoteLock:
        if self.folder in _REMOTE_HELD:
            return _REMOTE_HELD[self.folder]
        storage.check_bucket(self.folder, key=self.key)
        try:
            return self._acquire()
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a refusal passes; a failed call is one line naming the key
            raise ConfigError(
                f"{self.key}: cannot take the lock {storage.SCHEME}{self.path}: "
                f"{storage.error_text(e, self.folder)}; allowed: a gs:// folder this job can write"
            ) from None

    def _acquire(self) -> RemoteLock:
        fs = storage.bounded_fs(key=self.key)
        mine = {**_owner_record(), "nonce": uuid.uuid4().hex}
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
                raise ConfigError(
                    f"{self.key}: cannot create the lock {storage.SCHEME}{self.path}: "
                    f"{storage.error_text(e, self.folder)}; allowed: a gs:// folder this job can write"
                ) from None
            fs.invalidate_cache(self.path)
            record = self._read(fs)
            if record and record.get("nonce") == mine["nonce"]:
                self.record = mine
                _REMOTE_HELD[self.folder] = self
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
        if _REMOTE_HELD.get(self.folder) is not self:
            return
        del _REMOTE_HELD[self.folder]
        fs = storage.bounded_fs(key=self.key)
        try:
            fs.invalidate_cache(self.path)
            record = self._read(fs)
            if record and self.record and record.get("nonce") == self.record["nonce"]:
                fs.rm_file(self.path)
        except Exception:  # noqa: BLE001 - a lock left behind is reported by the next run
            pass
