"""A full disk at every writer of a run folder (issue 50 item 5): the run lock's owner record at
start-up and a save of the local checkpoint tier. Each ends the run with one `error:` line naming
the file or folder and the errno text (exit 1: not bad input), leaves no partial file or
`.tmp-step-N` folder, and loses no earlier checkpoint. The disk is real where this process may
mount a tmpfs (root), and simulated (an injected ENOSPC) everywhere."""

from __future__ import annotations

import errno
import os

import pytest

from tests.support.full_disk import fill, tiny_tmpfs
from tests.support.trainer_runs import TINY_RUN
from trainer.runtime import runlock
from trainer.runtime.runlock import LOCK_NAME, RunLock

FAST = [*TINY_RUN, "--training.mixed_precision_param=float32"]
NO_SPACE = os.strerror(errno.ENOSPC)


def _main(argv) -> int:
    from trainer.train import main

    return main(argv)


def _lock_line(run) -> str:
    return (
        f"error: job.dump_folder: writing the lock file {run / LOCK_NAME} failed: {NO_SPACE}; "
        "the lock file was put back as it was found (it does not block a relaunch)"
    )


def test_a_full_disk_under_the_run_lock_is_one_line_and_leaves_no_lock(tmp_path, capsys):
    """A real full disk (a tiny tmpfs): the lock file can be created (an inode) but not its record."""
    with tiny_tmpfs(tmp_path / "disk", kib=128) as disk:
        filler = fill(disk)
        run = disk / "run"
        code = _main([*FAST, "--training.steps=1", f"--job.dump_folder={run}"])
        err = capsys.readouterr().err
        assert code == 1 and "Traceback" not in err, err
        assert err.splitlines() == [_lock_line(run)], err
        assert sorted(os.listdir(disk)) == ["filler"]  # no lock file, no run folder made for it
        filler.unlink()  # space again: the relaunch takes the folder
        RunLock(run).acquire()
        runlock.release_all()


