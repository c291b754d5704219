"""Distributed checkpoints (DCP): atomic save, resume, retention, async, initial weights.

Layout under the checkpoint folder:

    step-N/          a complete checkpoint (DCP files + .metadata), the only thing `load` reads
    .tmp-step-N/     a save in progress (or one that crashed); ignored, removed by the next save
    .old-step-N/     a checkpoint being deleted or replaced; ignored, removed by the next save

A save writes `.tmp-step-N`, waits until every rank's shards and the metadata are on disk, and
then rank 0 renames it to `step-N` (atomic on POSIX), so a job killed half-way never leaves a
newest `step-N` that fails to load. Deletion renames before removing, for the same reason.

The DCP state dict has one top-level key per state: `model`, `optimizer`, `lr_scheduler`,
`dataloader`, `train_state`; model parameters therefore appear as
`model.layers.0.attention.wq.weight` (scripts and the HF converter rely on it). Model and
optimizer go through `torch.distributed.checkpoint.state_dict`, so DTensor-sharded (SimpleFSDP,
TP, EP) states save and load across different meshes and world sizes. The learning-rate schedule
and the data loader are saved as they are: their states are plain values, the same on every rank
(trainer/data.py keeps a mesh-independent position), so DCP keeps one copy. The RNG states
differ per rank and are stored under `train_state.rng.rank_<r>`; a rank that has no entry (the
run resumed on more ranks) keeps its seeded RNG and says so.

All ranks must share the checkpoint folder (a shared or network file system across hosts).
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
import pickle
import random
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from models.errors import ConfigError
from trainer.device import cpu_backend

logger = logging.getLogger(__name__)

CHECKPOINT_KEYS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
ASYNC_MODES = ("disabled", "async")

# DCP warns on every single-process save/load even when asked for no_dist explicitly; async
# saves warn from a worker thread, so a catch_warnings block cannot hide it.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming")

# DCP raises CheckpointException, a BaseException, for failures on any rank.
_DCP_ERRORS = (Exception, CheckpointException)

_STEP_DIR = re.compile(r"^step-(\d+)$")
_RANK_KEY = re.compile(r"^rank_\d+$")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


# ---------------------------------------------------------------------------------------------
# State wrappers.


class ModelState:
    """The model's parameters and persistent buffers (DTensors stay sharded)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=True))


class OptimizerState:
    """Optimizer state keyed by parameter FQN (flattened), so it reshards like the model."""

    _options = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        # Before the first step the optimizer has no moments; DSD creates them (zeros) so the
        # load destination has the checkpoint's shape.
        return get_optimizer_state_dict(self.model, self.optimizer, options=self._options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the moments (and step counts) from the checkpoint; keep this run's
        hyperparameters (betas, eps, weight_decay...: the optimizer was built from the config).

        The lr is left as loaded: the lr schedule owns it (trainer/optim.py's schedule puts the
        config's lr back when it loads). `resume_notes` lists what differed from the checkpoint.
        """
        own = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self._options)
        changed: dict[str, tuple[Any, Any]] = {}
        for group, config in zip(self.optimizer.param_groups, own):
            for k, v in config.items():
                if k in ("lr", "initial_lr"):
                    continue
                if k in group and _differs(group[k], v):
                    changed.setdefault(k, (group[k], v))
                group[k] = v
        self.resume_notes = [
            f"optimizer.{k}: checkpoint {_fmt(saved)} -> config {_fmt(config)} (the config wins)"
            for k, (saved, config) in sorted(changed.items())
        ]


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a != b


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return repr(v)


def _capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # only if something in the job uses numpy's global RNG
        state["numpy"] = sys.modules["numpy"].random.get_state()
    tpu_generators = _tpu_generators()
    if tpu_generators is not None:
        state["tpu"] = [g.get_state() for g in tpu_generators]
    return state


def _tpu_generators() -> tuple | None:
    """torch-tpu's per-device default generators, only in a process that runs on a TPU.

    torch-tpu 0.2.0 makes `torch.tpu.get_rng_state` internal on torch >= 2.13, but its public
    (experimental) `torch.tpu.default_generators` has `get_state`/`set_state` like
    `torch.cuda.default_generators` (reference/xla_cpu_path.md §A.1 row 7). Not run on a TPU yet.
    """
    from trainer.device import tpu_present

    if not tpu_present():
        return None
    return tuple(torch.tpu.default_generators)


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            logger.warning("checkpoint: CUDA RNG state saved for %d devices, %d present; not restored",
                           len(state["cuda"]), torch.cuda.device_count())
    if "tpu" in state:
        generators = _tpu_generators()
        if generators is not None and len(generators) == len(state["tpu"]):
            for generator, saved in zip(generators, state["tpu"]):
                generator.set_state(saved)
        else:
            logger.warning("checkpoint: TPU RNG state saved for %d devices, %s here; not restored",
                           len(state["tpu"]), "none" if generators is None else len(generators))
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


class TrainState:
    """The step counter and this rank's RNG states (torch CPU/CUDA/TPU, python, numpy)."""

    def __init__(self, step: int = 0):
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rng": {f"rank_{_rank()}": pickle.dumps(_capture_rng())}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        blob = state_dict.get("rng", {}).get(f"rank_{_rank()}")
        if blob:
            _restore_rng(pickle.loads(blob))
        else:
            logger.warning("checkpoint: no RNG state for rank %d (saved with fewer ranks); RNG not restored", _rank())


def _drop_missing_rank_entries(tree: dict[str, Any], available: set[str], prefix: str = "") -> None:
    """Remove rank_<r> entries the checkpoint lacks, so DCP does not fail on them."""
    for k in list(tree):
        name = f"{prefix}.{k}" if prefix else str(k)
        if _RANK_KEY.match(str(k)) and not any(a == name or a.startswith(name + ".") for a in available):
            del tree[k]
        elif isinstance(tree[k], dict):
            _drop_missing_rank_entries(tree[k], available, name)


def _short(error: BaseException) -> str:
    """One line for an error message; for DCP's CheckpointException, the first rank's cause."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = next(iter(sorted(error.failures.items(), key=lambda item: item[0])))
        return f"rank {rank}: {type(cause).__name__}: {_short(cause)}"
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _say(message: str) -> None:
    """A line for the user on the console (rank 0 only): what a load took from where."""
    if _rank() == 0:
        print(message, flush=True)


# ---------------------------------------------------------------------------------------------
# Key and shape checks: every load path refuses a state that does not match in either direction.


def _natural(key: str) -> list:
    """Sort key that puts layers.2 before layers.10."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", key)]


