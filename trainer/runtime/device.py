"""The device layer: pick cpu / cuda / tpu, start the process group, seed.

TPU code stays here and in `trainer/graph/tpu.py`: nothing imports `torch_tpu` unless a TPU
was requested or detected, because importing it on a host without a TPU changes torch's
globals (see docs/tpu.md). None of the TPU paths has run on a TPU yet.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from models.common import distributed
from models.errors import ConfigError, check_choice
from trainer.runtime.atomic import WriteFailed, atomic_file
from trainer.runtime.pci import tpu_generations_on_pci

GLOO_SERIAL = "gloo_serial"
"""The CPU process-group backend: torch's gloo with ONE worker thread (`cpu_backend`)."""
BACKENDS = {"cuda": "nccl", "tpu": "tpu_dist"}
DEVICE_TYPES = ("auto", "cpu", "cuda", "tpu")
"""`[device] type` choices (`pick_device`)."""

"""Process-group backends of the accelerators; the CPU's is `cpu_backend()` (registered on use)."""


def cpu_backend() -> str:
    """The name of the backend for CPU collectives (registered on first use): gloo, one worker.

    torch's ProcessGroupGloo runs collectives on 2 worker threads. With two of them in flight
    at once, which the graph step does (it issues all-gathers ahead of their use and waits for
    reduce-scatters late), torch 2.13's gloo crashed 2-process graph training of the debug
    recipe in 5 of 18 runs of 20-30 steps (a SIGSEGV in `gloo::transport::tcp::UnboundBuffer::
    ~UnboundBuffer` at the end of an all-gather on a worker thread, or glibc's "malloc():
    unaligned tcache chunk detected"); with one worker, which runs the collectives in issue
    order, none of 10 did (docs/parallelism.md, "CPU collectives"). Eager steps wait for each
    collective where they issue it.
    """
    if GLOO_SERIAL not in dist.Backend.backend_list:
        dist.Backend.register_backend(GLOO_SERIAL, _serial_gloo, extended_api=True, devices=["cpu"])
    return GLOO_SERIAL


def _serial_gloo(opts, _backend_options=None):
    gloo = dist.ProcessGroupGloo
    options = gloo._Options()
    options._threads = 1
    options._timeout = opts.timeout
    options._devices = [gloo.create_default_device()]
    return gloo(opts.store, opts.group_rank, opts.group_size, options)


def torch_tpu_installed() -> bool:
    """True when the torch-tpu package is installed; does not import it."""
    return importlib.util.find_spec("torch_tpu") is not None


def tpu_present() -> bool:
    """True iff torch-tpu's autoload initialised a TPU in this process (never starts PJRT)."""
    if not torch_tpu_installed() or os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "0":
        return False
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == "tpu"


def tpu_chips_on_pci() -> int:
    """TPU chips on this host's PCI bus (Google's vendor id and a TPU device id); sysfs only."""
    return len(tpu_generations_on_pci())


def _no_torch_tpu(why: str) -> ConfigError:
    return ConfigError(
        f"device.type: {why}, but torch-tpu is not installed for {sys.executable} (Python "
        f"{platform.python_version()}); allowed: install it with `source scripts/env.sh tpu` "
        "(Python 3.11, pins in constraints/tpu.txt; docs/tpu.md), or device.type = cpu"
    )


def pick_device(kind: str = "auto") -> torch.device:
    """`[device] type`: auto | cpu | cuda | tpu -> the torch.device this process trains on.

    A TPU requested, or `auto` on a host with TPU chips, without torch-tpu installed is refused
    (one `error:` line with the install command) rather than trained on the CPU by surprise.
    """
    if kind == "auto":
        if not torch_tpu_installed() and (chips := tpu_chips_on_pci()):
            raise _no_torch_tpu(f"auto found {chips} TPU chip(s) on this host")
        kind = "tpu" if tpu_present() else "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "tpu":
        if not torch_tpu_installed():
            raise _no_torch_tpu("tpu requested")
        if not tpu_present():
            raise ConfigError(
                "device.type: tpu requested but torch-tpu found no TPU (TORCH_DEVICE_BACKEND_AUTOLOAD="
                f"{os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD', '1')}); allowed: a TPU VM with "
                "TORCH_DEVICE_BACKEND_AUTOLOAD=1 (trainer.launch sets it), or device.type = cpu"
            )
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
    """Process-group rank: the place in the mesh (the device order renumbers, parallelisms/device_order.py)."""
    world_size: int
    local_rank: int


