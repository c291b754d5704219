"""Step-time bound of a compiled per-device XLA:TPU program: compute + the collectives it holds.

Plain text in, numbers out; no jax, no torch. Parsing the HLO and the compute cost of its ops are
tools/xla_hlo.py (its names importable here too); this module prices the collectives and bounds the
step. The input is the optimized HLO text of one
per-device program (the `*.after_optimizations.txt` that `XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text` writes for a deviceless compile, or jax's `compiled.as_text()`).

    hlo = parse_hlo(text)
    ops = compute_ops(hlo)              # per executed op: FLOPs, HBM bytes, times it runs
    colls = collectives(hlo)            # per collective: kind, bytes, group size, mesh axes, times it runs
    proj = project(compute=..., collectives=..., ...)  # step time both ways, MFU bound both ways
    sched = scheduled(hlo, colls=..., seconds=..., ...)  # one step time: the program walked in XLA's
                                                         # schedule (tools/xla_schedule.py)

What is counted (docs/benchmarks.md, "Projections"):
- Executed ops are the instructions of ENTRY, of `while` bodies (times the loop's
  `known_trip_count`: XLA's own cost analysis counts a loop body once), and of computations
  run by `call`, `conditional` (every branch, once) and `async-start`. A fusion is one op: its
  FLOPs are the dots and convolutions inside it (2 per multiply-add), its HBM bytes its operands
  and results outside on-chip memory (layouts marked `S(n)`, n > 0, are VMEM/SMEM and not
  counted). Op time = max(FLOPs / peak, bytes / HBM bandwidth); compute time = the sum.
- Mosaic (Pallas) custom calls: the `cost_estimate` their kernel attached (megablox gmm/tgmm)
  where the HLO carries one; the others are counted as `kernel_calls_without_estimate` and the
  caller adds their FLOPs and bytes from its own model (titan_kernels/tpu/capture.py).
- Collectives: all-gather, reduce-scatter (also XLA:TPU's `all-reduce-scatter` fusions: an
  all-reduce whose result is sliced), all-reduce, all-to-all, collective-permute, sync or
  async (`*-start`). Bytes per device: the gathered result of an all-gather, the unscattered
  operand of a reduce-scatter, the buffer of an all-reduce / all-to-all / permute. Replica groups
  (explicit `{{..}}`, iota `[G,S]<=[..]`, or `mesh[...] {axes}`) map to the compile's logical
  mesh axes.

Time of a collective on a ring of n devices along an axis whose per-device ICI bandwidth is B
(both directions of every link the axis spans, `axis_bandwidth`): all-gather and reduce-scatter
(n-1)/n * bytes / B, all-reduce twice that, all-to-all (n-1)/n * bytes * hops / B (hops: the mean
distance on the axis's torus, a quarter of each dim's length: n/4 on one ring),
collective-permute bytes / one link direction (ring permutes in opposite directions run at once:
per axis the larger direction's sum). Where the program's placement on the torus is known
(`comm_on_placement`), an all-to-all takes instead the busiest link's bytes over one link direction
(`all_to_all_load`: every group at once, routes dimension-ordered, a ring only where the group
spans a wrapped chip axis, a line otherwise). Ideal rings at the links' rated bandwidth: a lower bound on the time, so the MFU that follows is an
upper bound.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from tools.xla_hlo import (  # noqa: F401  (the HLO reader's names, read through this module)
    COLLECTIVES,
    Computation,
    Hlo,
    Instr,
    Op,
    _has_collective,
    _names,
    _operand_shape,
    _tuple_parts,
    array_bytes,
    array_dims,
    compute_ops,
    compute_time,
    cost_estimate,
    dot_flops,
    executed,
    fusion_bytes,
    infer_trip_count,
    op_source,
    parse_hlo,
    trip_count,
    window_taps,
)

ANCHORS = Path(__file__).resolve().parents[1] / "assets" / "anchors.toml"

# ------------------------------------------------------------------------------ collectives


def parse_groups(ins: Instr, n_devices: int) -> tuple[list[list[int]] | None, list[str] | None]:
    """(explicit device groups, or None) and (mesh axis names from the `mesh[...]` form, or None)."""
    raw = ins.attr("replica_groups")
    if raw is None and "replica_groups=mesh[" in ins.attrs:
        raw = ""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", ins.attrs)
    if m:
        axes = re.findall(r"'([^']+)'", m.group(2))
        return None, axes
    if raw is None or raw in ("{}", ""):
        if ins.opcode.startswith("collective-permute"):
            return None, None
        return [list(range(n_devices))], None
    if raw.startswith("["):  # iota form: [G,S]<=[dims]T(perm)
        m = re.match(
            r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", ins.attrs[ins.attrs.index("replica_groups=") + 15 :]
        )
        if not m:
            return None, None
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else list(range(len(dims)))
        ids = _iota_transposed(dims, perm)
        size = shape[-1]
        return [ids[i : i + size] for i in range(0, len(ids), size)], None
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", raw[1:-1])], None


def _iota_transposed(dims: list[int], perm: list[int]) -> list[int]:
    """Flattened iota(prod dims) reshaped to dims and transposed by perm."""
    n = math.prod(dims)
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    tdims = [dims[p] for p in perm]
    out = []
    for flat in range(n):
        idx, rem = [], flat
        for d in reversed(tdims):
            idx.append(rem % d)
            rem //= d
        idx.reverse()
        src = [0] * len(dims)
        for k, p in enumerate(perm):
            src[p] = idx[k]
        out.append(sum(s * i for s, i in zip(strides, src)))
    return out


def axes_of_group(group: list[int], mesh: dict[str, int]) -> list[str]:
    """The logical mesh axes (device ids row-major over `mesh`, the first axis outermost) along
    which the devices of `group` differ."""
    names, sizes = list(mesh), list(mesh.values())
    coords = []
    for d in group:
        c = []
        for s in reversed(sizes):
            c.append(d % s)
            d //= s
        coords.append(list(reversed(c)))
    return [names[k] for k in range(len(names)) if len({c[k] for c in coords}) > 1]


@dataclass
class Collective:
    name: str
    kind: str  # all-gather | reduce-scatter | all-reduce | all-to-all | collective-permute
    bytes: float  # per device, see the module docstring
    group_size: int
    axes: tuple[str, ...]
    times: float
    direction: int = 0  # collective-permute: +1 / -1 when every pair sends to the next / previous device


def collectives(hlo: Hlo, mesh: dict[str, int]) -> list[Collective]:
    """Every collective the program runs, with its bytes per device and the mesh axes of its
    groups (`mesh`: the compile's logical mesh, axis name -> size, first axis outermost)."""
    n_devices = math.prod(mesh.values())
    mesh_names = list(mesh)
    out = []
    runs = {c.name: t for c, t in executed(hlo)}
    # computations a fusion op runs (the collectives XLA:TPU wraps in fusions) run as often as it
    for comp, times in list(executed(hlo)):
        for ins in comp.instrs:
            if ins.opcode == "fusion":
                for c in _names(ins.attr("calls")):
                    if c.startswith("all-reduce-scatter") or _has_collective(hlo, c):
                        runs[c] = runs.get(c, 0.0) + times
    for name, times in runs.items():
        comp = hlo.computations[name]
        for ins in comp.instrs:
            base = ins.opcode.removesuffix("-start")
            if base not in COLLECTIVES or ins.opcode.endswith("-done"):
                continue
            groups, axis_names = parse_groups(ins, n_devices)
            if base.startswith("collective-permute"):
                pairs = re.findall(r"\{(\d+),(\d+)\}", ins.attr("source_target_pairs") or "")
                groups = [[int(a), int(b)] for a, b in pairs] or None
            if axis_names is not None:
                axes = tuple(
                    mesh_names[int(a.split("_")[1])]
                    if re.fullmatch(r"axis_\d+", a) and int(a.split("_")[1]) < len(mesh_names)
                    else a
                    for a in axis_names
                )
                size = (
                    math.prod(mesh.get(a, 1) for a in axes)
                    if all(a in mesh for a in axes)
                    else _mesh_sizes(ins).get(axis_names[0], n_devices)
                )
            elif groups:
                found = sorted({a for g in groups for a in axes_of_group(g, mesh)}, key=mesh_names.index)
                axes = tuple(found) or ("?",)
                size = len(groups[0])
            else:
                axes, size = ("?",), n_devices
            shape = ins.shape
            if ins.opcode.endswith("-start") and shape.startswith("("):
                # async start: (operands, results[, scratch]): the result part is the second element
                parts = _tuple_parts(shape)
                shape = parts[1] if len(parts) > 1 else shape
            kind = base
            nbytes = array_bytes(shape)
            if base == "reduce-scatter":
                nbytes *= size
            elif base == "all-reduce" and comp.name.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"  # an all-reduce whose result the fusion slices: bytes = operand
            elif base == "ragged-all-to-all":
                # (operand, output, offsets and sizes): one of the two buffers is the worst-case
                # receive buffer; what moves is at most the smaller (the rows actually sent)
                kind = "all-to-all"
                bufs = [array_bytes(_operand_shape(comp, o)) for o in ins.operands[:2]]
                nbytes = min([nbytes, *[b for b in bufs if b]])
            direction = 0
            if base.startswith("collective-permute") and groups:
                steps = {(t - src) % n_devices for src, t in groups}
                direction = 1 if steps == {1} else -1 if steps == {n_devices - 1} else 0
            out.append(Collective(ins.name, kind, nbytes, size, axes, times, direction))
    return out


def _mesh_sizes(ins: Instr) -> dict[str, int]:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]", ins.attrs)
    return {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))} if m else {}