@pytest.fixture
def full_lock_writes(monkeypatch):
    """Writes of this process's owner record to a `.run.lock` put half of it down, then fail with
    ENOSPC (a disk that fills); putting an earlier record back (into the space freed) succeeds."""
    real, cut = os.pwrite, set()
    only = []  # full_lock_writes.append(path): only that folder's lock file fails

    def pwrite(fd, data, offset):
        if offset and fd in cut:
            raise OSError(errno.ENOSPC, NO_SPACE)
        cut.discard(fd)
        mine = f'"pid": {os.getpid()}'.encode() in bytes(data)
        name = os.readlink(f"/proc/self/fd/{fd}")
        if mine and name.endswith(LOCK_NAME) and (not only or name == str(only[0] / LOCK_NAME)):
            cut.add(fd)
            return real(fd, bytes(data)[: len(data) // 2], offset)
        return real(fd, data, offset)

    monkeypatch.setattr(runlock.os, "pwrite", pwrite)
    return only


@pytest.mark.parametrize("earlier", [False, True])
def test_a_failed_lock_record_puts_the_lock_file_back(tmp_path, capsys, full_lock_writes, earlier):
    """Simulated (anywhere): half a record is written, then ENOSPC. A new lock file is removed with
    the folder made for it; an earlier run's lock file gets its record back."""
    run = tmp_path / "run"
    if earlier:
        run.mkdir()
        (run / LOCK_NAME).write_text('{"host": "h", "pid": 1}\n')
    code = _main([*FAST, "--training.steps=1", f"--job.dump_folder={run}"])
    err = capsys.readouterr().err
    assert code == 1 and err.splitlines() == [_lock_line(run)], err
    if earlier:
        assert os.listdir(run) == [LOCK_NAME] and (run / LOCK_NAME).read_text() == '{"host": "h", "pid": 1}\n'
    else:
        assert os.listdir(tmp_path) == []


def test_a_failed_lock_record_of_the_local_tier_folder_is_one_line(tmp_path, capsys, full_lock_writes):
    """checkpoint.local_folder's lock (taken by each host's first process) fails the same way."""
    local = tmp_path / "local"
    full_lock_writes.append(local)
    code = _main(
        [
            *FAST,
            "--training.steps=1",
            f"--job.dump_folder={tmp_path / 'run'}",
            "--checkpoint.enable=true",
            f"--checkpoint.local_folder={local}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and err.splitlines() == [
        f"error: checkpoint.local_folder: writing the lock file {local / LOCK_NAME} failed: {NO_SPACE}; "
        "the lock file was put back as it was found (it does not block a relaunch)"
    ], err
    assert not local.exists()


# -- the local checkpoint tier ----------------------------------------------------------------------


def _ls(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_a_full_local_tier_disk_is_one_line_and_loses_no_checkpoint(tmp_path, capsys):
    """checkpoint.local_folder on a real disk that holds one local step (~33 MiB) but not two: step 2's
    local save fails; one line names its folder and the cause, no `.tmp-step-2` is left, local step 1
    and the persistent tier's step 1 are intact and the run resumes from them."""
    with tiny_tmpfs(tmp_path / "disk", kib=48 * 1024) as disk:
        local, run = disk / "local", tmp_path / "run"
        args = [
            *FAST,
            "--checkpoint.enable=true",
            "--checkpoint.interval=1",
            f"--checkpoint.local_folder={local}",
            "--checkpoint.local_interval=1",
            f"--job.dump_folder={run}",
        ]
        code = _main([*args, "--training.steps=2"])
        err = capsys.readouterr().err
        tmp = local / "rank-0" / ".tmp-step-2"
        want = (
            f"error: checkpoint: saving step 2 to the local tier {tmp} failed: {NO_SPACE}; its partial files were "
            f"removed; earlier steps in {local} and the persistent checkpoint tier are intact"
        )
        assert code == 1 and "Traceback" not in err and err.splitlines()[-1] == want, err
        assert _ls(local / "rank-0") == ["step-1"] and _ls(run / "checkpoints") == ["step-1"]
        from trainer.checkpoint.manifest import verify_checkpoint

        assert verify_checkpoint(local / "rank-0" / "step-1") and verify_checkpoint(run / "checkpoints" / "step-1")
        code = _main([*args, "--training.steps=2", "--checkpoint.local_folder="])  # resumes from step 1
        out = "".join(capsys.readouterr())
        assert code == 0 and "resumed from" in out and "step 2/2" in out and "step 1/2" not in out, out


class _State:
    def __init__(self, seed: int):
        g = __import__("torch").Generator().manual_seed(seed)
        self.tensors = {"w": __import__("torch").randn(64, 64, generator=g)}

    def state_dict(self):
        return self.tensors


def test_one_ranks_full_local_disk_stops_every_rank_with_the_same_line(tmp_path):
    """Two ranks (threads of one process, the threaded process group); rank 1's disk fills in the
    middle of its step-2 shard (simulated: a file that takes 300 bytes, then ENOSPC). Both ranks
    raise the same line naming rank 1's folder; rank 1's `.tmp-step-2` is gone and every step 1 is
    intact; rank 0's step 2, which was written, does not count as a restorable step for the pair."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

    from tests.support.full_disk import LimitedFile
    from trainer.checkpoint.local import LocalSaveFailed, LocalTier, plan_restore

    from thread_world import run_threads

    class FullAfter300(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with LimitedFile(path, mode, budget=300) as f:
                yield f

    def writer(path):
        out = FileSystemWriter(str(path))
        if dist.get_rank() == 1 and path.name == ".tmp-step-2":
            out.fs = FullAfter300()
        return out

    def body():
        rank = dist.get_rank()
        tier = LocalTier(
            root=str(tmp_path), interval=1, slice_rank=rank, layout={"x": 1}, group=dist.group.WORLD, writer=writer
        )
        tier.save(1, {"model": _State(rank)})
        try:
            tier.save(2, {"model": _State(rank)})
        except LocalSaveFailed as e:
            return str(e), tier.complete_steps()
        return None, tier.complete_steps()

    results = run_threads(2, body)
    tmp = tmp_path / "rank-1" / ".tmp-step-2"
    want = (
        f"checkpoint: saving step 2 to the local tier {tmp} failed: {NO_SPACE} (rank 1); its partial files were "
        f"removed; earlier steps in {tmp_path} and the persistent checkpoint tier are intact"
    )
    assert [message for message, _ in results] == [want, want]
    assert _ls(tmp_path / "rank-1") == ["step-1"] and results[1][1] == [1]
    assert plan_restore([steps for _, steps in results], ranks_per_slice=2) == (1, {})