_COLLECTIVE_TIMEOUT: list[timedelta | None] = [None]
_LAUNCHER_RANKS: list[tuple[int, ...] | None] = [None]
"""The device order's `order` (launcher rank of each process-group rank) of this process's group."""


def launcher_rank_of(rank: int) -> int:
    """The rank the launcher gave process-group rank `rank` (the device order renumbers them,
    parallelisms/device_order.py): what names its host in messages (launcher rank // processes per node)."""
    order = _LAUNCHER_RANKS[0]
    return order[rank] if order is not None and rank < len(order) else rank


def collective_timeout() -> timedelta | None:
    """The job's collective timeout (`training.collective_timeout_s`, set by `init_distributed`),
    for the process groups made later (the checkpoint's): None = the backend's default."""
    return _COLLECTIVE_TIMEOUT[0]


def init_distributed(device: torch.device, *, timeout_s: float | None = None, order=None) -> DistInfo:
    """Start the default process group (gloo / nccl / tpu_dist).

    Under torchrun the env:// rendezvous is used. A plain single process still gets a
    world-size-1 group (through a file store) so that DeviceMesh, DTensor and DCP run the same
    code path at any scale. timeout_s: how long a collective waits for a peer before it fails (a
    lost host whose connections stay half-open is noticed within it); None: the backend's default.
    order: the run's `parallelisms.device_order.RankOrder`: the process the launcher started as
    rank `order[p]` joins as rank p (its place in the layout); None: the launcher's rank.
    """
    if distributed.is_up():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    backend = cpu_backend() if device.type == "cpu" else BACKENDS[device.type]
    timeout = _COLLECTIVE_TIMEOUT[0] = timedelta(seconds=timeout_s) if timeout_s else None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world, launcher = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        assert order is None or order.world_size == world, "the device order was resolved for another world"
        rank = launcher if order is None else order.process_rank(launcher)
        _LAUNCHER_RANKS[0] = None if order is None else order.order
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is None:
            # rank 0's process hosts the store when the launcher has none of its own (torchrun's
            # agent store, TORCHELASTIC_USE_AGENT_STORE, is used by every rank alike)
            dist.init_process_group(backend=backend, timeout=timeout, rank=rank, world_size=world)
        else:
            # After a torchrun restart, keys of the failed attempt can still be in the store;
            # gloo then reads a dead peer's address. A per-attempt key prefix keeps rounds apart.
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(minutes=10),
            )
            dist.init_process_group(
                backend=backend,
                store=dist.PrefixStore(f"titan/attempt_{restart}", store),
                rank=rank,
                world_size=world,
                timeout=timeout,
            )
    else:
        fd, path = tempfile.mkstemp(prefix="titan-pg-")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group(backend=backend, init_method=f"file://{path}", rank=0, world_size=1)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def shutdown_distributed() -> None:
    if distributed.is_up():
        dist.destroy_process_group()


def set_seed(seed: int) -> None:
    """Same seed on every rank: weights are initialised identically before sharding."""
    random.seed(seed)
    torch.manual_seed(seed)


HOST_MALLOC = ("auto", "retain", "system")
"""`[device] host_malloc`: how this process's C heap (glibc malloc, where CPU tensors live) treats
large blocks. `system`: glibc's defaults; `retain`: freed memory stays in the heap for reuse;
`auto`: `retain` on the CPU device, `system` on accelerators."""

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # <malloc.h>


