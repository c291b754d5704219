"""Checkpoint state: the wrappers DCP saves (model, optimizer, train state with RNG), the
finiteness check before a save, and the small helpers the other checkpoint modules share."""

from __future__ import annotations

import logging
import os
import pickle
import random
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from models.common import distributed

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
    return distributed.is_up()


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

        The lr is left as loaded: the lr schedule owns it (trainer/optim/build.py's schedule puts the
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
    `torch.cuda.default_generators` (read from the torch-tpu 0.2.0 package; docs/tpu.md, "What the
    device layer does on TPU"). Not run on a TPU yet.
    """
    from trainer.runtime.device import tpu_present

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
            logger.warning(
                "checkpoint: CUDA RNG state saved for %d devices, %d present; not restored",
                len(state["cuda"]),
                torch.cuda.device_count(),
            )
    if "tpu" in state:
        generators = _tpu_generators()
        if generators is not None and len(generators) == len(state["tpu"]):
            for generator, saved in zip(generators, state["tpu"]):
                generator.set_state(saved)
        else:
            logger.warning(
                "checkpoint: TPU RNG state saved for %d devices, %s here; not restored",
                len(state["tpu"]),
                "none" if generators is None else len(generators),
            )
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


def run_states(*, model, optimizer, scheduler, train_state: TrainState, dataloader=None) -> dict[str, Any]:
    """The states a checkpoint holds, under `CHECKPOINT_KEYS` (the engine's have no data loader)."""
    states = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, optimizer),
        "lr_scheduler": scheduler,
        "dataloader": dataloader,
        "train_state": train_state,
    }
    return {key: states[key] for key in CHECKPOINT_KEYS if states[key] is not None}


def _drop_missing_rank_entries(tree: dict[str, Any], available: set[str], prefix: str = "") -> None:
    """Remove rank_<r> entries the checkpoint lacks, so DCP does not fail on them."""
    for k in list(tree):
        name = f"{prefix}.{k}" if prefix else str(k)
        if _RANK_KEY.match(str(k)) and not any(a == name or a.startswith(name + ".") for a in available):
            del tree[k]
        elif isinstance(tree[k], dict):
            _drop_missing_rank_entries(tree[k], available, name)


def short_error(error: BaseException) -> str:
    """One line for an error message; for DCP's CheckpointException, the first rank's cause."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = next(iter(sorted(error.failures.items(), key=lambda item: item[0])))
        return f"rank {rank}: {type(cause).__name__}: {short_error(cause)}"
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
        flag = torch.tensor(
            [1 if ok else 0],
            dtype=torch.int32,
            device=tensors[0].device if tensors and tensors[0].device.type != "meta" else "cpu",
        )
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
    return ok
