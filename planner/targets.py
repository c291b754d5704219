"""Accelerator generations and targets: what a device is, its HBM and its peak.

`parse_target("v6e-256")` names a slice: generation + size. For TPUs the size counts
TensorCores, as Cloud TPU accelerator types do (`v5p-1024` = 512 chips; `v7x-1024` = 512
chips). A device (one training process, one mesh rank) is a TensorCore on v5e, v6e and v7x
(two per v7x chip) and a whole megacore chip on v4 and v5p. For GPUs the size counts GPUs.
HBM per device comes from `GENERATIONS`, the peak from `trainer/runtime/flops.py`.

Several slices (multislice, joined over the data-center network): `v6e-256x2` is two v6e-256
slices; `devices` and `chips` count the whole job, `slice_devices` one slice. `DCN_GBPS_PER_CHIP`
holds each generation's published DCN bandwidth (planner/multislice.py prices the cross-slice
gradient all-reduce with it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from models.errors import ConfigError

# trainer/runtime/flops.py imports only torch and the standard library: the one table of peaks that
# the trainer's MFU uses, so the planner's step time is measured against the same numbers.
from trainer.runtime.flops import GPU_PEAK_TFLOPS, TPU_PEAK_TFLOPS

GiB = 2**30


@dataclass(frozen=True)
class Generation:
    """One accelerator generation: what a device is and how much memory it has."""

    name: str
    kind: str
    """"tpu" or "gpu"."""
    cores_per_chip: int
    """TensorCores per chip (what a TPU slice name counts); 1 for GPUs."""
    cores_per_device: int
    """TensorCores one device (process) drives: 2 on megacore chips (v4, v5p), else 1."""
    hbm_gib_per_device: float
    """HBM one device can use, GiB."""
    devices_per_host: int
    """Devices on one host (VM): the largest tensor-parallel degree `recommend` tries."""
    fsdp_min_tokens: int | None
    """Tokens per micro-batch per device above which FSDP's weight all-gathers hide behind
    compute (MaxText's ICI arithmetic-intensity thresholds); None where no published figure."""
    source: str

    @property
    def peak_tflops(self) -> float:
        """Dense bf16 peak per device, from trainer/runtime/flops.py (the one source of peaks)."""
        if self.kind == "tpu":
            return TPU_PEAK_TFLOPS[self.name]
        return dict(GPU_PEAK_TFLOPS)[self.name]


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v4", "tpu", 2, 2, 32.0, 4, None, "Cloud TPU v4: 32 GiB HBM2 per chip, megacore"),
        Generation("v5e", "tpu", 1, 1, 16.0, 4, None, "Cloud TPU v5e: 16 GiB HBM2 per chip"),
        Generation("v5p", "tpu", 2, 2, 95.0, 4, 2550, "Cloud TPU v5p: 95 GiB HBM2e per chip, megacore"),
        Generation("v6e", "tpu", 1, 1, 32.0, 4, 5100, "Cloud TPU v6e: 32 GiB HBM per chip"),
        Generation(
            "v7x", "tpu", 2, 1, 96.0, 8, 12800, "Cloud TPU7x: 192 GiB HBM per chip, 2 devices (TensorCores) per chip"
        ),
        # GPUs: the capacity CUDA reports for the 80 GB / 141 GB parts; B200's vendor 180 GB
        # is taken as 10^9 bytes (not checked on a device).
        Generation("h100", "gpu", 1, 1, 79.1, 8, None, "NVIDIA H100 SXM 80 GB"),
        Generation("h200", "gpu", 1, 1, 139.8, 8, None, "NVIDIA H200 SXM 141 GB"),
        Generation("b200", "gpu", 1, 1, 180e9 / GiB, 8, None, "NVIDIA B200 180 GB"),
    )
}
_ALIASES = {"tpu7x": "v7x", "v5litepod": "v5e"}