def configure_host_malloc(mode: str, device: torch.device) -> str:
    """Apply `[device] host_malloc` to this process; return what was done, for the banner.

    glibc serves every block above its mmap threshold (at most 32 MiB) with its own `mmap` and
    unmaps it on free, and returns the heap's free top to the OS above the trim threshold. A
    training step allocates and frees the same large activations every step, so with the
    defaults each step faults in those pages afresh (the kernel zeroes every 4 KiB page): with
    layer scan, whose per-layer saved activations are stacked into one buffer per value
    (6 x 8 x 2048 x 768 bf16 = 151 MB), the scanned step ran at 1.01-1.20x the unrolled one
    with 2.7M-5.9M minor faults per benchmark process, against 0.95-0.99x and 0.89M with `retain`
    (AMD EPYC VM; docs/graph_trainer.md, "Scan performance").
    `retain` sets `M_MMAP_MAX = 0` (large blocks come from the heap) and `M_TRIM_THRESHOLD = -1`
    (the heap is never trimmed): freed blocks are reused by the next step, at the cost of the
    process keeping its peak heap (which a training loop reaches every step anyway). Both are
    glibc's documented `mallopt` parameters; on another C library the mode is reported as not
    applied. Process-wide and one-way: call once at start-up.
    """
    check_choice("device.host_malloc", mode, HOST_MALLOC)
    if mode == "auto":
        mode = "retain" if device.type == "cpu" else "system"
    if mode == "system":
        return "system (glibc defaults)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "system (retain needs glibc; this C library is not)"
    import ctypes

    libc = ctypes.CDLL(None)
    if libc.mallopt(_M_MMAP_MAX, 0) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, -1) != 1:
        return "system (glibc refused mallopt)"
    return "retain (glibc mallopt: no mmap for large blocks, no trim; freed memory is reused)"


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


# ---------------------------------------------------------------------------------------------
# The CPU matmul probe: the CPU's peak per dtype (for MFU) and the `auto` compute dtype.
#
# Which dtype is faster on a CPU is a property of the machine, not of the architecture: an Intel
# Xeon with AVX512-BF16 but no AMX runs bf16 GEMMs at about half its fp32 rate (oneDNN converts),
# an AMD EPYC (Zen 4/5) runs them ~4.5x faster than fp32. So it is measured, once per machine.

PROBE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
COMPUTE_DTYPES = (*PROBE_DTYPES, "auto")
"""`[training] mixed_precision_param` choices (`resolve_compute_dtype`)."""
PROBE_SIZE = 2048
_PROBE_REPEATS = 3
_PROBE_NATIVE_S = 4.0  # a 2048³ product predicted faster than this is timed at 2048 (`probe_size`)
_PROBE_BUDGET_S = 0.5  # else: the longest one timed product of a slow dtype may take
_PROBES: dict[int, dict[str, float]] = {}  # this process: thread count -> {dtype name: FLOP/s}
_PROBE_SOURCES: dict[str, str] = {}  # this process: cache key -> where its numbers came from (the banner's words)
# A GEMM of 2048^3 keeps every torch thread busy, so the best timed run's process CPU time is
# about threads x wall (measured ~0.95-1.0 on an idle machine). Another job on the same cores
# time-slices with it: one busy competitor on each core halves the share. Below this share the
# measurement reflects the load as well as the CPU. It is cached all the same, so that the `auto`
# dtype is decided once per machine and configuration (a re-measure on every start-up of a loaded
# machine picked bf16 one run and fp32 the next), marked as measured under load, and the start-up
# line says so and how to measure again.
BUSY_SHARE = 0.75


