"""The device layer: pick cpu / cuda / tpu, start the process group, seed.

TPU code stays here and in `trainer/graph/tpu.py`: nothing imports `torch_tpu` unless a TPU
was requested or detected, because importing it on a host without a TPU changes torch's
globals (see docs/tpu.md). None of the TPU paths has run on a TPU yet.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import random
import subprocess
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from models.errors import ConfigError

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "tpu": "tpu_dist"}


def torch_tpu_installed() -> bool:
    """True when the torch-tpu package is installed; does not import it."""
    return importlib.util.find_spec("torch_tpu") is not None


def tpu_present() -> bool:
    """True iff torch-tpu's autoload initialised a TPU in this process (never starts PJRT)."""
    if not torch_tpu_installed() or os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "0":
        return False
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == "tpu"


def pick_device(kind: str = "auto") -> torch.device:
    """`[device] type`: auto | cpu | cuda | tpu -> the torch.device this process trains on."""
    if kind == "auto":
        kind = "tpu" if tpu_present() else "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "tpu":
        if not tpu_present():
            raise ConfigError("device.type: tpu requested but torch-tpu found no TPU (pip install '.[tpu]' on a TPU VM)")
        return torch.device("tpu")  # one process per TPU device; torch-tpu owns the index
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device.type: cuda requested but no CUDA device is available; allowed here: cpu, auto")
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int


def init_distributed(device: torch.device) -> DistInfo:
    """Start the default process group (gloo / nccl / tpu_dist).

    Under torchrun the env:// rendezvous is used. A plain single process still gets a
    world-size-1 group (through a file store) so that DeviceMesh, DTensor and DCP run the same
    code path at any scale.
    """
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    backend = BACKENDS[device.type]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is None:
            dist.init_process_group(backend=backend)
        else:
            # After a torchrun restart, keys of the failed attempt can still be in the store;
            # gloo then reads a dead peer's address. A per-attempt key prefix keeps rounds apart.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=timedelta(minutes=10))
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"titan/attempt_{restart}", store),
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        fd, path = tempfile.mkstemp(prefix="titan-pg-")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group(backend=backend, init_method=f"file://{path}", rank=0, world_size=1)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def set_seed(seed: int) -> None:
    """Same seed on every rank: weights are initialised identically before sharding."""
    random.seed(seed)
    torch.manual_seed(seed)



def cpu_model() -> str:
    """The host CPU's model name (lscpu), for the CPU line of every benchmark's output."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