# ------------------------------------------------------------------------------ bandwidth and time


def load_ici(path: Path = ANCHORS) -> dict:
    """The `[ici]` table of assets/anchors.toml: per generation, per-chip bidirectional ICI GB/s,
    ports per chip, torus dims, and the source."""
    with open(path, "rb") as f:
        return tomllib.load(f)["ici"]


def link_bytes_per_s(ici: dict) -> float:
    """One direction of one ICI link: the chip's bidirectional bandwidth over its ports, halved."""
    return ici["chip_bidirectional_gbps"] * 1e9 / ici["ports"] / 2


def axis_bandwidth(ici: dict, torus_dims_spanned: int) -> float:
    """Per-device bytes/s a ring collective gets on an axis laid over `torus_dims_spanned` dims of
    the torus (with wraparound): both directions of both neighbours' links in each dim."""
    return 2 * torus_dims_spanned * link_bytes_per_s(ici)


def mean_hops(n: int, torus_dims_spanned: int, devices_per_chip: int = 1) -> float:
    """Mean hop distance between two of n devices on a torus of `torus_dims_spanned` equal dims
    with wraparound (each dim contributes a quarter of its length)."""
    chips = max(n / devices_per_chip, 1.0)
    side = chips ** (1.0 / max(torus_dims_spanned, 1))
    return max(torus_dims_spanned * side / 4, 1.0)