def check_entries(*, expected: dict[str, tuple | None], stored: dict[str, tuple | None], key: str,
                  where: str, what: str = "the model", fix: str = "") -> None:
    """ConfigError naming the first differing entries unless `stored` has exactly the names of
    `expected` and the same shapes (None = not a tensor, shape not compared).

    expected: what this run needs (name -> shape); stored: what the file holds. Used by every
    load path (resume, initial dcp/hf weights, scripts/convert.py both ways), so a checkpoint
    with more or fewer layers, or other widths, is refused before anything is loaded or written.
    """
    missing = sorted(set(expected) - set(stored), key=_natural)
    unexpected = sorted(set(stored) - set(expected), key=_natural)
    reshaped = [k for k in sorted(set(expected) & set(stored), key=_natural)
                if expected[k] is not None and stored[k] is not None and tuple(expected[k]) != tuple(stored[k])]
    if not (missing or unexpected or reshaped):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} entries of {what} are not in it (first: {', '.join(missing[:3])})")
    if unexpected:
        parts.append(f"it has {len(unexpected)} entries {what} lacks (first: {', '.join(unexpected[:3])})")
    if reshaped:
        k = reshaped[0]
        parts.append(f"{len(reshaped)} entries differ in shape (first: {k} is {list(stored[k])} there, "
                     f"{list(expected[k])} in {what})")
    raise ConfigError(f"{key}: {where} does not match {what}: " + "; ".join(parts)
                      + (f"; {fix}" if fix else "; allowed: a checkpoint of the same model args (n_layers, dim, ...)"))


def _shape(value: Any) -> tuple | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _stored_shapes(path: Path) -> dict[str, tuple | None]:
    """name -> global shape (None for non-tensor entries) from a DCP checkpoint's metadata."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: (tuple(v.size) if hasattr(v, "size") else None) for k, v in metadata.items()}


# ---------------------------------------------------------------------------------------------
# Checksums: a manifest of per-file CRC-32s, written with each checkpoint and checked on load.

MANIFEST = "manifest.json"
BLOCK_BYTES = 64 * 1024 * 1024
_CHUNK = 8 * 1024 * 1024


class CorruptCheckpointError(ConfigError):
    """A checkpoint file is missing, truncated or differs from its checksum in manifest.json."""


def _hash_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _block_crc32(path: Path, offset: int, length: int) -> int:
    """CRC-32 of bytes [offset, offset + length) of a file, read in 8 MiB chunks. zlib and
    os.pread release the GIL, so blocks hash in parallel threads."""
    crc = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        end = offset + length
        while offset < end:
            data = os.pread(fd, min(_CHUNK, end - offset), offset)
            if not data:
                break
            crc = zlib.crc32(data, crc)
            offset += len(data)
    finally:
        os.close(fd)
    return crc


def _blocks(size: int) -> list[tuple[int, int]]:
    return [(start, min(BLOCK_BYTES, size - start)) for start in range(0, size, BLOCK_BYTES)] or [(0, 0)]


def crc32_blocks(paths: list[Path]) -> dict[Path, list[str]]:
    """For each file, the CRC-32 of each 64 MiB block as 8-digit hex strings. All blocks of all
    files go to one thread pool (zlib and os.pread release the GIL): ~1.1-1.5 GB/s per core
    here, see docs/checkpointing.md."""
    tasks = [(p, offset, n) for p in paths for offset, n in _blocks(p.stat().st_size)]
    with ThreadPoolExecutor(_hash_threads(), thread_name_prefix="ckpt-crc") as pool:
        crcs = list(pool.map(lambda t: _block_crc32(*t), tasks))
    out: dict[Path, list[str]] = {p: [] for p in paths}
    for (p, _, _), crc in zip(tasks, crcs):
        out[p].append(f"{crc:08x}")
    return out


def write_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """Write folder/manifest.json: for every file in the folder its size and the CRC-32 of each
    64 MiB block (hashed in parallel threads), atomically: a temporary file, fsync, rename.
    Call after every rank's files and .metadata are written."""
    folder = Path(folder)
    t0 = time.perf_counter()
    paths = [p for p in sorted(folder.iterdir(), key=lambda p: p.name)
             if p.is_file() and not p.name.startswith(MANIFEST)]
    crcs = crc32_blocks(paths)
    files = {p.name: {"size": p.stat().st_size, "crc32": crcs[p]} for p in paths}
    manifest = {"format": 1, "algorithm": "crc32", "block_bytes": BLOCK_BYTES, "files": files,
                "hash_seconds": round(time.perf_counter() - t0, 3)}
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(folder / MANIFEST)
    return manifest


