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
from trainer.runtime import runlock
from trainer.runtime.runlock import LOCK_NAME, RunLock

FAST = [
    "--config",
    "configs/llama3_debug.toml",
    "--training.seq_len=64",
    "--model.n_layers=1",
    "--validation.enable=false",
    "--metrics.enable_tensorboard=false",
    "--training.local_batch_size=2",
    "--training.mixed_precision_param=float32",
]
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

    def pwrite(fd, data, offset):
        if offset and fd in cut:
            raise OSError(errno.ENOSPC, NO_SPACE)
        cut.discard(fd)
        mine = f'"pid": {os.getpid()}'.encode() in bytes(data)
        if mine and os.readlink(f"/proc/self/fd/{fd}").endswith(LOCK_NAME):
            cut.add(fd)
            return real(fd, bytes(data)[: len(data) // 2], offset)
        return real(fd, data, offset)

    monkeypatch.setattr(runlock.os, "pwrite", pwrite)


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