def collective_time(
    c: Collective, bandwidth: float, link: float, n: int | None = None, hops: float | None = None
) -> float:
    """Seconds of one run of `c` on n devices (default its group size): a ring for all-gather,
    reduce-scatter, all-reduce; all-to-all: every byte but the own share travels `hops` links
    (default n / 4, a bidirectional ring); collective-permute: one hop."""
    n = n or c.group_size
    if n <= 1:
        return 0.0
    ring = (n - 1) / n
    if c.kind in ("all-gather", "reduce-scatter"):
        return ring * c.bytes / bandwidth
    if c.kind == "all-reduce":
        return 2 * ring * c.bytes / bandwidth
    if c.kind == "all-to-all":
        return ring * c.bytes * (n / 4 if hops is None else hops) / bandwidth
    return c.bytes / link  # collective-permute: one hop


def comm_by_axis(
    colls: list[Collective], *, ici: dict, axis_dims: dict[str, int], axis_size: dict[str, int] | None = None
) -> dict[str, float]:
    """Seconds per step of the collectives, per mesh axis (axes joined by '+' when a group spans
    several). axis_dims: torus dims each logical axis spans at the target; axis_size: the axis
    size at the target (for the (n-1)/n factor and all-to-all's hops; default the compiled group
    size)."""
    out: dict[str, float] = {}
    link = link_bytes_per_s(ici)
    # Ring permutes (XLA:TPU's windowed-einsum loops pass shards to a neighbour) in the two
    # directions use the two directions of the links: they can run at once, so per axis the
    # permute time is the larger direction's, not the sum.
    ring: dict[str, list[float]] = {}
    for c in colls:
        key = "+".join(c.axes)
        if c.kind == "collective-permute" and c.direction:
            ring.setdefault(key, [0.0, 0.0])[c.direction > 0] += c.times * c.bytes / link
            continue
        dims = min(sum(axis_dims.get(a, 1) for a in c.axes), ici["torus_dims"])
        n = None
        if axis_size and all(a in axis_size for a in c.axes):
            n = math.prod(axis_size[a] for a in c.axes)
        hops = mean_hops(n or c.group_size, dims, ici.get("devices_per_chip", 1))
        out[key] = out.get(key, 0.0) + c.times * collective_time(c, axis_bandwidth(ici, dims), link, n, hops)
    for key, (back, fwd) in ring.items():
        out[key] = out.get(key, 0.0) + max(back, fwd)
    return out