def verify_checkpoint(folder: str | os.PathLike) -> bool:
    """Check every file listed in folder/manifest.json (presence and size, then the CRC-32 of
    each block, in parallel threads).

    Returns False when there is no manifest (a checkpoint written before manifests existed:
    nothing to check), True when every file matches; raises CorruptCheckpointError naming the
    first file (and byte range) that is missing, of another size, or fails its checksum.
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        assert manifest.get("algorithm") == "crc32" and manifest.get("block_bytes") == BLOCK_BYTES
    except Exception as e:  # noqa: BLE001 - a damaged manifest is a damaged checkpoint
        raise CorruptCheckpointError(f"{path} is unreadable ({type(e).__name__}: {_short(e)})") from None
    for name, entry in sorted(files.items()):
        file = folder / name
        if not file.is_file():
            raise CorruptCheckpointError(f"{file} is missing (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CorruptCheckpointError(f"{file} has {size} bytes, {MANIFEST} says {entry['size']}")
    crcs = crc32_blocks([folder / name for name in sorted(files)])
    for name in sorted(files):
        entry, got = files[name], crcs[folder / name]
        for i, (a, b) in enumerate(zip(got, entry["crc32"])):
            if a != b:
                start, n = _blocks(entry["size"])[i]
                where = f" in bytes {start}-{start + n - 1}" if len(got) > 1 else ""
                raise CorruptCheckpointError(f"{folder / name} fails its checksum{where} "
                                             f"(crc32 {a}, {MANIFEST} says {b})")
        if len(got) != len(entry["crc32"]):
            raise CorruptCheckpointError(f"{folder / name}: {MANIFEST} lists {len(entry['crc32'])} blocks, not {len(got)}")
    return True


# ---------------------------------------------------------------------------------------------
# Non-finite state.


def all_finite(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> bool:
    """True when every parameter (and optimizer state tensor) is finite on every rank.

    For a caller that wants to skip saving a checkpoint after a non-finite update. Sharded
    (DTensor) parameters are checked through their local shards and the answer is agreed
    across ranks with one all-reduce, so every rank must call it.
    """
    ok = True
    tensors = list(model.parameters())
    if optimizer is not None:
        tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            ok = False
            break
    if _dist_on() and dist.get_world_size() > 1:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32,
                            device=tensors[0].device if tensors and tensors[0].device.type != "meta" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
    return ok


# ---------------------------------------------------------------------------------------------
# The manager.


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions...); earlier checkpoints are intact."""


def _then_manifest(future: Any, folder: Path) -> None:
    """Rank 0's async save: wait for DCP's write (every rank's files and .metadata), then write
    the manifest, in the background thread, before the checkpoint is published."""
    future.result()
    write_manifest(folder)


def _result(future: Any, step: int) -> None:
    try:
        future.result()
    except _DCP_ERRORS as e:
        raise CheckpointSaveError(f"checkpoint: saving step {step} failed: {_short(e)}") from e


class CheckpointManager:
    """Save every `interval` steps, resume from the newest complete checkpoint.

    folder: the checkpoint folder (absolute, or relative to the working directory; the trainer
        passes dump_folder/checkpoint.folder).
    keep_latest_k: keep only the newest k complete checkpoints (0 keeps all).
    async_mode: "disabled" (blocking dcp.save) or "async" (dcp.async_save: states are copied to
        host memory, written in a background thread over a dedicated gloo group, and renamed to
        step-N once the write has finished; `wait()` blocks until then).
    load_step: -1 resumes from the newest complete checkpoint (or starts fresh if none); N >= 0
        loads step-N and fails with ConfigError if it is missing or broken.
    fallback_on_corrupt: when the newest checkpoint fails its checksums (load_step -1), load the
        newest older one that passes instead of stopping with an error (which names the file
        and the older step to use).
    Every save writes manifest.json (per-file CRC-32s) into the checkpoint before it becomes
    visible; every load checks it first.
    Every rank constructs the manager and calls every method (the calls hold collectives).
    """

    def __init__(self, *, folder: str | os.PathLike, interval: int, keep_latest_k: int, async_mode: str,
                 enable: bool, load_step: int = -1, fallback_on_corrupt: bool = False):
        if async_mode not in ASYNC_MODES:
            raise ConfigError(f"checkpoint.async_mode: {async_mode!r} is not a mode; allowed: {', '.join(ASYNC_MODES)}")
        if interval < 1:
            raise ConfigError(f"checkpoint.interval: {interval} must be >= 1")
        if keep_latest_k < 0:
            raise ConfigError(f"checkpoint.keep_latest_k: {keep_latest_k} must be >= 0 (0 keeps all)")
        if load_step < -1:
            raise ConfigError(f"checkpoint.load_step: {load_step}; allowed: -1 (newest) or a saved step >= 0")
        self.folder = Path(folder)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.enable = enable
        self.load_step = load_step
        self.fallback_on_corrupt = fallback_on_corrupt
        self._pending: tuple[Any, int] | None = None  # (future, step) of an async save
        self._hasher: ThreadPoolExecutor | None = None  # rank 0: writes an async save's manifest
        self._last_saved_step: int | None = None
        self._distributed = _dist_on()
        self._is_rank0 = _rank() == 0
        # Checkpoint coordination (DCP's plan exchange, barriers, async saves) runs on its own
        # gloo group: async saves talk from a background thread and must not interleave with
        # the training collectives, and gloo works whatever the device backend is.
        self._pg = dist.new_group(backend=cpu_backend()) if (enable and self._distributed) else None
        if enable and self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(f"checkpoint.folder: {self.folder} exists and is not a directory")

    # -- queries ----------------------------------------------------------------------------

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint (step-N with DCP metadata), ascending."""
        if not self.folder.is_dir():
            return []
        steps = []
        for entry in self.folder.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / ".metadata").is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def step_path(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    # -- load -------------------------------------------------------------------------------

    def load(self, states: dict[str, Stateful]) -> int:
        """Restore `states` from the newest complete checkpoint (or step `load_step`).

        Returns the step loaded, or 0 when checkpointing is off or there is nothing to resume.
        A missing or unreadable checkpoint named by load_step, a checkpoint whose files fail
        their checksums, or one that does not fit the states (other keys or shapes: another
        model, more or fewer layers) raises ConfigError; nothing on disk is changed. Prints
        (rank 0) what was taken from the checkpoint and what from the config.
        """
        if not self.enable:
            return 0
        available = self.complete_steps()
        if self.load_step >= 0:
            key = "checkpoint.load_step"
            if self.load_step not in available:
                raise ConfigError(
                    f"checkpoint.load_step: {self.step_path(self.load_step)} is not a complete checkpoint; "
                    f"allowed: -1 (newest) or one of the saved steps {available or '(none)'}"
                )
            candidates = [self.load_step]
        else:
            key = "checkpoint.folder"
            if not available:
                return 0
            candidates = available[::-1]
        for i, step in enumerate(candidates):
            path = self.step_path(step)
            problem = self._verify(path)
            if problem is None:
                break
            older = candidates[i + 1:] if self.load_step < 0 else [s for s in available if s < step][::-1]
            if self.load_step < 0 and self.fallback_on_corrupt and older:
                _say(f"checkpoint: {problem}; checkpoint.fallback_on_corrupt is set: trying step-{older[0]}")
                continue
            if older:
                hint = (f"to resume from the previous checkpoint set checkpoint.load_step = {older[0]} "
                        "(or checkpoint.fallback_on_corrupt = true)")
            else:
                hint = "no older checkpoint to fall back to; move the folder away to start fresh"
            raise ConfigError(f"{key}: {path} is corrupt: {problem}; {hint}")
        self._load_path(path, states, key)
        _say(f"checkpoint: resumed from {path} (step {step}): weights, optimizer moments, lr-schedule step, "
             "data position and RNG from the checkpoint; lr, schedule, betas, eps and weight_decay from the config")
        for state in states.values():
            for note in getattr(state, "resume_notes", ()):
                _say(f"checkpoint:   {note}")
        return step

    def _verify(self, path: Path) -> str | None:
        """Rank 0 checks the manifest (one read of the files, not one per rank); every rank gets
        the verdict: None if the checkpoint is intact (or has no manifest), else the reason."""
        problem = None
        if self._is_rank0:
            try:
                if not verify_checkpoint(path):
                    logger.warning("checkpoint: %s has no %s (written before checksums); not verified", path, MANIFEST)
            except CorruptCheckpointError as e:
                problem = str(e)
        if self._distributed:
            box = [problem]
            dist.broadcast_object_list(box, src=0, group=self._pg)
            problem = box[0]
        return problem

    def _load_path(self, path: Path, states: dict[str, Stateful], key: str) -> None:
        try:
            stored = _stored_shapes(path)
        except Exception as e:
            raise ConfigError(f"{key}: {path} is not a readable DCP checkpoint ({_short(e)})") from e
        state_dict = {name: state.state_dict() for name, state in states.items()}
        _drop_missing_rank_entries(state_dict, set(stored))
        flat = flatten_state_dict(state_dict)[0]
        # Model and optimizer moments must match exactly, in both directions (a checkpoint with
        # more layers must not load into fewer); the small states only need what this run reads.
        strict = ("model.", "optimizer.state.")
        check_entries(expected={k: _shape(v) for k, v in flat.items() if k.startswith(strict)},
                      stored={k: v for k, v in stored.items() if k.startswith(strict)},
                      key=key, where=str(path), what="this run's model and optimizer")
        missing = [k for k in flat if k not in stored]
        if missing:
            raise ConfigError(
                f"{key}: {path} does not match this run: {len(missing)} entries missing, e.g. {missing[:3]} "
                "(another model or optimizer?)"
            )
        try:
            dcp.load(state_dict, checkpoint_id=str(path), process_group=self._pg, no_dist=not self._distributed)
        except _DCP_ERRORS as e:
            raise ConfigError(f"{key}: cannot load {path}: {_short(e)}") from e
        for name, state in states.items():
            state.load_state_dict(state_dict[name])

    # -- save -------------------------------------------------------------------------------

    def maybe_save(self, step: int, states: dict[str, Stateful], *, force: bool = False) -> bool:
        """Save at every `interval`-th step (or when `force`, e.g. the last step).

        Also finishes an earlier async save whose write has completed. Returns True if a save
        of `step` was started.
        """
        if not self.enable:
            return False
        self._poll_async()
        if step == self._last_saved_step or not (force or step % self.interval == 0):
            return False
        self.save(step, states)
        return True

    def save(self, step: int, states: dict[str, Stateful]) -> None:
        """Write `states` as step-N now (blocking, or started in the background when async)."""
        assert self.enable
        self.wait()  # one save in flight at a time; also publishes the previous one
        tmp = self.folder / f".tmp-step-{step}"
        if self._is_rank0:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()
        self._barrier()
        state_dict = {name: state.state_dict() for name, state in states.items()}
        self._last_saved_step = step
        try:
            if self.async_mode == "async":
                future = dcp.async_save(state_dict, checkpoint_id=str(tmp), process_group=self._pg,
                                        no_dist=not self._distributed)
                if self._is_rank0:
                    # The manifest is written in the background too, once DCP's write is done.
                    self._hasher = self._hasher or ThreadPoolExecutor(1, thread_name_prefix="ckpt-manifest")
                    future = self._hasher.submit(_then_manifest, future, tmp)
                self._pending = (future, step)
                return
            dcp.save(state_dict, checkpoint_id=str(tmp), process_group=self._pg, no_dist=not self._distributed)
        except _DCP_ERRORS as e:
            raise CheckpointSaveError(f"checkpoint: saving {tmp} failed: {_short(e)}") from e
        self._barrier()  # every rank's shards are written before the checkpoint becomes visible
        if self._is_rank0:
            try:
                write_manifest(tmp)
            except OSError as e:
                raise CheckpointSaveError(f"checkpoint: writing {tmp / MANIFEST} failed: {_short(e)}") from e
            self._publish(step)
        self._barrier()

    def _poll_async(self) -> None:
        """Publish a finished async save without blocking (called every step)."""
        if self._pending is None:
            return
        future, step = self._pending
        if not future.done():
            return
        self._pending = None
        _result(future, step)  # re-raise a failed write on every rank
        # DCP's coordinator (rank 0) writes .metadata only after gathering every rank's write
        # results, so on rank 0 a finished future means the whole checkpoint is on disk.
        if self._is_rank0:
            self._publish(step)

    def wait(self) -> None:
        """Block until an in-flight async save is written and published as step-N."""
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        _result(future, step)
        if self._is_rank0:
            self._publish(step)
        self._barrier()

    def close(self) -> None:
        """Finish any in-flight save and release the checkpoint process group."""
        self.wait()
        if self._pg is not None and _dist_on():
            dist.destroy_process_group(self._pg)
        self._pg = None
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None

    # -- rank-0 file operations -----------------------------------------------------------------

    def _publish(self, step: int) -> None:
        tmp = self.folder / f".tmp-step-{step}"
        final = self.step_path(step)
        assert (tmp / ".metadata").is_file(), f"{tmp} has no .metadata after a finished save"
        old = self.folder / f".old-step-{step}"
        if final.exists():
            # Re-saving a step (resumed from an older one): move the old copy aside first, so
            # `final` is at every instant either absent or complete.
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(self.folder)
        shutil.rmtree(old, ignore_errors=True)
        logger.info("checkpoint: saved %s", final)
        self._purge()

    def _purge(self) -> None:
        if self.keep_latest_k <= 0:
            return
        for step in self.complete_steps()[: -self.keep_latest_k]:
            old = self.folder / f".old-step-{step}"
            self.step_path(step).rename(old)  # invisible to load before any file is removed
            shutil.rmtree(old, ignore_errors=True)

    def _remove_leftovers(self) -> None:
        for entry in self.folder.iterdir():
            if entry.name.startswith((".tmp-step-", ".old-step-")) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self._pg)


# ---------------------------------------------------------------------------------------------
# Initial weights.


def _safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of an HF folder (those its index names, if it has one) or file."""
    if path.is_file():
        return [path] if path.suffix == ".safetensors" else []
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_DTYPE_NAMES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def safetensors_header(file: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor in a safetensors file, from its header alone (the
    8-byte little-endian header length, then that many bytes of JSON; no tensor data is read)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size <= 0 or size > 100 * 1024**2:
            raise ValueError(f"{file}: not a safetensors file (header length {size})")
        header = json.loads(f.read(size))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: {name} has dtype {info['dtype']}; allowed: {sorted(_SAFETENSORS_DTYPES)}")
        out[name] = (tuple(info["shape"]), _SAFETENSORS_DTYPES[info["dtype"]])
    return out


class SafetensorsSlices:
    """Reads boxes of tensors from a set of safetensors files with `safe_open(...).get_slice`,
    opening a file only when a box in it is asked for, and counting what it reads.

    `release()` closes the open files: safe_open memory-maps a file, and the pages a read touched
    count in the process's resident memory until the map goes, so the loader and the converter
    release after each of our parameters (their peak is then one parameter's box, not a file).
    A tensor `read` returns may be a view of the map (no copy; it keeps the map alive): copy
    what must outlive the next `release()`.
    """

    def __init__(self, files: list[Path]):
        self.tensors: dict[str, tuple[Path, tuple[int, ...], torch.dtype]] = {}
        for file in files:
            for name, (shape, dtype) in safetensors_header(file).items():
                if name in self.tensors:
                    raise ValueError(f"{name}: in both {self.tensors[name][0].name} and {file.name}")
                self.tensors[name] = (file, shape, dtype)
        self.bytes_read = 0
        self.files_read: set[Path] = set()
        self._open: dict[Path, Any] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (_, shape, _) in self.tensors.items()}

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name][2]

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """HF tensor `name`'s box `slices` (one slice per dim, step 1; () for a whole 0-d tensor)."""
        from safetensors import safe_open

        file = self.tensors[name][0]
        if file not in self._open:
            handle = safe_open(str(file), framework="pt")
            self._open[file] = (handle, handle.__enter__())
        f = self._open[file][1]
        value = f.get_slice(name)[slices] if slices else f.get_tensor(name)
        self.bytes_read += value.numel() * value.element_size()
        self.files_read.add(file)
        return value

    def release(self) -> None:
        for handle, _ in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()


