"""Where torch-tpu puts each mesh axis on a TPU slice, computed here without torch-tpu.

On a TPU, `build_mesh` orders the ranks with `torch.tpu.distributed.topology_aware_mesh`, which
runs torch-tpu's copy of JAX's `mesh_utils.create_device_mesh`
(`torch_tpu/_internal/distributed/device_utils.py`). That function places each logical mesh
axis, innermost (`tp`) first, on a product of WHOLE physical axes of the slice (`x`, `y`, `z`,
and on v7x the two TensorCores of a chip, `core`) and raises `NotImplementedError` when an axis
size is no such product, unless it is called with `allow_split_physical_axes=True`; then an axis
may take a factor of a physical axis: a run of consecutive chips along it, a segment of the ring
without its wraparound link. Small slices (4, 8 or 16 chips, v7x up to 32 devices) skip all this
and take a fixed ring order of their tray.

This module re-implements those rules (written from reading torch-tpu 0.2.0's source, not copied)
so the trainer, the planner and the recipe check can answer before any process group exists:
- `topology_of(target)`: the physical topology of a planner target (`v6e-256` -> 16x16 chips);
- `assign(topology, shape, allow_split=...)`: torch-tpu's result for one setting, as a
  `MeshMapping` (per axis: the physical axes or the segment it gets, whether its ring wraps,
  and the device order), or `UnmappableAxis` (a ConfigError naming the key, axis and topology);
- `map_mesh(topology, shape)`: what the trainer does: whole axes if they map, else split axes.
Device ids are numbered as JAX numbers a slice's devices: core fastest, then x, y, z.
tests/xla/test_tpu_topology_ttpu.py checks the port against torch-tpu's own function.

Wraparound: torch-tpu does not know it (libtpu reads it from the platform); the rules below are
Cloud TPU's documented ones: v4, v5p and (taken to be the same, cube-built) v7x slices of 4x4x4
chips and more are 3-D tori; a v5e/v6e pod (16x16) is a 2-D torus, and an axis of a smaller
v5e/v6e slice is taken to wrap only when it spans the pod's full 16 chips.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np

from models.errors import ConfigError

# The world mesh's axes, outermost first (parallelisms/parallel_dims.py MESH_AXES), their short
# names in summaries and the config keys they come from (tests check both against parallel_dims).
MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
SHORT = {"dp_replicate": "dp_rep", "dp_shard": "fsdp", "cp": "cp", "tp": "tp"}
KEYS = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
}
PHYSICAL_AXES = ("x", "y", "z", "core")

# Chip grids (x, y, z) by device count, per generation: the slices scripts/estimate_xla.py compiles
# for, plus the larger documented v4/v5p shapes and their v7x counterparts. A device is a chip on
# v4/v5p (megacore) and v5e/v6e, a TensorCore on v7x (two per chip).
_2D = {
    1: (1, 1, 1),
    4: (2, 2, 1),
    8: (2, 4, 1),
    16: (4, 4, 1),
    32: (4, 8, 1),
    64: (8, 8, 1),
    128: (8, 16, 1),
    256: (16, 16, 1),
}
_3D = {
    4: (2, 2, 1),
    8: (2, 2, 2),
    16: (2, 2, 4),
    32: (2, 4, 4),
    64: (4, 4, 4),
    128: (4, 4, 8),
    256: (4, 8, 8),
    512: (8, 8, 8),
    1024: (8, 8, 16),
    2048: (8, 16, 16),
    4096: (16, 16, 16),
}
GRIDS: dict[str, dict[int, tuple[int, int, int]]] = {
    "v5e": _2D,
    "v6e": _2D,
    "v4": _3D,
    "v5p": _3D,
    "v7x": {2 * chips: grid for chips, grid in _3D.items()},
}
DEVICES_PER_CHIP = {"v4": 1, "v5e": 1, "v5p": 1, "v6e": 1, "v7x": 2}
# A TPU target's name counts TensorCores; a megacore chip's two cores are one device
# (planner/targets.py `cores_per_device`; tests/unit/test_tpu_topology.py checks the two agree).
CORES_PER_DEVICE = {"v4": 2, "v5p": 2}
# PJRT `device_kind` of each generation: torch-tpu picks its small-slice handlers by it.
DEVICE_KIND = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite", "v7x": "TPU7x"}


def _wraps(generation: str, chips: tuple[int, int, int]) -> tuple[bool, ...]:
    """Per chip axis: does it close into a ring (module docstring: the documented rules)."""
    if generation in ("v5e", "v6e"):
        return tuple(n == 16 for n in chips)
    torus = all(n % 4 == 0 for n in chips)
    return tuple(torus and n > 1 for n in chips)


@dataclass(frozen=True)
class Topology:
    """A single TPU slice as torch-tpu sees it: chips along x, y, z, and devices per chip."""

    generation: str
    chips: tuple[int, int, int]
    devices_per_chip: int = 1
    target: str = ""
    """The planner target it came from (e.g. v6e-256), for messages."""

    @property
    def device_kind(self) -> str:
        return DEVICE_KIND[self.generation]

    @property
    def physical_shape(self) -> tuple[int, ...]:
        """The shape torch-tpu arranges the devices in: (x, y, z), plus (core,) on v7x."""
        return self.chips + ((self.devices_per_chip,) if self.devices_per_chip > 1 else ())

    @property
    def wrap(self) -> tuple[bool, ...]:
        """Per physical axis: a ring with wraparound (the two cores of a v7x chip: one link, counted as a ring)."""
        return _wraps(self.generation, self.chips) + ((True,) if self.devices_per_chip > 1 else ())

    @property
    def devices(self) -> int:
        return math.prod(self.physical_shape)

    def __str__(self) -> str:
        grid = "x".join(
            map(str, self.chips if self.chips[2] > 1 or self.generation not in ("v5e", "v6e") else self.chips[:2])
        )
        cores = f" x {self.devices_per_chip} cores" if self.devices_per_chip > 1 else ""
        tori = [name for name, w, n in zip(PHYSICAL_AXES, self.wrap, self.chips) if w and n > 1]
        ring = f"wraparound on {'/'.join(tori)}" if tori else "no wraparound"
        return f"{self.target or self.generation} ({grid} chips{cores}, {ring})"


def topology_of(target) -> Topology | None:
    """The slice of a planner `Target` (or target name); None for a GPU target or a TPU size
    without a known single-slice grid (the mapping cannot be checked then)."""
    if isinstance(target, str):  # the planner's names, read here (parallelisms sits below the planner)
        gen, _, size = target.partition("-")
        if gen not in GRIDS or not size.isdigit():
            return None
        name, devices = target, int(size) // CORES_PER_DEVICE.get(gen, 1)
    else:
        if getattr(target, "num_slices", 1) > 1:  # several slices: no one grid (the DCN joins them)
            return None
        gen, name, devices = target.generation.name, target.name, target.devices
    grid = GRIDS.get(gen, {}).get(devices)
    if grid is None:
        return None
    return Topology(generation=gen, chips=grid, devices_per_chip=DEVICES_PER_CHIP[gen], target=name)


def topology_from_env(generation: str | None, env: dict) -> Topology | None:
    """The slice a TPU run is on, from the `TORCH_TPU_TOPOLOGY` torch-tpu's launcher sets
    ("x,y,z" chips, plus ",2" cores on v7x); None when unset or unknown. On a multi-host slice the
    variable describes one host (torch-tpu's design), so callers compare its device count with the
    world size before trusting it."""
    raw = env.get("TORCH_TPU_TOPOLOGY", "")
    if not raw or generation not in DEVICE_KIND:
        return None
    try:
        dims = tuple(int(v) for v in raw.split(","))
    except ValueError:
        return None
    if len(dims) not in (3, 4) or any(d < 1 for d in dims):
        return None
    per_chip = dims[3] if len(dims) == 4 else DEVICES_PER_CHIP[generation]
    return Topology(
        generation=generation, chips=dims[:3], devices_per_chip=per_chip, target=f"{generation} slice {raw}"
    )


# --- the mapping --------------------------------------------------------------------------------


class UnmappableAxis(ConfigError):
    """A logical axis torch-tpu cannot place on the slice (with the current split setting)."""

    def __init__(self, message: str, *, axis: str, size: int, split: bool):
        super().__init__(message)
        self.axis, self.size, self.split = axis, size, split


@dataclass(frozen=True)
class AxisPlacement:
    """Where one logical axis lies: `parts` = (physical axis, count, stride) per physical axis it
    uses: `count` devices along it, `stride` apart (1: consecutive)."""

    name: str
    size: int
    parts: tuple[tuple[int, int, int], ...]
    wrap: bool | None
    """Its ring closes (every part spans its whole physical axis, which wraps); None for size 1
    or a tray ring order."""
    split: bool
    """It takes only a factor of some physical axis."""

    def describe(self, topology: Topology) -> str:
        shape = topology.physical_shape
        pieces = []
        for p, count, stride in self.parts:
            name = PHYSICAL_AXES[p] if p < 3 else "core"
            if count == shape[p]:
                pieces.append(name)
            elif stride == 1:
                pieces.append(f"{name}[:{count}]")
            elif count * stride == shape[p]:
                pieces.append(f"{name}[::{stride}]")
            else:
                pieces.append(f"{name}[:{count * stride}:{stride}]")
        where = "*".join(pieces) or "-"
        tags = []
        if self.split:
            tags.append("split")
        if self.wrap is False and self.size > 2:
            tags.append("no wraparound")
        return f"{SHORT.get(self.name, self.name)} {self.size} <- {where}" + (f" ({', '.join(tags)})" if tags else "")


@dataclass(frozen=True)
class MeshMapping:
    """torch-tpu's layout of one mesh shape on one slice."""

    topology: Topology
    shape: tuple[int, ...]
    method: str
    """"whole axes", "split axes" (needs allow_split_physical_axes=True) or "tray ring" (small
    slices: a fixed ring order of the devices, whatever the shape)."""
    axes: tuple[AxisPlacement, ...]
    device_ids: tuple
    """Device ids (module docstring) in `shape`, as nested tuples."""
    expert_tile: tuple[int, int, int] | None = None
    """Chips (x, y, z) of each EP group when the trainer reordered dp_shard into compact groups
    (`compact_expert_groups`); None: torch-tpu's order."""

    @property
    def split(self) -> bool:
        """torch-tpu needs `allow_split_physical_axes=True` for this shape."""
        return self.method == "split axes"

    def summary(self) -> str:
        """One line, e.g. `fsdp 64 <- x[::4]*y, cp 4 <- x[:4] (split, no wraparound)`."""
        if self.method == "tray ring":
            used = [f"{SHORT.get(a.name, a.name)} {a.size}" for a in self.axes if a.size > 1]
            return f"{' x '.join(used) or '1'} <- tray ring order of {self.topology.devices} devices"
        text = ", ".join(a.describe(self.topology) for a in self.axes if a.size > 1) or "1"
        if self.expert_tile is not None:
            text += f"; EP groups reordered into {'x'.join(map(str, self.expert_tile))}-chip blocks"
        return text

    def banner(self) -> list[str]:
        """The start-up banner's lines: the layout, then what each split axis costs."""
        how = "needs allow_split_physical_axes=True" if self.split else self.method
        return [f"titan-tpu: mesh on {self.topology}: {self.summary()} (torch-tpu's layout: {how})"] + [
            f"titan-tpu: mesh: {line}" for line in self.notes()
        ]

    def notes(self) -> list[str]:
        """What each split axis costs, one line per axis (empty when nothing is split)."""
        out = []
        phys = self.topology.physical_shape
        for a in self.axes:
            if not a.split or a.size < 2:
                continue
            pieces = []
            for p, count, stride in a.parts:
                name, n = PHYSICAL_AXES[p], phys[p]
                if count == n:
                    pieces.append(f"all {n} along {name}")
                elif stride == 1:
                    pieces.append(
                        f"{count} consecutive of the {n} along {name}: a ring segment without wraparound, "
                        f"whose closing step crosses {count - 1} links"
                    )
                else:
                    closes = (
                        "closing through the wraparound"
                        if count * stride == n and self.topology.wrap[p]
                        else "without wraparound"
                    )
                    pieces.append(
                        f"every {stride}th of the {n} along {name} ({count} of them, {closes}; each hop "
                        f"crosses {stride} links shared with the inner axes)"
                    )
            out.append(
                f"{KEYS.get(a.name, a.name)} = {a.size} splits a physical axis of {self.topology}: "
                f"{'; '.join(pieces)} (torch-tpu's topology_aware_mesh with allow_split_physical_axes=True)"
            )
        return out


def _physical_ids(topology: Topology) -> np.ndarray:
    """Device ids laid out as torch-tpu's physical mesh (x, y, z[, core])."""
    x, y, z = topology.chips
    c = topology.devices_per_chip
    ids = np.arange(topology.devices).reshape(z, y, x, c)  # id = ((z*Y + y)*X + x)*C + core
    ids = ids.transpose(2, 1, 0, 3)
    return ids if c > 1 else ids[..., 0]


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


def _tray_ring(topology: Topology, shape: tuple[int, ...]) -> list[int] | None:
    """The fixed order torch-tpu's per-generation handlers give small slices, else None."""
    x, y, z = topology.chips
    n, gen = topology.devices, topology.generation
    if gen in ("v5e", "v6e"):
        if (x, y, z) == (2, 2, 1):
            return [0, 1, 3, 2]
        if n == 8:
            return [0, 4, 2, 6, 1, 5, 3, 7] if (x, y, z) == (2, 2, 2) else [0, 1, 2, 3, 7, 6, 5, 4]
        if (x, y, z) == (4, 4, 1) and max(shape) == 16:
            return [0, 1, 2, 3, 7, 6, 5, 9, 10, 11, 15, 14, 13, 12, 8, 4]
    if gen == "v5p" and (x, y, z) == (2, 2, 2):
        return [0, 1, 3, 2, 6, 7, 5, 4]
    if gen == "v7x" and n % 8 == 0 and n <= 32 and x <= 2 and y <= 2:
        return [i + j for i in range(0, n, 8) for j in (0, 1, 2, 3, 6, 7, 4, 5)]
    return None


def _whole_axes(phys: tuple[int, ...], shape: tuple[int, ...], names, topology) -> np.ndarray:
    """Each logical axis on a product of whole physical axes, innermost axis first; the subset
    with the most axes wins, then the first in combination order (as torch-tpu does)."""
    free = list(phys)
    assignment = np.ones((len(phys), len(shape)), dtype=np.int64)
    taken: set[int] = set()
    for i in reversed(range(len(shape))):
        size = shape[i]
        chosen = None
        for k in range(len(phys), 0, -1):
            for subset in itertools.combinations(range(len(phys)), k):
                if math.prod(free[p] for p in subset) == size:
                    chosen = subset
                    break
            if chosen:
                break
        if chosen is None:
            if size > 1:
                left = [v for v in free]
                sizes = sorted(
                    {
                        math.prod(s)
                        for k in range(1, len(phys) + 1)
                        for s in itertools.combinations([v for v in left if v > 1], k)
                    }
                    | {1}
                )
                raise UnmappableAxis(
                    f"{KEYS[names[i]]}: {names[i]} = {size} is not a product of whole physical axes of "
                    f"{topology} (left after the inner axes: {_free_text(left)}); torch-tpu's "
                    f"topology_aware_mesh maps each mesh axis onto whole axes unless allowed to split "
                    f"one; allowed without a split: {', '.join(map(str, sizes))}",
                    axis=names[i],
                    size=size,
                    split=False,
                )
            continue
        for p in chosen:
            assignment[p, i] = phys[p]
            free[p] = 0
            taken.add(p)
    if len(taken) != len(phys):
        # torch-tpu transposes by the assigned axes only; an axis nobody took fails there.
        left = [PHYSICAL_AXES[p] for p in range(len(phys)) if p not in taken]
        raise UnmappableAxis(
            f"parallelism: the mesh {tuple(shape)} leaves physical axis {'/'.join(left)} of {topology} "
            f"to no mesh axis (torch-tpu's whole-axes layout then fails); allowed: degrees that together "
            f"use every physical axis",
            axis=names[0],
            size=shape[0],
            split=False,
        )
    return assignment


def _free_text(free: list[int]) -> str:
    return "x".join(str(v if v else "-") for v in free)


def _split_axes(phys: tuple[int, ...], shape: tuple[int, ...], names, topology) -> np.ndarray:
    """Each logical axis on prime factors of the physical axes left, innermost first, ranked as
    torch-tpu ranks candidates: most devices on whole axes, then most whole axes, then most
    devices on axes already used by inner axes, then the larger tuple."""
    assignment = np.ones((len(phys), len(shape)), dtype=np.int64)
    for i in reversed(range(len(shape))):
        size = shape[i]
        used = assignment.prod(axis=1)
        avail = [phys[p] // int(used[p]) for p in range(len(phys))]
        need: dict[int, int] = {}
        for f in _prime_factors(size):
            need[f] = need.get(f, 0) + 1
        choices = []
        for f, mult in need.items():
            slots = [p for p in range(len(phys)) for g in _prime_factors(avail[p]) if g == f]
            choices.append(sorted(set(itertools.combinations(slots, mult))))
        best = None
        for combo in itertools.product(*choices):
            cand = [1] * len(phys)
            for (f, _), picked in zip(need.items(), combo):
                for p in picked:
                    cand[p] *= f
            if best is None or _better(cand, best, phys, used):
                best = cand
        if best is None:
            raise UnmappableAxis(
                f"{KEYS[names[i]]}: {names[i]} = {size} does not fit the devices left on {topology} "
                f"after the inner axes ({_free_text(avail)}), even splitting physical axes; allowed: "
                f"a size made of the factors left ({math.prod(avail)} devices)",
                axis=names[i],
                size=size,
                split=True,
            )
        assignment[:, i] = best
    return assignment


def _better(a: list[int], b: list[int], phys, used) -> bool:
    def whole(c):
        return math.prod(s for s, n in zip(c, phys) if s == n)

    def n_whole(c):
        return sum(1 for s, n in zip(c, phys) if s == n and s > 1)

    def overlap(c):
        return math.prod(s for s, u in zip(c, used) if u > 1)

    for key in (whole, n_whole, overlap):
        if key(a) != key(b):
            return key(a) > key(b)
    return tuple(a) > tuple(b)


def _layout(ids: np.ndarray, assignment: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Device ids in `shape`: each physical axis split into its per-logical-axis factors (the
    innermost logical axis fastest), regrouped by logical axis."""
    n_p, n_l = assignment.shape
    split = ids.reshape([int(v) for v in assignment.reshape(-1)])
    order = sorted(range(n_p * n_l), key=lambda k: (k % n_l, k // n_l))
    return split.transpose(order).reshape(shape)


def _placements(topology: Topology, assignment: np.ndarray, names) -> tuple[AxisPlacement, ...]:
    phys, wrap = topology.physical_shape, topology.wrap
    out = []
    for i, name in enumerate(names):
        parts = []
        for p in range(len(phys)):
            count = int(assignment[p, i])
            if count > 1:
                parts.append((p, count, int(assignment[p, i + 1 :].prod())))
        size = math.prod(c for _, c, _ in parts)
        ring = None if not parts else all(c * s == phys[p] and wrap[p] for p, c, s in parts)
        split = any(c < phys[p] for p, c, _ in parts)
        out.append(AxisPlacement(name=name, size=size, parts=tuple(parts), wrap=ring, split=split))
    return tuple(out)


def _nested(a: np.ndarray):
    return tuple(_nested(x) for x in a) if a.ndim else int(a)


def assign(topology: Topology, shape, *, allow_split: bool, names=MESH_AXES) -> MeshMapping:
    """torch-tpu's `create_device_mesh(shape, allow_split_physical_axes=allow_split)` on `topology`;
    `UnmappableAxis` where torch-tpu raises."""
    shape = tuple(int(s) for s in shape)
    assert len(names) == len(shape), (names, shape)
    if math.prod(shape) != topology.devices:
        raise ConfigError(
            f"parallelism: the mesh {shape} has {math.prod(shape)} devices but {topology} has "
            f"{topology.devices}; allowed: degrees whose product is {topology.devices}"
        )
    ring = _tray_ring(topology, shape)
    if ring is not None:
        ids = np.asarray(ring).reshape(shape)
        axes = tuple(AxisPlacement(name=n, size=s, parts=(), wrap=None, split=False) for n, s in zip(names, shape))
        return MeshMapping(topology=topology, shape=shape, method="tray ring", axes=axes, device_ids=_nested(ids))
    phys = topology.physical_shape
    try:
        assignment = _whole_axes(phys, shape, names, topology)
        method = "whole axes"
    except UnmappableAxis as e:
        if not allow_split or e.split or "leaves physical axis" in str(e):
            raise
        assignment = _split_axes(phys, shape, names, topology)
        method = "split axes"
    ids = _layout(_physical_ids(topology), assignment, shape)
    return MeshMapping(
        topology=topology,
        shape=shape,
        method=method,
        axes=_placements(topology, assignment, names),
        device_ids=_nested(ids),
    )


def map_mesh(topology: Topology, shape, *, names=MESH_AXES) -> MeshMapping:
    """What the trainer builds: torch-tpu's whole-axes layout when it exists, else the split one
    (`build_mesh` then passes allow_split_physical_axes=True); ConfigError when neither maps."""
    return assign(topology, shape, allow_split=True, names=names)


# ------------------------------------------------------------------ compact expert-parallel groups
#
# An EP group is `ep` consecutive ranks of the flattened dp_shard x cp x tp axis
# (parallel_dims.build_ep_mesh). torch-tpu lays dp_shard out core fastest, then x, y, z, so on a
# large slice a group is a run of chips along one ring (EP 8 on v6e-256: 8 chips of a 16-chip row,
# a line without its wraparound, 3.0 hops on average, one torus dimension). Its all-to-all crosses
# the fewest links and uses the most of them when the group is a block (2 x 4 on a 2-D torus,
# 2 x 2 x 2 on a 3-D one). `compact_expert_groups` reorders the dp_shard axis into such blocks; every
# other axis group (the dp_shard all-gathers over the whole slice) holds the same devices as before.


def _line_hops(n: int) -> float:
    """Mean hops between two of n chips in a line (no wraparound)."""
    return (n * n - 1) / (3 * n) if n > 1 else 0.0


def _a2a_axis_load(t: int, *, ring: bool, per_chip: int) -> float:
    """Bytes the busiest link along one chip axis of an EP block carries, one direction, per byte of
    each device's buffer, when every block runs its all-to-all at once (dimension-ordered routes,
    as tools/xla_projection.py `all_to_all_load`). A line of t chips: the middle cut, crossed by
    floor(t/2) x ceil(t/2) of its chip pairs, p^2 / n of the buffer each: floor(t/2) ceil(t/2) p / t.
    A whole wrapped axis (a ring): each chip's traffic goes the shortest way round, a tie split
    between the two, so a link carries p / t x (1 + 2 + ... + (ceil(t/2) - 1) + [t even] t / 4)."""
    if t <= 1:
        return 0.0
    if ring:
        return per_chip / t * (sum(range(1, (t + 1) // 2)) + (t / 4 if t % 2 == 0 else 0))
    return (t // 2) * ((t + 1) // 2) * per_chip / t


def expert_tile(topology: Topology, ep: int) -> tuple[int, int, int] | None:
    """Chips (x, y, z) of one compact EP group of `ep` devices on `topology` (the cores of a chip in
    the same group): the block whose all-to-all loads its busiest link the least (`_a2a_axis_load`:
    a tile axis that is a whole wrapped torus axis is a ring, any other a line), then the fewest mean
    hops per torus dimension it spans. None when no block of whole chips holds exactly ep devices.
    (Mean hops alone took a 2 x 2 x 4 block for EP 32 on v7x-512, whose 4-chip line's middle link
    carries 2.0 buffers, where 4 x 2 x 2, round the wrapped 4, carries 1.0.)"""
    per_chip = topology.devices_per_chip
    if ep <= 1 or ep % per_chip:
        return None
    chips = ep // per_chip
    X, Y, Z = topology.chips
    wrap = topology.wrap[:3]
    best, best_cost = None, None
    for tx in (d for d in range(1, X + 1) if X % d == 0):
        for ty in (d for d in range(1, Y + 1) if Y % d == 0):
            if chips % (tx * ty):
                continue
            tz = chips // (tx * ty)
            if Z % tz:
                continue
            tile = (tx, ty, tz)
            load = max(
                _a2a_axis_load(t, ring=t == n and w, per_chip=per_chip) for t, n, w in zip(tile, (X, Y, Z), wrap)
            )
            dims = sum(1 for t in tile if t > 1) or 1
            cost = (load, sum(_line_hops(t) for t in tile) / dims, max(tile))
            if best_cost is None or cost < best_cost:
                best, best_cost = tile, cost
    return best


def compact_expert_groups(mapping: MeshMapping, ep: int) -> MeshMapping | None:
    """`mapping` with the dp_shard axis reordered so that each EP group (ep consecutive dp_shard
    ranks) is a block of `expert_tile` chips, blocks in x, y, z order; None where it does not
    apply: ep 1, an axis other than dp_shard larger than 1, dp_shard not the whole slice, a tray
    ring slice, or no block of whole chips of ep devices."""
    topology, shape = mapping.topology, mapping.shape
    tile = expert_tile(topology, ep)
    if (
        tile is None
        or mapping.method == "tray ring"
        or len(shape) != len(MESH_AXES)
        or shape[MESH_AXES.index("dp_shard")] != topology.devices
        or math.prod(shape) != topology.devices
        or tile == topology.chips
    ):
        return None
    X, Y, Z = topology.chips
    tx, ty, tz = tile
    per_chip = topology.devices_per_chip
    order = [
        ((z0 + z) * Y + (y0 + y)) * X * per_chip + (x0 + x) * per_chip + core
        for z0 in range(0, Z, tz)
        for y0 in range(0, Y, ty)
        for x0 in range(0, X, tx)
        for z in range(tz)
        for y in range(ty)
        for x in range(tx)
        for core in range(per_chip)
    ]
    return dataclasses.replace(mapping, device_ids=_nested(np.asarray(order).reshape(shape)), expert_tile=tile)


def expert_group_permutation(mapping: MeshMapping, ep: int) -> list[int] | None:
    """Positions of the flattened mesh such that `flat[perm]` turns torch-tpu's layout (`mapping`)
    into `compact_expert_groups(mapping, ep)`; None where that does not apply. The trainer applies
    it to torch-tpu's rank grid (parallel_dims.build_mesh), which `mapping` ports."""
    compact = compact_expert_groups(mapping, ep)
    if compact is None:
        return None
    where = {int(d): i for i, d in enumerate(np.asarray(mapping.device_ids).reshape(-1))}
    return [where[int(d)] for d in np.asarray(compact.device_ids).reshape(-1)]


def trainer_layout(topology: Topology, shape, *, ep: int = 1) -> MeshMapping:
    """The trainer's mesh on `topology`: torch-tpu's layout (`map_mesh`) with compact EP groups
    where `compact_expert_groups` applies."""
    mapping = map_mesh(topology, shape)
    return compact_expert_groups(mapping, ep) or mapping


# ---------------------------------------------------------------- which device a launcher rank drives
#
# One process per device: the launcher gives host h's processes ranks h x devices-per-host + local,
# torch-tpu's launcher numbers the hosts by their physical position (NODE_RANK from the hosts'
# coordinates, z-major as JAX's mesh_utils sorts them, x fastest) and a host's local processes take
# its devices in order (core fastest, then x, y, z of the host's block of chips). So on a slice
# of several hosts launcher rank r is not device id r (ids run x-fastest over the whole slice).

HOST_CHIPS = {"v4": (2, 2, 1), "v5p": (2, 2, 1), "v5e": (2, 2, 1), "v6e": (2, 2, 1), "v7x": (2, 2, 1)}
"""Chips (x, y, z) one host of a multi-host slice holds; a slice of at most SINGLE_HOST_CHIPS chips
is one host."""
SINGLE_HOST_CHIPS = {"v4": 4, "v5p": 4, "v5e": 8, "v6e": 8, "v7x": 4}


def host_chips(topology: Topology) -> tuple[int, int, int]:
    """The block of chips one host of `topology` holds."""
    if math.prod(topology.chips) <= SINGLE_HOST_CHIPS[topology.generation]:
        return topology.chips
    return HOST_CHIPS[topology.generation]


def launcher_device_ids(topology: Topology) -> list[int]:
    """Entry r: the device id (module docstring's numbering) launcher rank r drives, hosts in
    torch-tpu's topological order (z-major, x fastest) and each host's processes over its devices
    core fastest, then x, y, z. A permutation of range(devices); the identity on one host."""
    bx, by, bz = host_chips(topology)
    X, Y, Z = topology.chips
    per_chip = topology.devices_per_chip
    ids = []
    for hz in range(Z // bz):
        for hy in range(Y // by):
            for hx in range(X // bx):
                for z in range(bz):
                    for y in range(by):
                        for x in range(bx):
                            chip = ((hz * bz + z) * Y + (hy * by + y)) * X + (hx * bx + x)
                            ids.extend(chip * per_chip + core for core in range(per_chip))
    return ids
