"""Which process takes which place in the mesh: the one rule every parallelism shards by.

The invariant (docs/parallelism.md, "Device order"). A rank's shard along a mesh axis is its
rank in that axis's process group, and the mesh is built so that this rank equals its
DeviceMesh coordinate on every axis, flattened and split ones included (dp, dp_shard_cp, the
expert mesh's efsdp and ep). torch sorts every process group (`new_group`, `split_group`), and
torch-tpu's lowering keys a group by its sorted ranks, so collectives concatenate in ascending
rank order, while DTensor, DCP and `distribute_tensor` place shards by coordinate. The two agree
for every rank and every axis exactly when the world mesh is the row-major grid of ranks
`arange(world).reshape(shape)`: so the trainer always builds that grid.

A device layout (torch-tpu's ring and torus orders, the compact expert-parallel groups, any
permutation) therefore never permutes the grid. It renumbers the processes instead: the process
the launcher started as rank `order[p]` (on a TPU: the device of that id, when ranks follow devices
on a host) joins the process group as rank `p`, the place the layout gives it. Group membership,
which is all the topology buys (XLA orders a collective's devices itself), is the layout's; every
shard index is the same number in SimpleFSDP, the layer-scan gathers, TP, EP dispatch and expert
ownership, CP, the reducers, Muon, DCP and the initial loads.

`[parallelism] device_order` says which order (`resolve_rank_order`): `identity`, `auto` (the
device layer's: torch-tpu's layout on a TPU whose slice is known before the process group,
identity elsewhere), a TPU target such as `v6e-8` (its torch-tpu order, from the port in
`parallelisms/tpu_topology.py`: how the CPU runs a TPU's order), or `3,1,0,2` (ranks in place
order; a list in TOML). `check_mesh_order` verifies the invariant at start-up on every mesh the run shards over.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import numpy as np
import torch

from models.errors import ConfigError

KEY = "parallelism.device_order"
WORDS = ("identity", "auto")
ALLOWED = (
    "identity, auto, a TPU target whose device count is the world size per slice (e.g. v6e-8, tpu7x-8, "
    "v6e-256), or a permutation of the ranks 0..world-1 (a list such as [0, 1, 3, 2])"
)


def check_spec(value) -> str:
    """The value's syntax (the recipe's check; the world size is checked at start-up), as text:
    a list of ranks becomes `3,1,0,2`."""
    from parallelisms import tpu_topology

    if isinstance(value, (list, tuple)):
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in value) or not value:
            raise ConfigError(f"{KEY}: {value!r} is not a device order; allowed: {ALLOWED}")
        value = ",".join(map(str, value))
    text = str(value).strip()
    text = re.sub(r"^tpu7x-", "v7x-", text)  # torch-tpu's name of the generation
    if text in WORDS or _is_permutation_text(text) or tpu_topology.topology_of(text) is not None:
        return text
    raise ConfigError(f"{KEY}: {value!r} is not a device order; allowed: {ALLOWED}")


def _is_permutation_text(text: str) -> bool:
    return bool(re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", text))


@dataclasses.dataclass(frozen=True)
class RankOrder:
    """`order[p]`: the launcher rank (device) that takes place `p` of the row-major world grid,
    i.e. process-group rank `p`."""

    spec: str
    """What the recipe said."""
    source: str
    """Where the order comes from, for the banner (e.g. "torch-tpu's order on v6e-8")."""
    order: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.order)

    @property
    def renumbered(self) -> int:
        """How many processes join the process group under another rank than the launcher's."""
        return sum(1 for p, r in enumerate(self.order) if p != r)

    def process_rank(self, launcher_rank: int) -> int:
        """The process-group rank of the process the launcher started as `launcher_rank`."""
        return self._position[launcher_rank]

    @property
    def _position(self) -> dict[int, int]:
        return {r: p for p, r in enumerate(self.order)}

    def launcher_rank(self, rank: int) -> int:
        """The launcher rank of process-group rank `rank`."""
        return self.order[rank]

    def summary(self) -> str:
        shown = ",".join(map(str, self.order[:16])) + (",..." if self.world_size > 16 else "")
        return (
            f"device order: {self.source}: place p <- launcher rank [{shown}]; "
            f"{self.renumbered} of {self.world_size} ranks renumbered, the mesh is in rank order"
        )


def identity(world_size: int, source: str = "identity") -> RankOrder:
    return RankOrder(spec="identity", source=source, order=tuple(range(world_size)))


def target_order(target: str, parallel_dims, *, spec: str | None = None) -> RankOrder:
    """The order torch-tpu gives `parallel_dims`' mesh on `target`'s slice (several slices: each
    slice laid out alike, slices placed as torch-tpu's hybrid mesh places them), with the trainer's
    compact EP groups on one slice (`tpu_topology.trainer_layout`), as launcher ranks: a host's
    processes drive its devices and hosts are numbered by position (`launcher_grid`; on one host
    device id d is launcher rank d), slices one after the other."""
    from parallelisms import tpu_topology

    topology = tpu_topology.topology_of(target)
    dims = parallel_dims
    per_slice = dims.world_size // dims.num_slices
    if topology is None or topology.devices != per_slice:
        have = "unknown" if topology is None else f"{topology.devices} devices"
        raise ConfigError(
            f"{KEY}: {target} ({have}) does not match this world: {dims.world_size} ranks over "
            f"{dims.num_slices} slice(s) = {per_slice} per slice; allowed: {ALLOWED}"
        )
    if dims.num_slices == 1:
        mapping = tpu_topology.trainer_layout(topology, dims.layout_shape, ep=dims.ep)
    else:
        mapping = tpu_topology.map_mesh(topology, dims.ici_mesh_shape)
    return mapping_order(mapping, dims, spec=spec or target, name=target)


def mapping_order(mapping, dims, *, spec: str, name: str) -> RankOrder:
    """The order of a layout of one slice (`tpu_topology.MeshMapping`, device ids) as launcher
    ranks (`launcher_grid`); on several slices each slice laid out alike (`hybrid_grid`)."""
    shape = dims.layout_shape if dims.num_slices == 1 else dims.ici_mesh_shape
    grid = launcher_grid(np.asarray(mapping.device_ids).reshape(shape), mapping.topology)
    if dims.num_slices > 1:
        grid = hybrid_grid(grid, dims.dcn_mesh_shape)
    how = mapping.method + (", compact EP groups" if mapping.expert_tile is not None else "")
    slices = f" x {dims.num_slices} slices" if dims.num_slices > 1 else ""
    return RankOrder(
        spec=spec, source=f"torch-tpu's order on {name}{slices} ({how})", order=tuple(int(d) for d in grid.reshape(-1))
    )


def launcher_grid(device_grid: np.ndarray, topology) -> np.ndarray:
    """A grid of one slice's device ids as the launcher ranks that drive them
    (`tpu_topology.launcher_device_ids`: hosts in torch-tpu's order; the identity on one host)."""
    from parallelisms import tpu_topology

    launcher_of = np.argsort(np.asarray(tpu_topology.launcher_device_ids(topology)))
    return launcher_of[np.asarray(device_grid)]


def hybrid_grid(ici: np.ndarray, dcn_shape: tuple[int, ...]) -> np.ndarray:
    """Slice s's layout `ici` (device ids of one slice) + s x devices-per-slice, in block
    (dcn coordinate) of the full mesh, slices numbered row-major over `dcn_shape`: how JAX's and
    torch-tpu's hybrid meshes join slices."""
    per = ici.size
    blocks = np.empty(dcn_shape, dtype=object)
    for s, index in enumerate(np.ndindex(*dcn_shape)):
        blocks[index] = ici + s * per
    return np.block(blocks.tolist())


