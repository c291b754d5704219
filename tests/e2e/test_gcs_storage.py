"""Checkpoints on object storage (gs://), for real over HTTP against a local GCS emulator.

The emulator is `gcp-storage-emulator` (the [gcs-test] extra; in-memory, anonymous), started as
a subprocess on a free port; gcsfs reaches it through STORAGE_EMULATOR_HOST. Skipped when
gcsfs or the emulator is not installed.

- a gs:// run is killed with SIGKILL while a save is in flight (objects of step-N uploaded, its
  manifest not yet): step-N is not a checkpoint, the relaunch resumes from the previous one and
  every step's loss equals an uninterrupted run's exactly;
- a second writer is refused by the object lock (one `error:` line, exit 2); a lock of a dead
  process of this host is stale and taken over;
- a missing bucket, a malformed URL and a gs:// dump folder: one `error:` line naming the key, exit 2;
- 2 ranks with async saves and keep_latest_k = 2: the resumed run equals a local-disk run;
- the manifest-last commit: a step without its manifest is not complete, a corrupt object fails
  its CRC, deleting a step removes the manifest first.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support.trainer_runs import ENV, REPO, read_metrics

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported (storage.py)
pytest.importorskip("gcsfs")
EMULATOR = shutil.which("gcp-storage-emulator") or os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
pytestmark = pytest.mark.skipif(not os.path.exists(EMULATOR), reason="gcp-storage-emulator is not installed")

COMMON = [
    "--config",
    "configs/llama3_debug.toml",
    "--training.seq_len=64",
    "--model.n_layers=2",
    "--metrics.log_freq=1",
    "--validation.enable=false",
    "--training.mixed_precision_param=float32",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=true",
    "--checkpoint.keep_latest_k=0",
    "--training.local_batch_size=4",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("gcs") / "emulator.log", "w")
    proc = subprocess.Popen(
        [EMULATOR, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "--quiet"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, "the GCS emulator did not start"
            time.sleep(0.1)
    host = f"http://127.0.0.1:{port}"
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = host
    from trainer.runtime import storage

    fs = storage.filesystem(key="test")
    fs.mkdir("bkt")
    yield {"host": host, "fs": fs}
    proc.kill()
    proc.wait()
    if old is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = old


def _env(emulator):
    return {**ENV, "STORAGE_EMULATOR_HOST": emulator["host"], "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def _cmd(dump, url, *, steps, interval=2):
    return [
        sys.executable,
        "-m",
        "trainer.train",
        *COMMON,
        f"--job.dump_folder={dump}",
        f"--checkpoint.folder={url}",
        f"--training.steps={steps}",
        f"--checkpoint.interval={interval}",
    ]


def _run(cmd, emulator):
    return subprocess.run(cmd, cwd=REPO, env=_env(emulator), capture_output=True, text=True, timeout=600)


def _losses(folder):
    return {step: r["loss"] for step, r in read_metrics(folder).items()}


def _error_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_gcs_save_kill9_mid_save_then_resume_is_exact(emulator, tmp_path):
    fs = emulator["fs"]
    steps = 8
    ref = _run(_cmd(tmp_path / "ref", "gs://bkt/ref", steps=steps), emulator)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = _losses(tmp_path / "ref")
    assert sorted(want) == list(range(1, steps + 1))

    dump = tmp_path / "killed"
    log = open(tmp_path / "killed.log", "w+")
    proc = subprocess.Popen(
        _cmd(dump, "gs://bkt/killed", steps=steps), cwd=REPO, env=_env(emulator), stdout=log, stderr=log
    )
    caught = None  # the step whose save was in flight at the kill
    deadline = time.time() + 300
    while caught is None and proc.poll() is None and time.time() < deadline:
        for step in (4, 6):  # step 2 saved (the previous checkpoint), then a later save in flight
            base = f"bkt/killed/step-{step}"
            try:
                names = {p.rsplit("/", 1)[-1] for p in fs.ls(base, detail=False, refresh=True)}
            except FileNotFoundError:
                continue
            if names and "manifest.json" not in names:
                proc.send_signal(signal.SIGKILL)
                caught = step
                break
        time.sleep(0.01)
    proc.wait(timeout=60)
    log.seek(0)
    assert caught is not None, "no save was caught in flight:\n" + log.read()[-2000:]
    assert proc.returncode == -signal.SIGKILL
    from trainer.checkpoint import remote

    fs.invalidate_cache()
    complete = remote.complete_steps("gs://bkt/killed")
    assert caught not in complete and complete and max(complete) == caught - 2, (caught, complete)
    assert not fs.exists(f"bkt/killed/step-{caught}/manifest.json")

    resumed = _run(_cmd(dump, "gs://bkt/killed", steps=steps), emulator)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from gs://bkt/killed/step-{caught - 2} (step {caught - 2})" in resumed.stdout + resumed.stderr
    got = _losses(dump)
    assert got == want  # exact: the same losses, bit for bit, as the uninterrupted run
    fs.invalidate_cache()
    assert remote.complete_steps("gs://bkt/killed") == list(range(2, steps + 1, 2))
    assert not fs.exists("bkt/killed/.run.lock")  # deleted at the end of the run
    print(f"killed during the save of step {caught}; resumed from step {caught - 2}; losses equal")


def test_gcs_lock_refuses_a_second_writer_and_takes_over_a_dead_one(emulator, tmp_path):
    fs = emulator["fs"]
    other = {"host": "another-host", "pid": 4242, "started": "2026-12-05 00:00:00 UTC", "nonce": "x"}
    fs.pipe_file("bkt/locked/.run.lock", json.dumps(other).encode())
    proc = _run(_cmd(tmp_path / "run", "gs://bkt/locked", steps=2), emulator)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = _error_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "checkpoint.folder: gs://bkt/locked is in use by another run (host another-host, pid 4242" in lines[0]
    assert "delete gs://bkt/locked/.run.lock" in lines[0]
    assert json.loads(fs.cat_file("bkt/locked/.run.lock")) == other  # left as it was

    from trainer.runtime import runlock

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {**other, "host": socket.gethostname(), "pid": int(dead.stdout)}
    fs.pipe_file("bkt/stale/.run.lock", json.dumps(stale).encode())
    lock = runlock.RemoteLock("gs://bkt/stale", key="checkpoint.folder").acquire()
    fs.invalidate_cache()
    assert json.loads(fs.cat_file("bkt/stale/.run.lock"))["pid"] == os.getpid()
    with pytest.raises(Exception, match="in use by another run"):  # a live holder (this process, another lock object)
        runlock._REMOTE_HELD.clear()
        runlock.RemoteLock("gs://bkt/stale", key="checkpoint.folder").acquire()
    runlock._REMOTE_HELD["gs://bkt/stale"] = lock
    lock.release()
    assert not fs.exists("bkt/stale/.run.lock")


@pytest.mark.parametrize(
    "args, expect",
    [
        (
            ["--checkpoint.folder=gs://no-such-bucket/run"],
            "error: checkpoint.folder: cannot use gs://no-such-bucket/run: bucket no-such-bucket does not exist",
        ),
        (["--checkpoint.folder=gs://Bad_Bucket/run"], "error: checkpoint.folder: 'gs://Bad_Bucket/run' is a malformed"),
        (["--checkpoint.folder=s3://bkt/run"], "error: checkpoint.folder: 's3://bkt/run' is not a supported URL"),
        (["--job.dump_folder=gs://bkt/dump"], "error: job.dump_folder: 'gs://bkt/dump' is object storage"),
        (
            ["--training.dataset=gs://bkt/data.jsonl"],
            "error: training.dataset: 'gs://bkt/data.jsonl' is object storage",
        ),
    ],
    ids=["missing-bucket", "malformed", "other-scheme", "dump-folder", "dataset"],
)
def test_gcs_bad_paths_are_one_line_exit_2(emulator, tmp_path, args, expect):
    cmd = _cmd(tmp_path / "run", "gs://bkt/fine", steps=2) + args
    proc = _run(cmd, emulator)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = _error_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(expect), lines[0]
    assert not emulator["fs"].exists("bkt/fine/.run.lock")


def test_gcs_manifest_is_the_commit_point(emulator):
    from trainer.checkpoint import remote
    from trainer.checkpoint.manifest import CorruptCheckpointError

    fs = emulator["fs"]
    fs.pipe_file("bkt/m/step-1/__0_0.distcp", b"a" * 1000)
    fs.pipe_file("bkt/m/step-1/.metadata", b"meta")
    assert remote.complete_steps("gs://bkt/m") == []  # objects without a manifest: not a checkpoint
    assert remote.incomplete_steps("gs://bkt/m") == ["gs://bkt/m/step-1"]
    assert remote.verify_checkpoint("gs://bkt/m/step-1") is False
    manifest = remote.write_manifest("gs://bkt/m/step-1")
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp"]
    assert remote.complete_steps("gs://bkt/m") == [1]
    assert remote.verify_checkpoint("gs://bkt/m/step-1") is True
    fs.pipe_file("bkt/m/step-1/__0_0.distcp", b"a" * 999 + b"b")
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        remote.verify_checkpoint("gs://bkt/m/step-1")
    removed = []
    real_rm_file = fs.rm_file
    fs.rm_file = lambda path, **kw: (removed.append(path), real_rm_file(path, **kw))[1]
    try:
        remote.remove_step("gs://bkt/m/step-1")
    finally:
        del fs.rm_file
    assert removed[0].endswith("step-1/manifest.json")  # invisible before anything else goes
    assert remote.complete_steps("gs://bkt/m") == [] and not fs.exists("bkt/m/step-1/.metadata")


def test_gcs_error_text_maps_denied_access_and_missing_bucket():
    from gcsfs.retry import HttpError

    from trainer.runtime import storage

    url = "gs://bkt/run"
    assert storage.error_text(OSError("Forbidden: https://x/b/bkt/o\nno access"), url).startswith(
        "access to gs://bkt denied"
    )
    assert storage.error_text(HttpError({"code": 403, "message": "denied"}), url).startswith(
        "access to gs://bkt denied"
    )
    assert storage.error_text(HttpError({"code": 401, "message": "no token"}), url).startswith(
        "access to gs://bkt denied"
    )
    assert storage.error_text(FileNotFoundError("b/bkt/o"), url) == "bucket bkt does not exist"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gcs_two_ranks_async_save_resume_and_retention(emulator, tmp_path):
    """2 ranks (one object per rank), async saves, keep_latest_k = 2: the resumed run's losses
    equal a local-disk run's; only the two newest steps stay, each with its manifest."""
    base = [*COMMON, "--training.local_batch_size=2", "--checkpoint.keep_latest_k=2", "--checkpoint.async_mode=async"]

    def cmd(dump, url, steps):
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "trainer.train",
            *base,
            f"--job.dump_folder={dump}",
            f"--checkpoint.folder={url}",
            f"--training.steps={steps}",
            "--checkpoint.interval=2",
        ]

    local = _run(cmd(tmp_path / "local", str(tmp_path / "local_ckpt"), 6), emulator)
    assert local.returncode == 0, local.stderr[-3000:]
    for steps in (4, 6):
        proc = _run(cmd(tmp_path / "gs", "gs://bkt/two", steps), emulator)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from gs://bkt/two/step-4 (step 4)" in proc.stdout + proc.stderr
    assert _losses(tmp_path / "gs") == _losses(tmp_path / "local")
    from trainer.checkpoint import remote

    emulator["fs"].invalidate_cache()
    assert remote.complete_steps("gs://bkt/two") == [4, 6]
    names = sorted(p.rsplit("/", 1)[-1] for p in emulator["fs"].ls("bkt/two/step-6", detail=False))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    assert remote.verify_checkpoint("gs://bkt/two/step-6") is True