def probe_size(dtype: torch.dtype) -> int:
    """The matmul size the probe times `dtype` at: `PROBE_SIZE`, or smaller where the dtype is so
    slow here that a 2048³ product would take more than `_PROBE_NATIVE_S` (the smaller size then
    keeps one product under `_PROBE_BUDGET_S`).

    A dtype the CPU has no instructions for runs at a fraction of the other's rate (bf16 on an
    AVX2-only AMD EPYC: 0.15 GFLOP/s against fp32's 33, where one 2048³ product takes ~2 min and the
    probe ~6). A 256³ pilot (34 MFLOP: ~0.2 s at that rate) predicts each size's time; the largest
    that fits the budget is timed. Smaller products run somewhat below the peak, which cannot change
    the choice between two dtypes that far apart.
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=gen).to(dtype)
    torch.mm(a, a)  # kernel selection
    start = time.perf_counter()
    torch.mm(a, a)
    rate = 2.0 * 256**3 / max(time.perf_counter() - start, 1e-9)
    if 2.0 * PROBE_SIZE**3 / rate <= _PROBE_NATIVE_S:
        return PROBE_SIZE
    for size in (1024, 512):
        if 2.0 * size**3 / rate <= _PROBE_BUDGET_S:
            return size
    return 256


def measure_matmul(
    dtype: torch.dtype, *, size: int | None = None, repeats: int = _PROBE_REPEATS
) -> tuple[float, float]:
    """(TFLOP/s, CPU share) of a size x size x size matmul in `dtype` on this process's torch threads.

    `size` defaults to `probe_size(dtype)` (2048 unless the dtype is emulated slowly). One untimed
    warm-up (allocation, oneDNN kernel selection), then the best of `repeats` timed runs: the best,
    not the median, because on a shared machine interference only ever slows a run down. The CPU
    share is the best run's process CPU time / (wall x threads) (`BUSY_SHARE`). About 1 s per
    dtype on one core.
    """
    size = probe_size(dtype) if size is None else size
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    start = time.perf_counter()
    torch.mm(a, b)
    warmup = time.perf_counter() - start
    best, share = float("inf"), 1.0
    # A slow machine (a dtype emulated at 1/10 speed) still gets two timed runs but not more.
    for _ in range(repeats if warmup < 0.5 else 2):
        start, cpu_start = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if wall < best:
            best, share = wall, cpu / (wall * torch.get_num_threads())
    return 2.0 * size**3 / best / 1e12, share


def probe_cache_path() -> Path:
    """$TITAN_CACHE (default ~/.cache/titan-tpu) / cpu_matmul_probe.json."""
    return Path(os.path.expanduser(os.environ.get("TITAN_CACHE", "~/.cache/titan-tpu"))) / "cpu_matmul_probe.json"


def probe_cache_key(threads: int | None = None) -> str:
    """What the probe's result depends on: the CPU model, torch's version and the thread count."""
    threads = torch.get_num_threads() if threads is None else threads
    return f"{cpu_model()} | torch {torch.__version__} | {threads} thread(s)"


def _read_probe_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # absent, or cut short: measure again
        return {}


def _under_load(share: float) -> str:
    return (
        f" under load (this process had {share:.0%} of its {torch.get_num_threads()} thread(s)' cores: "
        "the rates understate the CPU)"
    )


def _measure_or_read(key: str) -> dict[str, float]:
    """{dtype name: FLOP/s} for `key` from the cache file, else measured and written to it, even
    on a busy machine (`BUSY_SHARE`: the choice is made once; the entry records the CPU share).
    Where the numbers came from is kept for the start-up line (`probe_source`)."""
    path = probe_cache_path()
    entry = _read_probe_file(path).get(key)
    redo = "delete it to measure again"
    if isinstance(entry, dict) and all(isinstance(entry.get(n), (int, float)) and entry[n] > 0 for n in PROBE_DTYPES):
        share = entry.get("cpu_share")
        load = _under_load(share) if isinstance(share, (int, float)) and share < BUSY_SHARE else ""
        _PROBE_SOURCES[key] = f"measured {entry.get('measured_at', 'earlier')}{load}, cached in {path}; {redo}"
        return {n: float(entry[n]) for n in PROBE_DTYPES}
    peaks, shares = {}, []
    sizes = {}
    for name, dtype in PROBE_DTYPES.items():
        sizes[name] = probe_size(dtype)
        tflops, share = measure_matmul(dtype, size=sizes[name])
        peaks[name] = tflops * 1e12
        shares.append(share)
    share = min(shares)
    load = _under_load(share) if share < BUSY_SHARE else ""
    try:  # re-read: another job may have written other keys meanwhile; write atomically
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_probe_file(path)
        data[key] = {
            **peaks,
            "sizes": sizes,
            "cpu_share": round(share, 3),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        with atomic_file(path, what="CPU matmul probe cache", mode="w") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
        _PROBE_SOURCES[key] = f"measured now{load}, cached in {path}; {redo}"
    except (OSError, WriteFailed) as e:  # a read-only home: the probe still serves this process
        _PROBE_SOURCES[key] = f"measured now{load}, not cached ({path}: {e}): the next run measures again"
    return peaks


def probe_source(threads: int | None = None) -> str:
    """Where this process's probe numbers came from (measured now or when, under load or not, the
    cache file and how to measure again), for the start-up line; "" when this process holds none
    (a rank other than 0 under a process group: rank 0 measures or reads)."""
    return _PROBE_SOURCES.get(probe_cache_key(threads), "")


def cpu_matmul_peaks() -> dict[str, float]:
    """{"bfloat16": FLOP/s, "float32": FLOP/s} of this CPU at this process's thread count.

    Read from the probe cache (`probe_cache_path()`, keyed by `probe_cache_key()`), measured and
    written there on a miss (on a busy machine too, marked so: the `auto` dtype is decided once).
    Under a process group of several ranks this is a collective: rank 0 reads or measures, and
    broadcasts, so every rank has the same numbers (and the same `auto` dtype) and the ranks sharing
    a machine do not time each other's matmuls. Delete the file to measure again (e.g. after a probe
    on a busy machine: the start-up line says when one was).
    """
    import torch.distributed as dist

    threads = torch.get_num_threads()
    group = distributed.multi_rank()
    # Under a group every rank joins the broadcast on every call (a rank never skips it because
    # of its own process cache: thread ranks share one); only rank 0's numbers are cached.
    if not group or dist.get_rank() == 0:
        if threads not in _PROBES:
            _PROBES[threads] = _measure_or_read(probe_cache_key(threads))
        peaks = _PROBES[threads]
    if group:
        buf = torch.tensor(
            [peaks[n] for n in PROBE_DTYPES] if dist.get_rank() == 0 else [0.0] * len(PROBE_DTYPES), dtype=torch.float64
        )
        dist.broadcast(buf, src=0)
        peaks = dict(zip(PROBE_DTYPES, buf.tolist()))
    return dict(peaks)


@dataclass(frozen=True)
class ComputeDtype:
    """The resolved `[training] mixed_precision_param`."""

    name: str
    """bfloat16 | float32."""
    reason: str
    """One line for the banner: what was chosen and why."""

    @property
    def dtype(self) -> torch.dtype:
        return PROBE_DTYPES[self.name]


def resolve_compute_dtype(name: str, device: torch.device | str) -> ComputeDtype:
    """`mixed_precision_param` -> the dtype this run computes in, on `device` (or a device type).

    bfloat16 / float32: as given. auto: bfloat16 on TPU and GPU (their matmul units are built
    for it); on the CPU the faster of the two by `cpu_matmul_peaks()` (a collective under a
    process group: call it on every rank at the same point, after `init_distributed`).
    """
    if name in PROBE_DTYPES:
        return ComputeDtype(name, "set in the recipe")
    assert name == "auto", name  # the config validates the choices
    device_type = device if isinstance(device, str) else device.type
    if device_type != "cpu":
        return ComputeDtype("bfloat16", f"auto: bfloat16 on {device_type}")
    peaks = cpu_matmul_peaks()
    best = max(peaks, key=peaks.get)
    other = min(peaks, key=peaks.get)
    source = probe_source() or f"rank 0's probe, cached in {probe_cache_path()}"
    return ComputeDtype(
        best,
        f"auto: {best} matmul {peaks[best] / 1e9:.0f} GFLOP/s vs {other} "
        f"{peaks[other] / 1e9:.0f} on this CPU (probe {PROBE_SIZE}³, {torch.get_num_threads()} "
        f"thread(s); {source})",
    )


def torch_dtype(name: str) -> torch.dtype:
    """A concrete dtype name (bfloat16 | float32) -> torch dtype; `auto` must have been resolved
    first (`resolve_compute_dtype`, once per run, before the model is built)."""
    assert name != "auto", "resolve mixed_precision_param = auto before building the model"
    return PROBE_DTYPES[name]


def global_mean(t: torch.Tensor) -> float:
    """Mean of a per-rank scalar over all ranks (TP replicas hold equal values); a host sync."""
    t = t.detach().float().reshape(1).clone()
    if distributed.multi_rank():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def gather_objects():
    """`gather(obj) -> [every rank's obj]` over a gloo group made here (a collective: call it on
    every rank), or None in a single process. The LM loader gathers every rank's data-shard
    positions into the checkpointed state with it."""
    if not distributed.multi_rank():
        return None
    group = dist.new_group(backend=cpu_backend())

    def gather(obj: object) -> list:
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather
