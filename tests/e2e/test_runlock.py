"""One writer per run folder (trainer/runtime/runlock.py): a second run on a folder another live
process holds is refused with one `error:` line naming the owner (exit 2, nothing touched, on
every rank); a lock whose holder died never blocks; unusable dump and checkpoint folders fail
before step 1 naming the key and the errno text."""

import errno
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support.trainer_runs import ENV, REPO, launch_command
from trainer.runtime import atomic, runlock
from trainer.runtime.runlock import LOCK_NAME, FolderInUse, RunLock, read_owner

FAST = [
    "--config",
    "configs/llama3_debug.toml",
    "--training.seq_len=64",
    "--model.n_layers=2",
    "--validation.enable=false",
    "--metrics.enable_tensorboard=false",
    "--training.local_batch_size=2",
    "--training.mixed_precision_param=float32",
    "--metrics.log_freq=1",
]

_HOLDER = """
import sys, time
from trainer.runtime.runlock import RunLock, lock_destination
if sys.argv[1] == "dest":
    lock_destination(sys.argv[2], key=sys.argv[2], who="conversion")
elif sys.argv[1] == "unchecked":  # a run that looked for others before the caller locked
    import trainer.runtime.runlock as runlock
    runlock.other_run = lambda *a, **k: None
    RunLock(sys.argv[2]).acquire()
else:
    RunLock(sys.argv[2]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def hold(path, kind: str = "run") -> subprocess.Popen:
    """Another process that holds the lock of `path` (kind run: the folder's; dest: a destination's;
    unchecked: the folder's, taken without looking at the folders above and below)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, kind, str(path)], cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _lines(path) -> int:
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def _snapshot(folder) -> dict:
    """Every file under `folder` with its size, mtime and content hash (what a refused run must not change)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = (st.st_size, st.st_mtime_ns, hash(f.read()))
    return out


def test_a_live_holder_refuses_and_a_dead_ones_lock_is_taken(tmp_path):
    holder = hold(tmp_path)
    try:
        before = _snapshot(tmp_path)
        with pytest.raises(FolderInUse) as refused:
            RunLock(tmp_path).acquire()
        message = str(refused.value)
        assert len(message.splitlines()) == 1
        assert message.startswith(
            f"job.dump_folder: {tmp_path} is in use by another run (host {socket.gethostname()}, "
            f"pid {holder.pid}, started "
        ), message
        assert _snapshot(tmp_path) == before  # the refusal changed nothing, the owner record included
    finally:
        holder.kill()  # SIGKILL: no clean-up runs; the OS drops the flock
        holder.wait()
    assert read_owner(tmp_path / LOCK_NAME)["pid"] == holder.pid  # the dead owner's record is still there
    lock = RunLock(tmp_path).acquire()  # ... and does not block
    try:
        assert read_owner(tmp_path / LOCK_NAME)["pid"] == os.getpid()
        assert RunLock(tmp_path).acquire() is lock  # re-entrant within a process
        lock.release()
        assert runlock._HELD  # still held once
    finally:
        runlock.release_all()
    assert not runlock._HELD and read_owner(tmp_path / LOCK_NAME) is None  # released: the record is emptied


def test_without_flock_a_record_of_a_gone_pid_on_this_host_is_stale(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(runlock.fcntl, "flock", no_flock)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = '{"host": "%s", "pid": %s, "started": "then"}' % (socket.gethostname(), gone.stdout.strip())
    (tmp_path / LOCK_NAME).write_text(record)
    RunLock(tmp_path).acquire()
    runlock.release_all()
    (tmp_path / LOCK_NAME).write_text(
        '{"host": "%s", "pid": %d, "started": "now"}' % (socket.gethostname(), os.getppid())
    )
    with pytest.raises(FolderInUse, match=f"pid {os.getppid()}, started now"):
        RunLock(tmp_path).acquire()
    (tmp_path / LOCK_NAME).write_text('{"host": "elsewhere", "pid": 1, "started": "now"}')
    with pytest.raises(FolderInUse, match=f"host elsewhere.*delete {tmp_path / LOCK_NAME}"):
        RunLock(tmp_path).acquire()


def test_a_lock_covers_the_folders_above_and_below_it_by_resolved_path(tmp_path):
    """A run's folder inside another live run's folder, one that contains it, or the same folder
    by another spelling (a symlink) is refused before anything is made; a dead run's is free."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    holders = [hold(tmp_path / "a"), hold(tmp_path / "b" / "checkpoints"), hold(tmp_path / "real")]
    try:
        before = _snapshot(tmp_path)
        cases = [
            (tmp_path / "a" / "checkpoints", f"is inside {tmp_path / 'a'}, the folder of another run", 0),
            (tmp_path / "b", f"contains {tmp_path / 'b' / 'checkpoints'}, the folder of another run", 1),
            (tmp_path / "link" / "..", f"contains {tmp_path}{os.sep}", None),  # any of the three
            (tmp_path / "link", "is in use by another run", 2),
            (tmp_path / "link" / "x" / "y", f"is inside {tmp_path / 'real'}, the folder of another run", 2),
        ]
        for folder, where, owner in cases:
            with pytest.raises(FolderInUse) as refused:
                RunLock(folder, key="checkpoint.folder").acquire()
            message = str(refused.value)
            assert len(message.splitlines()) == 1 and message.startswith(f"checkpoint.folder: {folder} {where}"), (
                message
            )
            assert f", the folder of another run (host {socket.gethostname()}, pid " in message or owner == 2, message
            assert owner is None or f"pid {holders[owner].pid}," in message, message
            assert runlock.other_run(folder) is not None
        assert _snapshot(tmp_path) == before and not (tmp_path / "a" / "checkpoints").exists()
        assert not runlock._HELD
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert runlock.other_run(tmp_path) is None  # dead holders: nothing held
    RunLock(tmp_path / "a" / "checkpoints").acquire()
    try:
        assert RunLock(tmp_path / "a").acquire()  # this process's own folders do not refuse each other
    finally:
        runlock.release_all()


def test_a_lock_taken_meanwhile_below_is_seen_after_locking(tmp_path, monkeypatch):
    """Two runs starting at once on nested folders: each locks, then looks again, so the one that
    looks last refuses and puts its lock file back."""
    real_flock, holder = runlock._flock_retrying, []

    def flock_then_other_run_starts(fd):
        real_flock(fd)
        holder.append(hold(tmp_path / "run" / "checkpoints", "unchecked"))

    monkeypatch.setattr(runlock, "_flock_retrying", flock_then_other_run_starts)
    try:
        with pytest.raises(FolderInUse, match="contains .*checkpoints, the folder of another run"):
            RunLock(tmp_path / "run").acquire()
        assert not (tmp_path / "run" / LOCK_NAME).exists() and not runlock._HELD
    finally:
        for proc in holder:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("case", ["checkpoint_in_a_live_runs_dump", "default_checkpoint_written_by_a_live_run"])
def test_a_run_sharing_a_live_runs_checkpoint_folder_is_refused(tmp_path, capsys, case):
    """issue 38: (a) `checkpoint.folder` set, by absolute path, to a live run's checkpoint folder
    inside that run's dump folder; (b) a run whose default checkpoint folder another run writes.
    Both were accepted and the two runs deleted each other's checkpoints; now exit 2 naming the
    key and the other run, nothing touched."""
    if case == "checkpoint_in_a_live_runs_dump":
        holder, args = (
            hold(tmp_path / "A"),
            [f"--job.dump_folder={tmp_path / 'B'}", f"--checkpoint.folder={tmp_path / 'A' / 'checkpoints'}"],
        )
        (tmp_path / "A" / "checkpoints" / "step-2").mkdir(parents=True)
        want = f"error: checkpoint.folder: {tmp_path / 'A' / 'checkpoints'} is inside {tmp_path / 'A'}, the folder of"
    else:
        holder, args = hold(tmp_path / "B" / "checkpoints"), [f"--job.dump_folder={tmp_path / 'B'}"]
        want = f"error: checkpoint.folder: {tmp_path / 'B' / 'checkpoints'} is in use by another run"
    try:
        before = _snapshot(tmp_path)
        code = _main([*FAST, "--training.steps=2", "--checkpoint.enable=true", *args])
        assert _snapshot(tmp_path) == before and not (tmp_path / "B" / LOCK_NAME).exists()
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(want) and f"pid {holder.pid}," in err, err


@pytest.mark.multiprocess
def test_second_training_run_is_refused_and_the_first_keeps_its_folder(tmp_path):
    """Two real trainer processes on one folder: the second exits 2 naming the first and touches
    nothing; the first, preempted (exit 75), releases the folder."""
    folder = tmp_path / "run"
    args = [*FAST, f"--job.dump_folder={folder}", "--checkpoint.enable=true", "--checkpoint.interval=1000"]
    log = tmp_path / "first.log"  # a file, not a pipe: nobody reads while it trains
    with open(log, "w") as sink:
        first = subprocess.Popen(
            launch_command(1, [*args, "--training.steps=100000"]),
            cwd=REPO,
            env=ENV,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        deadline = time.monotonic() + 300
        while _lines(folder / "metrics.jsonl") < 2 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # two steps logged: the loop (and its SIGTERM handler) runs
        assert first.poll() is None, log.read_text()[-3000:]
        first.send_signal(signal.SIGSTOP)  # frozen, so that its folder can be compared before and after
        before = _snapshot(folder)
        second = subprocess.run(
            launch_command(1, [*args, "--training.steps=4"]),
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert _snapshot(folder) == before  # no metrics line, no checkpoint read or written, no config.toml
        first.send_signal(signal.SIGCONT)
    except BaseException:
        first.kill()
        raise
    assert second.returncode == 2, second.stderr[-3000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
    assert lines[0].startswith(
        f"error: job.dump_folder: {folder} is in use by another run (host "
        f"{socket.gethostname()}, pid {first.pid}, started "
    ), lines[0]
    first.send_signal(signal.SIGTERM)  # preemption: the first saves its step and exits 75
    assert first.wait(timeout=120) == 75, log.read_text()[-3000:]
    assert read_owner(folder / LOCK_NAME) is None  # released on the way out (the OS would anyway)
    RunLock(folder).acquire()  # the folder is free for the relaunch
    runlock.release_all()


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["dump_folder", "checkpoint_in_a_live_runs_dump"])
def test_the_refusal_reaches_every_rank(tmp_path, case):
    """Rank 0 holds the verdict; rank 1 gets it by broadcast, so neither waits at a barrier."""
    holder = hold(tmp_path)
    args, refusal = [f"--job.dump_folder={tmp_path}"], f"error: job.dump_folder: {tmp_path} is in use by another run"
    if case == "checkpoint_in_a_live_runs_dump":
        ck = tmp_path / "checkpoints"
        args = [f"--job.dump_folder={tmp_path}_b", "--checkpoint.enable=true", f"--checkpoint.folder={ck}"]
        refusal = f"error: checkpoint.folder: {ck} is inside {tmp_path}, the folder of another run"
    try:
        proc = subprocess.run(
            launch_command(2, [*FAST, *args, "--training.steps=2", "--parallelism.data_parallel_shard_degree=2"]),
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.kill()
        holder.wait()
    refusals = [line for line in proc.stderr.splitlines() if refusal in line and f"pid {holder.pid}" in line]
    assert proc.returncode != 0 and len(refusals) == 2, proc.stderr[-3000:]  # one line from each rank
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME] and not os.path.exists(f"{tmp_path}_b")


def _main(argv) -> int:
    from trainer.train import main

    return main(argv)


@pytest.mark.parametrize(
    "case", ["dump_under_file", "file_in_place_of_dump", "checkpoint_under_file", "checkpoint_not_writable"]
)
def test_unusable_folders_fail_before_step_1(tmp_path, capsys, monkeypatch, case):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder\n")
    dump, checkpoint, key, why = tmp_path / "run", "checkpoints", "checkpoint.folder", "Not a directory"
    if case == "dump_under_file":
        dump, key = blocker / "run", "job.dump_folder"
    elif case == "file_in_place_of_dump":
        dump, key = blocker, "job.dump_folder"
    elif case == "checkpoint_under_file":
        checkpoint = str(blocker / "ck")
    else:  # no permission (injected: tests may run as root, which chmod does not stop)
        real_mkstemp = atomic.tempfile.mkstemp

        def mkstemp(*a, dir=None, **kw):
            if str(dir).endswith("checkpoints"):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
            return real_mkstemp(*a, dir=dir, **kw)

        monkeypatch.setattr(atomic.tempfile, "mkstemp", mkstemp)
        why = "Permission denied"
    code = _main(
        [
            *FAST,
            f"--job.dump_folder={dump}",
            "--training.steps=2",
            "--checkpoint.enable=true",
            f"--checkpoint.folder={checkpoint}",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"error: {key}: ") and why in err, err
    assert "step " not in out  # before step 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_failed_build_releases_the_lock_it_took(tmp_path):
    held = RunLock(tmp_path / "earlier").acquire()
    try:
        with pytest.raises(ValueError):
            with runlock.released_on_error():
                RunLock(tmp_path / "run").acquire()
                raise ValueError("bad data, found after the lock was taken")
        assert list(runlock._HELD.values()) == [held]  # the one taken before the block stays held
        assert read_owner(tmp_path / "run" / LOCK_NAME) is None
    finally:
        runlock.release_all()


def test_a_run_stopped_by_bad_input_leaves_the_folder_as_it_found_it(tmp_path, capsys):
    """Bad data is found after the lock is taken (build_job step 3): the lock file and the folders
    made for it are put back (the contract: bad input touches nothing)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "no text field"}\n')
    fresh = tmp_path / "new" / "run"
    assert _main([*FAST, f"--job.dump_folder={fresh}", "--training.steps=2", f"--training.dataset={bad}"]) == 2
    assert not (tmp_path / "new").exists()
    used = tmp_path / "used"  # a folder an earlier run left, with its (emptied) lock file
    used.mkdir()
    (used / LOCK_NAME).write_text("")
    os.utime(used / LOCK_NAME, ns=(1_000_000_000, 2_000_000_000))
    before = _snapshot(used)
    assert _main([*FAST, f"--job.dump_folder={used}", "--training.steps=2", f"--training.dataset={bad}"]) == 2
    assert _snapshot(used) == before and os.stat(used / LOCK_NAME).st_mtime_ns == 2_000_000_000
    assert capsys.readouterr().err.count("error: ") == 2 and not runlock._HELD