def local_box(value: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, shape) of the part of `value` this rank holds: all of a plain tensor, the
    local shard of a DTensor (Shard / _StridedShard / Replicate placements, any mesh)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return (0,) * value.ndim, tuple(value.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    assert tuple(shape) == tuple(value.to_local().shape), (
        f"local box {shape} != local shard {tuple(value.to_local().shape)} for placements {value.placements}")
    return tuple(offset), tuple(shape)


def _load_hf_sliced(model: torch.nn.Module, files: list[Path], *, hf_layout: Any, args: Any,
                    expected: dict[str, tuple | None], root: Path) -> SafetensorsSlices:
    """Each rank reads only the HF bytes of its own shard of each parameter (see load_initial)."""
    from safetensors import SafetensorError
    from torch.distributed.tensor import DTensor

    key = "checkpoint.initial_load_path"
    try:
        reader = SafetensorsSlices(files)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: cannot read {root}: {_short(e)}") from e
    try:
        layout = hf_layout(reader.shapes(), args)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{key}: {root} does not match the model: {_short(e)}") from e
    check_entries(expected=expected, stored={k: entry.shape for k, entry in layout.items()}, key=key,
                  where=str(root), what="the model")
    model_sd = get_model_state_dict(model)
    try:
        with torch.no_grad():
            for name, target in model_sd.items():
                entry = layout[name]
                offset, shape = local_box(target)
                box = read_box_of(entry, offset, shape, reader)
                local = target.to_local() if isinstance(target, DTensor) else target
                local.copy_(box)
                reader.release()
    except (OSError, RuntimeError, SafetensorError) as e:  # a truncated or unreadable file
        raise ConfigError(f"{key}: cannot read {root}: {_short(e)}") from e
    finally:
        reader.release()
    # get_model_state_dict's tensors normally share storage with the parameters, and then the
    # copies above are the load; otherwise (a wrapper that copies) load them the usual way.
    own = {_data_ptr(t) for t in model.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)}
    if not all(_data_ptr(t) in own for t in model_sd.values() if isinstance(t, torch.Tensor)):
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=True))
    return reader