def resolve_rank_order(spec, parallel_dims, *, device_type: str, tpu_layout=None) -> RankOrder:
    """The order of this run (module docstring); ConfigError naming the key for a value that does
    not fit the world (a target of another device count, a list that is no permutation of it).
    `tpu_layout`: for `auto` on a TPU, a function returning torch-tpu's layout of this mesh on the
    slice (`parallel_dims.tpu_mesh_layout`, a `tpu_topology.MeshMapping`) or None when the slice is
    not known before the process group."""
    text = check_spec(spec)
    world = parallel_dims.world_size
    if text == "identity":
        return identity(world)
    if text == "auto":
        if device_type != "tpu":
            return identity(world, f"identity (auto on {device_type})")
        mapping = tpu_layout() if tpu_layout is not None else None
        if mapping is None:
            return identity(
                world,
                "identity (auto: this slice's layout is unknown before the process group; set [job] target "
                "to the slice, or device_order to its name)",
            )
        return mapping_order(mapping, parallel_dims, spec="auto", name=str(mapping.topology))
    if _is_permutation_text(text):
        order = tuple(int(x) for x in text.split(","))
        if sorted(order) != list(range(world)):
            raise ConfigError(
                f"{KEY}: {text!r} is not a permutation of the {world} ranks 0..{world - 1}; allowed: {ALLOWED}"
            )
        per = world // parallel_dims.num_slices
        if any(r // per != p // per for p, r in enumerate(order)):
            raise ConfigError(
                f"{KEY}: {text!r} moves a rank to another slice ({parallel_dims.num_slices} slices of {per}); "
                "allowed: a permutation inside each slice's block of ranks"
            )
        return RankOrder(spec=text, source="the recipe's permutation", order=order)
    return target_order(text, parallel_dims, spec=text)


# ------------------------------------------------------------------------------- the start-up check


def grid_violations(name: str, mesh_grid: torch.Tensor, dim_names, *, example: bool = True) -> list[str]:
    """The axes of one mesh along which some line of its rank grid is not ascending: there a
    rank's group rank (sorted order) differs from its coordinate. Pure: every rank holds the world
    grid (a derived mesh's `.mesh` is the part around this rank: `example=False` keeps its
    verdict's text the same on every rank)."""
    grid = np.asarray(mesh_grid.cpu())
    bad = []
    for d, axis in enumerate(dim_names):
        lines = np.moveaxis(grid, d, -1).reshape(-1, grid.shape[d])
        if lines.shape[1] > 1 and (np.diff(lines, axis=1) <= 0).any():
            row = next(line for line in lines if (np.diff(line) <= 0).any())
            bad.append(f"{name}.{axis}" + (f" (a group {list(map(int, row))} out of rank order)" if example else ""))
    return bad


def check_mesh_order(meshes: Mapping[str, object]) -> int:
    """Stop (ConfigError naming the axis, on every rank alike) unless on every axis of every mesh
    in `meshes` ({name: DeviceMesh}, the world mesh first) this rank's group rank equals its coordinate. Checked twice: on
    the rank grids (every rank sees all of them, so all agree) and by asking torch for this rank's
    group ranks, whose flags one all-reduce (MIN) combines. Returns the number of axes checked."""
    import torch.distributed as dist

    named = {name: tuple(mesh.mesh_dim_names or range(mesh.ndim)) for name, mesh in meshes.items()}
    # the grids' verdict first: the same on every rank
    problems = [
        p
        for i, (name, mesh) in enumerate(meshes.items())
        for p in grid_violations(name, mesh.mesh, named[name], example=i == 0)
    ]
    local_ok: list[int] = []
    for name, mesh in meshes.items():
        coordinate = mesh.get_coordinate()
        for d, axis in enumerate(named[name]):
            ok = coordinate is not None and mesh.get_local_rank(d) == coordinate[d]
            local_ok.append(int(ok))
            if not ok and not problems:
                problems.append(f"{name}.{axis} (rank {dist.get_rank()}: group rank != coordinate)")
    checked = len(local_ok)
    flags = torch.tensor(local_ok or [1], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if not problems and int(flags.min()) == 0:
            i = int(torch.argmin(flags))
            axes = [f"{n}.{a}" for n, names in named.items() for a in names]
            problems.append(f"{axes[i]} (on another rank: group rank != coordinate)")
    if problems:
        raise ConfigError(
            f"{KEY}: the mesh breaks the shard invariant on {'; '.join(problems)}: shards would be placed by one "
            "order and gathered in another (permuted checkpoints and experts); allowed: a mesh built by "
            "parallelisms.build_mesh (ranks renumbered to the layout, the grid in rank order)"
        )
    return checked


def shard_rank(mesh, axis: str | int | None = None) -> int:
    """This rank's shard index along `axis` of `mesh`: its coordinate, which the invariant makes its
    group rank too (asserted: a mesh that breaks it is refused at start-up, `check_mesh_order`)."""
    if axis is None:
        assert mesh.ndim == 1, "name the axis of a mesh with several"
        axis = 0
    index = mesh.get_local_rank(axis)
    coordinate = mesh.get_coordinate()
    if coordinate is not None:
        d = axis if isinstance(axis, int) else list(mesh.mesh_dim_names).index(axis)
        assert coordinate[d] == index, f"mesh axis {axis}: group rank {index} != coordinate {coordinate[d]}"
    return index
