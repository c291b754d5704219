"""Every remote call has a bound that names the endpoint (issue 50 item 5; trainer/runtime/storage.py, the
seam that trainer/checkpoint/remote.py and the gs:// lock of trainer/runtime/runlock.py call through).

A gs:// endpoint (STORAGE_EMULATOR_HOST) that accepts connections and never answers hung the
start-up silently (gcsfs: aiohttp's 5-minute default per request, 6 tries); one that refuses
printed gcsfs's 48-line traceback before the error line. Now both are one `error:` line naming the
key, the URL and the endpoint, within training.startup_timeout_s. The endpoints are local: a
socket server on 127.0.0.1 that accepts and never answers (it stops by itself), and a closed port.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported (storage.py)
pytest.importorskip("gcsfs")

from tests.support.trainer_runs import TINY_RUN  # noqa: E402
from trainer.checkpoint import remote  # noqa: E402
from trainer.runtime import runlock, storage  # noqa: E402

FAST = [
    *TINY_RUN,
    "--training.steps=1",
    "--checkpoint.enable=true",
    "--checkpoint.folder=gs://bkt/run",
]


@contextlib.contextmanager
def silent_endpoint(lifetime_s: float = 120.0):
    """http://127.0.0.1:PORT that accepts every connection and never sends a byte; its thread
    stops when the block ends, or by itself after `lifetime_s`."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.2)
    stop, held = threading.Event(), []
    deadline = time.monotonic() + lifetime_s

    def serve():
        while not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])  # held open, never answered
        for conn in held:
            conn.close()
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there now: connections are refused


@pytest.fixture
def emulator_host(monkeypatch):
    def point(host: str) -> None:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)

    yield point
    storage.set_timeout(900.0)


def _main(argv) -> int:
    from trainer.train import main

    return main(argv)


def test_a_silent_endpoint_is_one_line_within_the_startup_timeout(tmp_path, capsys, emulator_host):
    with silent_endpoint() as host:
        emulator_host(host)
        code = _main([*FAST, f"--job.dump_folder={tmp_path / 'run'}", "--training.startup_timeout_s=2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.splitlines() == [
        f"error: checkpoint.folder: cannot use gs://bkt/run: no answer from {host} within 2 s; allowed: a gs:// "
        "bucket this job can write, at an endpoint that answers within training.startup_timeout_s (2 s)"
    ], err
    assert not (tmp_path / "run").exists()  # the dump folder's lock put back: nothing made


def test_a_refused_connection_is_one_line_without_gcsfs_traceback(tmp_path, capsys, emulator_host):
    host = closed_port()
    emulator_host(host)
    code = _main([*FAST, f"--job.dump_folder={tmp_path / 'run'}", "--training.startup_timeout_s=30"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.splitlines() == [
        f"error: checkpoint.folder: cannot use gs://bkt/run: cannot connect to {host} (Connection refused); allowed: "
        "a gs:// bucket this job can write, at an endpoint that answers within training.startup_timeout_s (30 s)"
    ], err


@pytest.mark.parametrize("call", ["remove_step", "write_manifest", "complete_steps", "verify_checkpoint", "lock"])
def test_every_checkpoint_step_call_is_bounded_and_names_the_endpoint(emulator_host, monkeypatch, call):
    """The calls of a gs:// save, load and lock past the start-up probe (the endpoint stops answering
    after it): each ends within the bound with one line naming the endpoint."""
    from models.errors import ConfigError

    storage.set_timeout(1)
    with silent_endpoint() as host:
        emulator_host(host)
        if call == "lock":
            monkeypatch.setattr(storage, "check_bucket", lambda url, *, key: None)  # it answered then
            with pytest.raises(ConfigError) as e:
                runlock.RemoteLock("gs://bkt/run", key="checkpoint.folder").acquire()
            assert str(e.value) == (
                f"checkpoint.folder: cannot take the lock gs://bkt/run/.run.lock: no answer from {host} within 1 s; "
                "allowed: a gs:// folder this job can write"
            )
            return
        with pytest.raises(storage.RemoteUnreachable) as e:
            getattr(remote, call)("gs://bkt/run/step-3")
    assert str(e.value) == f"no answer from {host} within 1 s"


def test_the_default_bound_is_the_startup_timeout_default():
    from trainer.config.schema import TrainingConfig

    assert storage.timeout_s() == TrainingConfig().startup_timeout_s