def _data_ptr(value: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (value.to_local() if isinstance(value, DTensor) else value).data_ptr()


def read_box_of(entry: Any, offset: tuple[int, ...], shape: tuple[int, ...], reader: SafetensorsSlices) -> torch.Tensor:
    """Box [offset, offset + shape) of our parameter `entry` (an `HFEntry`) read through `reader`."""
    from models.common.hf import read_box

    return read_box(entry, offset, shape, reader.dtype(entry.pieces[0].hf_key), reader.read)


HF_CONFIG_MISMATCH = ("error", "override")


def load_initial(model: torch.nn.Module, *, path: str | os.PathLike, fmt: str, hf_adapter: Any = None,
                 args: Any = None, hf_config_mismatch: str = "error") -> None:
    """Load model weights (only) to start training from: a DCP folder or HF safetensors.

    Call on every rank after the model is materialized (and parallelized: DTensor parameters
    receive their own shards).
    fmt "dcp": a DCP folder whose keys are either `model.<fqn>` (a checkpoint of this trainer or
        of scripts/convert) or bare `<fqn>`; other states in it are ignored. Its manifest.json
        (if any) is verified first.
    fmt "hf": a folder of *.safetensors (with model.safetensors.index.json if sharded) or one
        .safetensors file, with the model's config.json next to it; `hf_adapter` is the model
        family's hf module (or its `from_hf` function). With an adapter that has `hf_layout`,
        each rank reads every file's header and then, for each parameter, only the slices of
        the HF tensors that its own shard covers (`safe_open(...).get_slice`); files holding
        none of them are never opened. With only `from_hf(hf_state_dict, args)`, every rank
        reads the full weights into host memory.
        The architecture in config.json (as `hf_adapter.args_from_hf_config` reads it) is
        compared with `args`: any difference (rope_theta, RoPE scaling, norm eps, layer
        count...) raises ConfigError when `hf_config_mismatch` is "error"; with "override" the
        run's `args` win and each difference is printed.
    Bad paths and weights whose names or shapes differ from the model's in either direction
    raise ConfigError naming checkpoint.initial_load_path; nothing is loaded then.
    """
    key = "checkpoint.initial_load_path"
    if fmt not in ("dcp", "hf"):
        raise ConfigError(f"checkpoint.initial_load_format: {fmt!r}; allowed: dcp, hf")
    if hf_config_mismatch not in HF_CONFIG_MISMATCH:
        raise ConfigError(f"checkpoint.hf_config_mismatch: {hf_config_mismatch!r}; allowed: {', '.join(HF_CONFIG_MISMATCH)}")
    root = Path(path) if path else None
    if root is None or not root.exists():
        raise ConfigError(f"{key}: {str(path)!r} does not exist; expected a DCP checkpoint folder or HF safetensors")
    expected = {k: _shape(v) for k, v in get_model_state_dict(model).items()}
    if fmt == "dcp":
        if not (root / ".metadata").is_file():
            raise ConfigError(f"{key}: {root} is not a DCP checkpoint folder (no .metadata); "
                              'for safetensors set initial_load_format = "hf"')
        try:
            verify_checkpoint(root)
        except CorruptCheckpointError as e:
            raise ConfigError(f"{key}: {root} is corrupt: {e}") from None
        try:
            stored = _stored_shapes(root)
        except Exception as e:
            raise ConfigError(f"{key}: {root} is not a readable DCP checkpoint ({_short(e)})") from e
        prefixed = any(k.startswith("model.") for k in stored)
        if prefixed:
            stored = {k[len("model."):]: v for k, v in stored.items() if k.startswith("model.")}
        check_entries(expected=expected, stored=stored, key=key, where=str(root), what="the model")
        model_sd = get_model_state_dict(model)
        dest = {"model": model_sd} if prefixed else model_sd
        try:
            dcp.load(dest, checkpoint_id=str(root), no_dist=not _dist_on())
        except _DCP_ERRORS as e:
            raise ConfigError(f"{key}: cannot load {root}: {_short(e)}") from e
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=True))
        return

    files = _safetensors_files(root)
    if not files or not all(f.is_file() for f in files):
        raise ConfigError(f"{key}: no safetensors weights at {root}; "
                          "expected *.safetensors (and model.safetensors.index.json if sharded)")
    from_hf = getattr(hf_adapter, "from_hf", hf_adapter)
    if from_hf is None:
        raise ConfigError("checkpoint.initial_load_format: 'hf' is not supported for this model "
                          "(no hf.py adapter); allowed: dcp")
    if hasattr(hf_adapter, "args_from_hf_config") and args is not None:
        check_hf_config(root if root.is_dir() else root.parent, hf_adapter=hf_adapter, args=args,
                        mismatch=hf_config_mismatch)
    hf_layout = getattr(hf_adapter, "hf_layout", None)
    if hf_layout is not None:
        reader = _load_hf_sliced(model, files, hf_layout=hf_layout, args=args, expected=expected, root=root)
        logger.info("checkpoint: rank %d read %.1f MB of tensor data from %d of %d safetensors files",
                    _rank(), reader.bytes_read / 1e6, len(reader.files_read), len(files))
        return
    # An adapter with only `from_hf` (a state dict in, a state dict out): every rank reads all.
    from safetensors.torch import load_file

    hf_state_dict: dict[str, torch.Tensor] = {}
    try:
        for file in files:
            hf_state_dict.update(load_file(str(file)))
    except Exception as e:
        raise ConfigError(f"{key}: cannot read {root}: {_short(e)}") from e
    try:
        state_dict = from_hf(hf_state_dict, args)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{key}: {root} does not match the model: {_short(e)}") from e
    check_entries(expected=expected, stored={k: _shape(v) for k, v in state_dict.items()}, key=key,
                  where=str(root), what="the model")
    try:
        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=True))
    except RuntimeError as e:  # anything the checks above did not foresee
        raise ConfigError(f"{key}: {root} does not match the model: {_short(e)}") from e


