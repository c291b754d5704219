"""Nothing half-done at a destination (trainer/runtime/atomic.py): a checkpoint save or a
conversion whose write fails (a full disk, a file over the size limit, no permission: injected
into the writer, since a small tmpfs is not available to tests) removes its temporary output,
leaves earlier output as it was, and says what failed with the errno text on one line."""

import contextlib
import errno
import importlib.util
import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_fs

import models
from tests.e2e.test_runlock import hold
from tests.support.trainer_runs import TINY_RUN
from trainer import hf_convert
from trainer.checkpoint import CheckpointManager, CheckpointSaveError
from trainer.runtime import atomic
from trainer.runtime.atomic import WriteFailed, atomic_dir, atomic_file, write_error_text

_SPEC = importlib.util.spec_from_file_location("convert", Path(__file__).parents[2] / "scripts" / "convert.py")
convert = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(convert)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ERRNOS = [errno.ENOSPC, errno.EFBIG, errno.EACCES]


class _FailingStream(io.RawIOBase):
    """A file that accepts `budget` bytes, writes part of the next chunk, then fails with `code`
    (what a disk that fills, a size limit or a revoked permission do to a writer half-way)."""

    def __init__(self, inner, budget: int, code: int):
        self.inner, self.budget, self.code = inner, budget, code

    def writable(self):
        return True

    def write(self, b):
        data = memoryview(b).cast("B")
        if len(data) > self.budget:
            self.inner.write(data[: self.budget])
            self.budget = 0
            raise OSError(self.code, os.strerror(self.code))
        self.budget -= len(data)
        return self.inner.write(data)

    def tell(self):
        return self.inner.tell()

    def close(self):
        self.inner.close()
        super().close()


@pytest.fixture
def fail_dcp_writes(monkeypatch):
    """`arm(code)`: from now on every DCP file written fails with `code` after 300 bytes."""
    original = dcp_fs.FileSystem.create_stream
    armed = []

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            yield _FailingStream(stream, 300, armed[0]) if armed and "w" in mode else stream

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", create_stream)
    return armed.append


class _State:
    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.tensors = {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}

    def state_dict(self):
        return self.tensors

    def load_state_dict(self, state_dict):
        self.tensors = state_dict


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
@pytest.mark.parametrize("code", ERRNOS)
def test_failed_checkpoint_save_removes_its_files_and_says_why(tmp_path, fail_dcp_writes, code, async_mode):
    manager = CheckpointManager(folder=tmp_path, interval=1, keep_latest_k=0, async_mode=async_mode, enable=True)
    manager.save(1, {"model": _State(1)})
    manager.wait()
    fail_dcp_writes(code)
    with pytest.raises(CheckpointSaveError) as failed:
        manager.save(2, {"model": _State(2)})
        manager.wait()  # an async save's failure surfaces here
    message = str(failed.value)
    assert len(message.splitlines()) == 1 and os.strerror(code) in message, message
    assert message.startswith(f"checkpoint: saving step 2 to {tmp_path / '.tmp-step-2'} failed: {os.strerror(code)}")
    assert sorted(os.listdir(tmp_path)) == ["step-1"]  # no .tmp-step-2 left, step-1 untouched
    back = {"model": _State(3)}
    CheckpointManager(folder=tmp_path, interval=1, keep_latest_k=0, async_mode="disabled", enable=True).load(back)
    assert torch.equal(back["model"].tensors["w"], _State(1).tensors["w"])


@pytest.fixture
def gloo_group():
    """A one-process gloo group, as the trainer has: DCP then gathers each rank's write failure
    (pickled, even for one rank) instead of raising it in place."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_full_disk_inside_torch_save_is_named_through_a_process_group(tmp_path, fail_dcp_writes, gloo_group, code):
    """issue 38: on a full disk a checkpoint save said torch's "unexpected pos 704 vs 598" (the zip
    writer drops the OSError; DCP's gather dropped what was left of it). The write fails here in
    the middle of a tensor's torch.save, as on a real disk; the line names the folder and the
    cause, and the previous checkpoint still loads."""
    manager = CheckpointManager(folder=tmp_path, interval=1, keep_latest_k=0, async_mode="disabled", enable=True)
    assert manager._distributed
    manager.save(1, {"model": _State(1)})
    fail_dcp_writes(code)
    with pytest.raises(CheckpointSaveError) as failed:
        manager.save(2, {"model": _State(2)})
    message = str(failed.value)
    assert message.startswith(
        f"checkpoint: saving step 2 to {tmp_path / '.tmp-step-2'} failed: {os.strerror(code)}; "
        f"its partial files were removed; earlier checkpoints in {tmp_path} are intact"
    ), message
    assert "unexpected pos" not in message and len(message.splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["step-1"]
    back = {"model": _State(3)}
    assert manager.load(back) == 1
    assert torch.equal(back["model"].tensors["w"], _State(1).tensors["w"])


def test_trainer_reports_a_failed_save_on_one_line(tmp_path, fail_dcp_writes, capsys):
    from trainer.train import main

    fail_dcp_writes(errno.ENOSPC)
    code = main(
        [
            *TINY_RUN,
            "--training.steps=1",
            "--checkpoint.enable=true",
            f"--job.dump_folder={tmp_path}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            f"error: checkpoint: saving step 1 to {tmp_path / 'checkpoints' / '.tmp-step-1'} failed: No space left on device"
        )
    )
    assert os.listdir(tmp_path / "checkpoints") == []


@pytest.mark.parametrize("target", ["config", "metrics"])
def test_a_failed_run_folder_write_ends_the_run_on_one_line(tmp_path, monkeypatch, capsys, target):
    """config.toml is published whole (atomic_file); a failed write of it or of metrics.jsonl (a
    full disk, a quota, a read-only mount: injected) ends the run with one line naming the file
    and the cause, and leaves the earlier config.toml as it was."""
    from trainer.runtime import metrics
    from trainer.train import main

    code_errno = errno.EDQUOT if target == "metrics" else errno.ENOSPC
    (tmp_path / "config.toml").write_text("# an earlier run's\n")
    if target == "config":
        real_fsync = os.fsync

        def fsync(fd):
            if ".tmp-config-" in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(code_errno, os.strerror(code_errno))
            return real_fsync(fd)

        monkeypatch.setattr(atomic.os, "fsync", fsync)
        want = (
            f"error: writing config {tmp_path / 'config.toml'} failed: {os.strerror(code_errno)}; "
            f"{tmp_path / 'config.toml'} is unchanged"
        )
    else:

        class Full(io.StringIO):
            def write(self, text):
                raise OSError(code_errno, os.strerror(code_errno))

        monkeypatch.setattr(metrics, "open", lambda *a, **k: Full(), raising=False)
        want = f"error: writing metrics {tmp_path / 'metrics.jsonl'} failed: {os.strerror(code_errno)}"
    code = main(
        [
            *TINY_RUN,
            "--training.steps=1",
            "--checkpoint.enable=false",
            f"--job.dump_folder={tmp_path}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and err.strip().splitlines()[-1] == want, err
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tmp-")]
    config = (tmp_path / "config.toml").read_text()
    assert config == "# an earlier run's\n" if target == "config" else f'dump_folder = "{tmp_path}"' in config


def test_the_zip_writers_lost_errno_is_recovered_from_free_space(tmp_path, monkeypatch):
    # torch.save on a full disk: "[enforce fail at inline_container.cc] . unexpected pos 704 vs 598"
    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(atomic, "_free_bytes", lambda path: 0)
    assert write_error_text(lost, tmp_path) == "No space left on device"
    monkeypatch.setattr(atomic, "_free_bytes", lambda path: 10 << 30)  # space left: not guessed
    assert write_error_text(lost, tmp_path).endswith("unexpected pos 704 vs 598")


def test_atomic_file_and_dir_leave_the_destination_as_it_was(tmp_path):
    dest = tmp_path / "grid.png"
    dest.write_bytes(b"old")
    with pytest.raises(WriteFailed, match=f"writing file {dest} failed: File too large; {dest} is unchanged"):
        with atomic_file(dest) as f:
            f.write(b"new, half")
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    assert dest.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["grid.png"]
    with atomic_file(dest) as f:
        f.write(b"new")
    assert dest.read_bytes() == b"new" and sorted(os.listdir(tmp_path)) == ["grid.png"]
    out = tmp_path / "out"
    with pytest.raises(ValueError):  # not a write error: passes through, the temporary folder still goes
        with atomic_dir(out) as tmp:
            (tmp / "a").write_text("x")
            raise ValueError("bad")
    assert sorted(os.listdir(tmp_path)) == ["grid.png"]
    out.mkdir()  # an empty folder made for the output is taken over
    with atomic_dir(out) as tmp:
        (tmp / "a").write_text("x")
    assert os.listdir(out) == ["a"] and sorted(os.listdir(tmp_path)) == ["grid.png", "out"]


# -- conversions ----------------------------------------------------------------------------------


@pytest.fixture
def dcp_checkpoint(tmp_path) -> tuple[Path, object, object]:
    family = models.get_model_family("llama3")
    args = family.get_args("debugmodel", n_layers=1)
    torch.manual_seed(0)
    model = family.model_cls(args)
    model.init_weights()
    step = tmp_path / "checkpoints" / "step-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step))
    return step, family, args


def _to_hf(step, out) -> list[str]:
    return [
        "to-hf",
        "--checkpoint",
        str(step),
        "--model.name",
        "llama3",
        "--model.flavor",
        "debugmodel",
        "--model.n_layers=1",
        str(out),
    ]


@pytest.mark.parametrize("code", ERRNOS)
def test_failed_to_hf_leaves_nothing_and_says_why(tmp_path, dcp_checkpoint, monkeypatch, capsys, code):
    step, _, _ = dcp_checkpoint
    write = hf_convert._write_safetensors

    def failing(path, entries, chunks):
        write(path, entries, chunks)  # the whole file, then the disk "fills"
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(hf_convert, "_write_safetensors", failing)
    out = tmp_path / "exports" / "hf"
    assert convert.main(_to_hf(step, out)) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"error: writing Hugging Face folder {out} failed: {os.strerror(code)}; nothing was left at the destination\n"
    )
    assert os.listdir(tmp_path / "exports") == []  # no temporary folder, no lock file, no `hf`


@pytest.mark.parametrize("code", ERRNOS)
def test_failed_from_hf_leaves_nothing_and_says_why(tmp_path, dcp_checkpoint, fail_dcp_writes, capsys, code):
    step, family, args = dcp_checkpoint
    hf_convert.convert_to_hf(step, family, args, tmp_path / "hf")
    fail_dcp_writes(code)
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back" / "dcp")]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: writing DCP checkpoint {tmp_path / 'back' / 'dcp'} failed: {os.strerror(code)}; "
        "nothing was left at the destination\n"
    )
    assert os.listdir(tmp_path / "back") == []


def test_conversion_destinations_occupied_or_in_use_are_refused(tmp_path, dcp_checkpoint, capsys):
    step, _, _ = dcp_checkpoint
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("earlier work\n")
    assert convert.main(_to_hf(step, occupied)) == 2
    assert capsys.readouterr().err == (
        f"error: {occupied}: exists and is not an empty folder; allowed: a new or empty "
        "folder (a conversion never writes over or into earlier output)\n"
    )
    assert os.listdir(occupied) == ["keep.txt"]
    busy = tmp_path / "busy"
    holder = hold(busy, "dest")  # another conversion is writing `busy`
    try:
        assert convert.main(_to_hf(step, busy)) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: {busy}: {busy} is in use by another conversion (host ") and f"pid {holder.pid}" in err
    )
    assert err.count("\n") == 1 and not busy.exists()
    assert convert.main(_to_hf(step, busy)) == 0  # the holder is gone: its lock file does not block
    assert sorted(os.listdir(busy)) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "checkpoints", "occupied"]


# -- data-set builds ------------------------------------------------------------------------------


def _half_then_fail(code: int):
    def build_dataset(params, folder, **kwargs):
        os.makedirs(folder)
        (Path(folder) / "train-00000-of-00001.parquet").write_bytes(b"PAR1 half")  # a partial shard
        raise OSError(code, os.strerror(code))

    return build_dataset


@pytest.mark.parametrize("code", ERRNOS)
def test_failed_flux_data_builds_leave_nothing_and_say_why(tmp_path, monkeypatch, capsys, code):
    from trainer.flux_data import build as fb

    spec = importlib.util.spec_from_file_location(
        "build_flux_data", Path(__file__).parents[2] / "scripts" / "data" / "build_flux_data.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "build_dataset", _half_then_fail(code))
    out = tmp_path / "sets" / "mine"
    assert script.main(["--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert (
        err == f"error: writing FLUX data set {out} failed: {os.strerror(code)}; nothing was left at the destination\n"
    )
    assert os.listdir(tmp_path / "sets") == []
    # the shared cache the trainer builds into: no half-built set, no temporary folder left
    monkeypatch.setattr(fb, "build_dataset", _half_then_fail(code))
    with pytest.raises(WriteFailed, match=f"building the FLUX data set in .* failed: {os.strerror(code)}; its partial"):
        fb.ensure_procedural_dataset(cache_root=str(tmp_path / "cache"), log=lambda msg: None)
    assert [p for p in os.listdir(tmp_path / "cache") if not p.endswith(".lock")] == []