# ------------------------------------------------------------------------------ placement on the torus


@dataclass
class Placement:
    """Where a compiled program's mesh sits on its slice: the mesh's axis sizes (`a0`, `a1`, ...,
    outermost first, as tools/tpu_compile.py names them) and each device's chip coordinates and
    core, row-major over the mesh (tpu_compile's `device_coords`, or `placement_of` for a layout
    that was not compiled)."""

    radices: list[int]
    coords: list[tuple[int, ...]]
    chips: tuple[int, int, int]
    wrap: tuple[bool, bool, bool]
    _facts: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def mesh(self) -> dict[str, int]:
        return {f"a{i}": r for i, r in enumerate(self.radices)}

    def _members(self, axes: tuple[str, ...], base: int = 0) -> list[int]:
        idx = {int(a[1:]) for a in axes if re.fullmatch(r"a\d+", a)}
        strides = [math.prod(self.radices[i + 1 :]) for i in range(len(self.radices))]
        members = [base]
        for i in sorted(idx):
            members = [m + d * strides[i] for m in members for d in range(self.radices[i])]
        return members

    def group(self, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Coordinates of the group that holds device 0 and spans `axes` (names a0, a1, ...)."""
        return [tuple(self.coords[m]) for m in self._members(axes)]

    def groups(self, axes: tuple[str, ...]) -> list[list[tuple[int, ...]]]:
        """Coordinates of every group of a collective over `axes`: one per index of the other axes."""
        seen: set[int] = set()
        out = []
        for base in range(len(self.coords)):
            if base in seen:
                continue
            members = self._members(axes, base)
            seen.update(members)
            out.append([tuple(self.coords[m]) for m in members])
        return out

    def facts(self, axes: tuple[str, ...]) -> dict:
        """n, torus_dims (chip axes the group spans), mean_hops (chip-to-chip links between two
        distinct members, shortest way round each ring, averaged over ordered pairs), per_chip
        (the group's devices on one chip: they share its links). Kept per axes: the walk of a
        schedule asks once per collective."""
        if axes not in self._facts:
            self._facts[axes] = group_facts(self.group(axes), self.chips, self.wrap)
        return self._facts[axes]

    def a2a_load(self, axes: tuple[str, ...]) -> float:
        """`all_to_all_load` of all the groups of a collective over `axes` at once (kept per axes;
        routed only for an all-to-all: its cost grows with the square of the group's chips)."""
        key = ("a2a", *axes)
        if key not in self._facts:
            self._facts[key] = all_to_all_load(self.groups(axes), self.chips, self.wrap)
        return self._facts[key]


def group_facts(coords: list[tuple[int, ...]], chips: tuple[int, int, int], wrap: tuple[bool, ...]) -> dict:
    """See `Placement.facts`. The mean of a sum is the sum of the means, so the mean Manhattan
    distance is summed per chip axis from the histogram of the members' coordinates on it."""
    n = len(coords)
    dims = [k for k in range(3) if len({c[k] for c in coords}) > 1]
    hops = 0.0
    if n > 1:
        for k in dims:
            hist: dict[int, int] = {}
            for c in coords:
                hist[c[k]] = hist.get(c[k], 0) + 1
            length = chips[k]
            total = 0.0
            for a, na in hist.items():
                for b, nb in hist.items():
                    d = abs(a - b)
                    if wrap[k]:
                        d = min(d, length - d)
                    total += na * nb * d
            hops += total / (n * (n - 1))
    per_chip = max(
        (sum(1 for c in coords if c[:3] == chip) for chip in {c[:3] for c in coords}),
        default=1,
    )
    return {"n": n, "torus_dims": len(dims), "mean_hops": hops, "per_chip": per_chip}


def all_to_all_load(groups: list[list[tuple[int, ...]]], chips: tuple[int, int, int], wrap: tuple[bool, ...]) -> float:
    """The bytes the busiest link carries, one direction, per byte of each device's buffer, when
    every group runs one all-to-all at once (each device sends 1/n of its buffer to each of the
    group's n devices). Routes are dimension-ordered (chip axis x, then y, then z), each leg the
    shortest way: round the ring where the slice wraps on that axis (a tie split between the two
    ways), along the line where it does not. So a group that spans a whole wrapped axis uses both
    neighbour links on it, one inside a block of it (the 2x2x2-chip EP block of a 4x8x8 torus) only
    the block's own links: its busiest link is the middle of each line. Devices on one chip are 0
    hops apart (the die-to-die link is not modelled) and share the chip's links.
    One all-to-all of `bytes` per device then takes at least load x bytes / one link direction."""
    load: dict[tuple, float] = {}
    for g in groups:
        n = len(g)
        per_chip: dict[tuple[int, ...], int] = {}
        for c in g:
            per_chip[c[:3]] = per_chip.get(c[:3], 0) + 1
        for a, na in per_chip.items():
            for b, nb in per_chip.items():
                if a == b:
                    continue
                w = na * nb / n
                pos = list(a)
                for k in range(3):
                    if pos[k] != b[k]:
                        _route(load, k, pos, b[k], w, chips[k], wrap[k])
                        pos[k] = b[k]
    return max(load.values(), default=0.0)


def _route(load: dict, k: int, pos: list[int], dest: int, w: float, length: int, wraps: bool) -> None:
    """Add `w` to each directed link of chip axis k from pos[k] to `dest` (the rest of pos fixed)."""
    if wraps:
        fwd = (dest - pos[k]) % length
        back = length - fwd
        ways = [(1, fwd)] if fwd < back else [(-1, back)] if back < fwd else [(1, fwd), (-1, back)]
    else:
        ways = [(1, dest - pos[k])] if dest > pos[k] else [(-1, pos[k] - dest)]
    share = w / len(ways)
    for step, hops in ways:
        at = pos[k]
        for _ in range(hops):
            key = (k, *pos[:k], *pos[k + 1 : 3], at, step)
            load[key] = load.get(key, 0.0) + share
            at = (at + step) % length


def placement_of(topology, mesh_shape, radices: list[int], ep: int = 1) -> Placement:
    """The placement the trainer's mesh `mesh_shape` gets on `topology` (a
    parallelisms.tpu_topology.Topology: the trainer's layout, `trainer_layout`, torch-tpu's with
    compact EP groups), refined row-major into the program's axes `radices`: what
    tools/tpu_compile.py compiles over, without compiling."""
    from parallelisms.tpu_topology import trainer_layout

    x_size, y_size, _ = topology.chips
    per_chip = topology.devices_per_chip
    ids = list(_flat(trainer_layout(topology, tuple(mesh_shape), ep=ep).device_ids))

    def coords(dev: int) -> tuple[int, ...]:
        core, chip = dev % per_chip, dev // per_chip
        return (chip % x_size, chip // x_size % y_size, chip // (x_size * y_size), core)

    return Placement(
        radices=list(radices), coords=[coords(d) for d in ids], chips=topology.chips, wrap=topology.wrap[:3]
    )


def _flat(nested):
    if isinstance(nested, (tuple, list)):
        for x in nested:
            yield from _flat(x)
    else:
        yield nested


def comm_on_placement(colls: list[Collective], *, ici: dict, placement: Placement) -> dict[str, float]:
    """Seconds per step of the collectives per mesh axis (joined by '+'), each priced on the
    torus where `placement` puts its group: ring collectives at the bandwidth of the chip axes the
    group spans (`axis_bandwidth`; a group inside one chip gets one axis's, the die-to-die link
    not being modelled as faster); all-to-all: the busiest link's bytes over one link direction
    (`all_to_all_load`, all the collective's groups at once: a ring only where the group spans a
    wrapped chip axis, otherwise a line); ring permutes as in `comm_by_axis`."""
    out: dict[str, float] = {}
    link = link_bytes_per_s(ici)
    ring: dict[str, list[float]] = {}
    cache: dict[tuple, dict] = {}
    for c in colls:
        key = "+".join(c.axes)
        if c.kind == "collective-permute" and c.direction:
            ring.setdefault(key, [0.0, 0.0])[c.direction > 0] += c.times * c.bytes / link
            continue
        if c.axes not in cache:
            cache[c.axes] = placement.facts(c.axes)
        f = cache[c.axes]
        if f["n"] <= 1 and all(re.fullmatch(r"a\d+", a) for a in c.axes):
            continue  # a group of one device at this placement (a mesh axis of size 1): no traffic
        n = f["n"] if f["n"] > 1 else c.group_size
        bandwidth = axis_bandwidth(ici, max(f["torus_dims"], 1))
        if c.kind == "all-to-all":
            t = placement.a2a_load(c.axes) * c.bytes / link if n > 1 else 0.0
        else:
            t = collective_time(c, bandwidth, link, n)
        out[key] = out.get(key, 0.0) + c.times * t
    for key, (back, fwd) in ring.items():
        out[key] = out.get(key, 0.0) + max(back, fwd)
    return out


def bound(*, compute_s: float, comm_s: float, model_flops: float, peak_flops: float) -> dict:
    """Step time and MFU both ways: fully exposed (compute + comm) and perfectly overlapped
    (max(compute, comm)). compute_s is floored at model_flops / peak, so neither MFU exceeds 100 %."""
    compute_s = max(compute_s, model_flops / peak_flops)
    exposed, overlapped = compute_s + comm_s, max(compute_s, comm_s)
    return {
        "compute_s": compute_s,
        "comm_s": comm_s,
        "step_exposed_s": exposed,
        "step_overlapped_s": overlapped,
        "mfu_exposed_pct": 100.0 * model_flops / (peak_flops * exposed),
        "mfu_overlapped_pct": 100.0 * model_flops / (peak_flops * overlapped),
    }


def summarize(text: str, *, mesh: dict[str, int]) -> dict:
    """One program's counts: ops, collectives, while loops without a known trip count."""
    hlo = parse_hlo(text)
    ops = compute_ops(hlo)
    colls = collectives(hlo, mesh)
    unknown: list[str] = []
    executed(hlo, unknown=unknown)
    return {"ops": ops, "collectives": colls, "unknown_trips": unknown}


# ------------------------------------------------------------------------------ the schedule followed

HOST_LINK_GBPS_PER_CHIP = {"v5e": 15.0, "v5p": 15.0, "v6e": 32.0, "v7x": 32.0}
"""GB/s between a chip and its host, one direction (PCIe is full duplex: device-to-host and
host-to-device are two resources). jax-ml/scaling-book `tpus.md` (04d8de5): "PCIe bandwidth is
typically around 1.5e10 bytes / second per chip", footnote "Trillium (TPU v6e) has 32GB/s, about 2x
higher than v5"; the Cloud TPU v6e page: "connects to the host through a PCIe Gen5 interface" (a Gen5
x8 link is 31.5 GB/s a direction: the 32 GB/s read as one direction). TPU7x: no figure published; v6e's
assumed (per chip: its two devices share it)."""


MXU_EFFICIENCY = 0.66
"""The share of the bf16 peak a matmul (an XLA dot fusion, a Pallas kernel's FLOPs) runs at in the
scheduled prediction: the one constant fitted on MaxText's five published runs
(docs/maxtext_calibration.md, "The prediction")."""


def host_link_bytes_per_s(gen: str, ici: dict) -> float:
    """One direction of the host link per device (a chip's link shared by its devices)."""
    return HOST_LINK_GBPS_PER_CHIP.get(gen, 15.0) * 1e9 / ici.get("devices_per_chip", 1)


def host_transfer(hlo: Hlo, comp: Computation, ins: Instr) -> tuple[str, float] | None:
    """('d2h' | 'h2d', bytes) when `ins` moves data between HBM and host memory (memory space
    S(5)): an async `copy-start` (either way), a `dynamic-update-slice` into a host buffer (the
    update's bytes, device to host), a `dynamic-slice` of one (the slice, host to device), a fusion
    or async computation that holds them (XLA:TPU wraps the offload's slices so)."""
    if ins.opcode == "copy-start" and ins.operands:
        src = _operand_shape(comp, ins.operands[0])
        # (destination, source, context): the destination's layout says where the copy goes
        dst = _tuple_parts(ins.shape)[0] if ins.shape.startswith("(") else ins.shape
        if "S(5)" in dst and "S(5)" not in src:
            return "d2h", array_bytes(src)
        if "S(5)" in src and "S(5)" not in dst:
            return "h2d", array_bytes(dst)
        return None
    if ins.opcode == "dynamic-update-slice" and "S(5)" in ins.shape and len(ins.operands) > 1:
        return "d2h", array_bytes(_operand_shape(comp, ins.operands[1]))
    if ins.opcode == "dynamic-slice" and ins.operands and "S(5)" in _operand_shape(comp, ins.operands[0]):
        return "h2d", array_bytes(ins.shape)
    if ins.opcode in ("fusion", "async-start", "call", "custom-call"):
        called = _names(ins.attr("calls")) + _names(ins.attr("to_apply")) + _names(ins.attr("called_computations"))
        found: dict[str, float] = {}
        for c in called:
            inner = hlo.computations.get(c)
            for sub in inner.instrs if inner is not None else []:
                t = host_transfer(hlo, inner, sub)
                if t is not None:
                    found[t[0]] = found.get(t[0], 0.0) + t[1]
        if found:
            way = max(found, key=found.get)
            return way, sum(found.values())
    return None


def op_seconds(ops: list[Op], *, peak_flops: float, hbm_bytes_per_s: float) -> dict[str, float]:
    """Seconds of one run of each op (by instruction name): its roofline."""
    return {o.name: max(o.flops / peak_flops, o.bytes / hbm_bytes_per_s) for o in ops}


def _collectives_by_computation(hlo: Hlo, by_name: dict[str, Collective]) -> dict[str, list[Collective]]:
    """The collectives of `by_name` grouped by the computation that holds them."""
    by_comp: dict[str, list[Collective]] = {}
    for comp in hlo.computations.values():
        for ins in comp.instrs:
            if ins.name in by_name:
                by_comp.setdefault(comp.name, []).append(by_name[ins.name])
    return by_comp


def _inner_collectives(
    hlo: Hlo, by_comp: dict[str, list[Collective]], ins: Instr, seen: set | None = None
) -> list[Collective]:
    """The collectives of the computations `ins` runs, however nested (an async computation
    calling a computation that holds the all-reduce, a fusion wrapping one)."""
    seen = set() if seen is None else seen
    out: list[Collective] = []
    for c in _names(ins.attr("calls")) + _names(ins.attr("called_computations")) + _names(ins.attr("to_apply")):
        if c in seen:
            continue
        seen.add(c)
        out += by_comp.get(c, [])
        comp = hlo.computations.get(c)
        for sub in comp.instrs if comp is not None else []:
            if sub.opcode in ("fusion", "call", "async-start", "custom-call"):
                out += _inner_collectives(hlo, by_comp, sub, seen)
    return out


def _inner_seconds(hlo: Hlo, seconds: dict[str, float], ins: Instr, seen: set) -> float:
    """The compute seconds of the computations `ins` calls (and of the calls and async starts in them)."""
    total = 0.0
    for c in _names(ins.attr("calls")) + _names(ins.attr("to_apply")):
        comp = hlo.computations.get(c)
        if comp is None or c in seen:
            continue
        seen.add(c)
        for sub in comp.instrs:
            total += seconds.get(sub.name, 0.0)
            if sub.opcode in ("call", "async-start"):
                total += _inner_seconds(hlo, seconds, sub, seen)
    return total


def scheduled(
    hlo: Hlo,
    *,
    colls: list[Collective],
    ici: dict,
    placement: Placement,
    seconds: dict[str, float],
    host_bytes_per_s: float,
    price=None,
):
    """The step walked in XLA's schedule (tools/xla_schedule.py): compute ops at `seconds` (by
    instruction name), each collective on its mesh axes' links (`ici:<axes>`) at its
    `comm_on_placement` time, host transfers on the host link (`host:d2h`, `host:h2d`) at
    `host_bytes_per_s`. `price(collective)`: seconds of one run of a collective, in place of
    `comm_on_placement` (a program compiled on a small slice priced at its target's axis sizes).
    Returns the `Schedule`."""
    from tools.xla_schedule import Cost, simulate

    by_name = {c.name: c for c in colls}
    by_comp = _collectives_by_computation(hlo, by_name)
    priced: dict[str, float] = {}

    def coll_seconds(c: Collective) -> float:
        if c.name not in priced:
            one = Collective(c.name, c.kind, c.bytes, c.group_size, c.axes, 1.0, c.direction)
            priced[c.name] = (
                price(one)
                if price is not None
                else sum(comm_on_placement([one], ici=ici, placement=placement).values())
            )
        return priced[c.name]

    def cost(comp: Computation, ins: Instr) -> Cost | None:
        if ins.name in by_name:
            c = by_name[ins.name]
            return Cost(resource="ici:" + "+".join(c.axes), seconds=coll_seconds(c))
        host = host_transfer(hlo, comp, ins)
        if host is not None:
            return Cost(resource=f"host:{host[0]}", seconds=host[1] / host_bytes_per_s)
        s = seconds.get(ins.name, 0.0)
        if ins.opcode == "async-start":
            # the compute ops of the async computation (and of what it calls) on the compute clock
            s += _inner_seconds(hlo, seconds, ins, set())
        if ins.opcode in ("fusion", "async-start", "custom-call", "call"):
            inner = _inner_collectives(hlo, by_comp, ins)
            if inner:
                return Cost(
                    compute=s,
                    resource="ici:" + "+".join(inner[0].axes),
                    seconds=sum(coll_seconds(c) for c in inner),
                )
        return Cost(compute=s) if s else None

    return simulate(hlo, cost)
