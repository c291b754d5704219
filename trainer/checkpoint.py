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
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self._options)


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


def _flat_keys(state_dict: dict[str, Any]) -> list[str]:
    """The names DCP stores a nested state dict under (dicts joined by '.', lists of dicts or
    tensors by index), as found in the checkpoint's metadata."""
    return list(flatten_state_dict(state_dict)[0])


def _drop_missing_rank_entries(tree: dict[str, Any], available: set[str], prefix: str = "") -> None:
    """Remove rank_<r> entries the checkpoint lacks, so DCP does not fail on them."""
    for k in list(tree):
        name = f"{prefix}.{k}" if prefix else str(k)
        if _RANK_KEY.match(str(k)) and not any(a == name or a.startswith(name + ".") for a in available):
            del tree[k]
        elif isinstance(tree[k], dict):
            _drop_missing_rank_entries(tree[k], available, name)


def _read_metadata_keys(path: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


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


# ---------------------------------------------------------------------------------------------
# The manager.


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions...); earlier checkpoints are intact."""


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
    Every rank constructs the manager and calls every method (the calls hold collectives).
    """

    def __init__(self, *, folder: str | os.PathLike, interval: int, keep_latest_k: int, async_mode: str,
                 enable: bool, load_step: int = -1):
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
        self._pending: tuple[Any, int] | None = None  # (future, step) of an async save
        self._last_saved_step: int | None = None
        self._distributed = _dist_on()
        self._is_rank0 = _rank() == 0
        # Checkpoint coordination (DCP's plan exchange, barriers, async saves) runs on its own
        # gloo group: async saves talk from a background thread and must not interleave with
        # the training collectives, and gloo works whatever the device backend is.
        self._pg = dist.new_group(backend="gloo") if (enable and self._distributed) else None
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
        A missing or unreadable checkpoint named by load_step, or a checkpoint that does not fit
        the states (another model, say), raises ConfigError; nothing on disk is changed.
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
            step = self.load_step
        else:
            key = "checkpoint.folder"
            if not available:
                return 0
            step = available[-1]
        path = self.step_path(step)
        self._load_path(path, states, key)
        logger.info("checkpoint: resumed from %s", path)
        return step

    def _load_path(self, path: Path, states: dict[str, Stateful], key: str) -> None:
        try:
            available = _read_metadata_keys(path)
        except Exception as e:
            raise ConfigError(f"{key}: {path} is not a readable DCP checkpoint ({_short(e)})") from e
        state_dict = {name: state.state_dict() for name, state in states.items()}
        _drop_missing_rank_entries(state_dict, available)
        missing = [k for k in _flat_keys(state_dict) if k not in available]
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
                self._pending = (future, step)
                return
            dcp.save(state_dict, checkpoint_id=str(tmp), process_group=self._pg, no_dist=not self._distributed)
        except _DCP_ERRORS as e:
            raise CheckpointSaveError(f"checkpoint: saving {tmp} failed: {_short(e)}") from e
        self._barrier()  # every rank's shards are written before the checkpoint becomes visible
        if self._is_rank0:
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
    if path.is_file():
        return [path] if path.suffix == ".safetensors" else []
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


def load_initial(model: torch.nn.Module, *, path: str | os.PathLike, fmt: str, hf_adapter: Any = None,
                 args: Any = None) -> None:
    """Load model weights (only) to start training from: a DCP folder or HF safetensors.

    Call on every rank after the model is materialized (and parallelized: DTensor parameters
    receive their own shards).
    fmt "dcp": a DCP folder whose keys are either `model.<fqn>` (a checkpoint of this trainer or
        of scripts/convert) or bare `<fqn>`; other states in it are ignored.
    fmt "hf": a folder of *.safetensors (with model.safetensors.index.json if sharded) or one
        .safetensors file; `hf_adapter` is the model family's hf module (or its `from_hf`
        function) and turns the HF state dict into ours: `from_hf(hf_state_dict, args)`.
        Every rank reads the full weights into host memory.
    Bad paths and weights that do not fit the model raise ConfigError naming
    checkpoint.initial_load_path.
    """
    key = "checkpoint.initial_load_path"
    if fmt not in ("dcp", "hf"):
        raise ConfigError(f"checkpoint.initial_load_format: {fmt!r}; allowed: dcp, hf")
    root = Path(path) if path else None
    if root is None or not root.exists():
        raise ConfigError(f"{key}: {str(path)!r} does not exist; expected a DCP checkpoint folder or HF safetensors")
    if fmt == "dcp":
        if not (root / ".metadata").is_file():
            raise ConfigError(f"{key}: {root} is not a DCP checkpoint folder (no .metadata); "
                              'for safetensors set initial_load_format = "hf"')
        try:
            available = _read_metadata_keys(root)
        except Exception as e:
            raise ConfigError(f"{key}: {root} is not a readable DCP checkpoint ({_short(e)})") from e
        model_sd = get_model_state_dict(model)
        prefixed = any(k.startswith("model.") for k in available)
        dest = {"model": model_sd} if prefixed else model_sd
        missing = [k for k in _flat_keys(dest) if k not in available]
        if missing:
            raise ConfigError(f"{key}: {root} lacks {len(missing)} of the model's weights, e.g. {missing[:3]}")
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
    expected = set(get_model_state_dict(model))
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ConfigError(f"{key}: {root} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    try:
        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=True))
    except RuntimeError as e:  # shape mismatches
        raise ConfigError(f"{key}: {root} does not match the model: {_short(e)}") from e