DCN_GBPS_PER_CHIP: dict[str, float] = {"v5e": 25.0, "v5p": 50.0, "v6e": 100.0, "v7x": 100.0}
"""Data-center network (DCN) bandwidth per chip, Gbit/s, as Google publishes it: "Data center
network (DCN) bandwidth per chip (Gb/s)" 50 / 100 / 100 for v5p / v6e / TPU7x (Cloud TPU TPU7x
page's comparison table; the v5p page also prints 50); v5e: "Data center network bandwidth per
Pod" 6.4 Tbps over its 256 chips (Cloud TPU v6e page's v5e column; the v6e column's 25.6 Tbps /
256 = 100 agrees with the per-chip figure, and its "4 x 200 Gbps NICs per host" is the 8-chip
host's). v4: no published figure (None: no DCN term)."""


@dataclass(frozen=True)
class Target:
    """A slice or cluster: `generation` x `devices`."""

    name: str
    generation: Generation
    devices: int
    """Devices of the whole job (every slice)."""
    chips: int
    num_slices: int = 1
    """Slices joined over the DCN (`v6e-256x2`: 2)."""

    @property
    def size(self) -> int:
        """What the name counts, per slice: TensorCores for a TPU, GPUs for a GPU cluster."""
        return int(self.name.split("-")[-1].split("x")[0])

    @property
    def slice_devices(self) -> int:
        return self.devices // self.num_slices

    @property
    def hosts_per_slice(self) -> int:
        return max(self.slice_devices // self.generation.devices_per_host, 1)

    @property
    def dcn_bytes_per_s_per_host(self) -> float | None:
        """A host's DCN bandwidth, bytes/s (its chips' `DCN_GBPS_PER_CHIP`); None when unpublished."""
        gbps = DCN_GBPS_PER_CHIP.get(self.generation.name)
        if gbps is None:
            return None
        chips_per_host = (
            self.generation.devices_per_host * self.generation.cores_per_device // self.generation.cores_per_chip
        )
        return gbps * 1e9 / 8 * chips_per_host

    @property
    def hbm_bytes(self) -> int:
        return int(self.generation.hbm_gib_per_device * GiB)

    @property
    def peak_flops(self) -> float:
        return self.generation.peak_tflops * 1e12

    @property
    def device_type(self) -> str:
        """The torch device type a run on this target has: tpu, or cuda for a GPU cluster."""
        return "tpu" if self.generation.kind == "tpu" else "cuda"


def parse_target(name: str, *, key: str = "--target") -> Target:
    """`v6e-256`, `v5p-1024`, `v7x-512` (also `tpu7x-512`), `v5litepod-64`, `h100-64`, ...; several
    TPU slices: `v6e-256x2`, `v7x-1024x4` (slice size x slice count).

    `key` is what a refusal names: the flag, or `job.target` when the name came from a recipe."""
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)(?:x(\d+))?", name.strip().lower())
    allowed = (
        f"allowed: <generation>-<size>[x<slices>] with generation one of {', '.join(GENERATIONS)}, "
        "e.g. v6e-256 or v6e-256x2"
    )
    if not m:
        raise ConfigError(f"{key}: {name!r} is not a target name; {allowed}")
    gen_name, size = _ALIASES.get(m.group(1), m.group(1)), int(m.group(2))
    slices = int(m.group(3)) if m.group(3) else 1
    if slices < 1 or (slices > 1 and GENERATIONS.get(gen_name, GENERATIONS["v6e"]).kind != "tpu"):
        raise ConfigError(f"{key}: {name}: the slice count must be >= 1, and only TPU targets have slices; {allowed}")
    if gen_name not in GENERATIONS:
        raise ConfigError(f"{key}: unknown generation {m.group(1)!r}; {allowed}")
    gen = GENERATIONS[gen_name]
    if size < 1 or size % gen.cores_per_device or size % gen.cores_per_chip:
        raise ConfigError(
            f"{key}: {name}: the size counts {'TensorCores' if gen.kind == 'tpu' else 'GPUs'} and must be a "
            f"positive multiple of {max(gen.cores_per_chip, gen.cores_per_device)} for {gen_name}; allowed: "
            f"multiples of {max(gen.cores_per_chip, gen.cores_per_device)}, e.g. {gen_name}-"
            f"{8 * max(gen.cores_per_chip, gen.cores_per_device)}"
        )
    return Target(
        name=f"{gen_name}-{size}" + (f"x{slices}" if slices > 1 else ""),
        generation=gen,
        devices=slices * size // gen.cores_per_device,
        chips=slices * size // gen.cores_per_chip,
        num_slices=slices,
    )