# Keys of hf_config(args) that are not architecture: the RoPE table length (the trainer sets it to
# the training seq_len), bookkeeping, and values that follow from compared ones.
_NOT_ARCHITECTURE = {"max_position_embeddings", "max_window_layers", "architectures", "torch_dtype",
                     "use_cache", "initializer_range", "transformers_version", "router_aux_loss_coef",
                     "output_router_logits"}


def hf_config_differences(hf_config: dict[str, Any], *, hf_adapter: Any, args: Any) -> list[tuple[str, Any, Any]]:
    """[(config.json key, its value, this run's value)] for every architectural difference.

    Both sides are put in the same canonical form first: `hf_adapter.hf_config(args)` of the
    run's args and of the args `hf_adapter.args_from_hf_config` reads from the file, so fields
    that config.json spells differently (rope_parameters vs rope_scaling, a missing head_dim)
    compare equal when they mean the same thing.
    """
    theirs = hf_adapter.hf_config(hf_adapter.args_from_hf_config(hf_config))
    ours = hf_adapter.hf_config(args)
    out = []
    for k in sorted(set(theirs) | set(ours)):
        if k in _NOT_ARCHITECTURE:
            continue
        a, b = theirs.get(k), ours.get(k)
        if _differs_loosely(a, b):
            out.append((k, a, b))
    return out


def _differs_loosely(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) != set(b) or any(_differs_loosely(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) != float(b)
    return a != b


def check_hf_config(folder: Path, *, hf_adapter: Any, args: Any, mismatch: str) -> None:
    """Compare folder/config.json's architecture with `args` (see load_initial)."""
    key = "checkpoint.initial_load_path"
    option = 'set checkpoint.hf_config_mismatch = "override" to train the recipe\'s model anyway'
    path = folder / "config.json"
    if not path.is_file():
        if mismatch == "override":
            _say(f"checkpoint: {path} not found; the architecture of the HF weights is not checked "
                 "(checkpoint.hf_config_mismatch = override)")
            return
        raise ConfigError(f"{key}: {path} not found, so the architecture of the weights cannot be checked; "
                          f"allowed: a Hugging Face folder with config.json, or {option}")
    try:
        hf_config = json.loads(path.read_text())
        diffs = hf_config_differences(hf_config, hf_adapter=hf_adapter, args=args)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: cannot read {path}: {_short(e)}") from None
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"{key}: {path} describes a model this trainer cannot build: {_short(e)}") from None
    if not diffs:
        return
    listed = ", ".join(f"{k}: config.json {_fmt(a)}, recipe {_fmt(b)}" for k, a, b in diffs[:4])
    more = f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else ""
    if mismatch == "error":
        raise ConfigError(f"{key}: the recipe's model differs from {path}: {listed}{more}; set the [model] "
                          f"fields to match, or {option}")
    for k, a, b in diffs:
        _say(f"checkpoint: hf_config_mismatch = override: {k} is {_fmt(b)} (recipe), not {_fmt(a)} ({path})")
