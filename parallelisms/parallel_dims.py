"""Parallel degrees, their validation, and the named DeviceMesh built from them.

`ParallelDims` holds the degrees of a job (`pp`, `dp_replicate`, `dp_shard`, `cp`, `tp`, `ep`) as
plain ints, checks them against the world size and against a model's sizes, and answers the
questions other components ask (data-parallel degree and rank, which parallelisms are on).
`build_mesh` turns it into one DeviceMesh with the axes `("dp_replicate", "dp_shard", "cp",
"tp")` on cpu (gloo), cuda (nccl) or tpu (topology-aware rank order). With pipeline parallelism
(`pp > 1`) the world is `("pp", "dp_replicate", "dp_shard", "cp", "tp")`, `pp` outermost, and
`build_mesh` returns this rank's stage mesh (the four axes above, over the ranks of its pp stage),
so every other parallelism runs inside a stage as without PP; `pp_mesh(mesh)` is the 1-D pp axis.

Rules (documented in docs/parallelism.md, docs/context_parallel.md, docs/pipeline_parallel.md):
- `pp * dp_replicate * dp_shard * cp * tp == world_size`; `dp_shard = -1` takes whatever is left.
- `cp` (context parallelism, parallelisms/context_parallel.py) splits the sequence: the `cp`
  ranks of one data-parallel group read the same batch rows; the sequence length must
  divide by `2 * cp` (and by `2 * cp * tp` with sequence-parallel TP).
- `ep` borrows ranks from the `dp_shard x cp x tp` block, as TorchTitan does: it must divide
  `dp_shard * cp * tp`; the expert mesh is `(dp_replicate, efsdp, ep)` with
  `efsdp = dp_shard * cp * tp / ep` (experts are data-parallel-sharded over `efsdp`).
- With tensor parallelism, heads, kv heads, the FFN hidden size and (for MoE) the expert
  hidden size must divide by `tp`; experts must divide by `ep`.
- Several slices (`num_slices`, multislice over the data-center network): the ranks are numbered
  slice-major (the launcher's global node rank), so the outermost axes carry the DCN split:
  `dcn_mesh_shape` puts it on `dp_replicate` (HSDP: shards inside a slice, gradients all-reduced
  across slices), spilling onto `dp_shard` only when `dp_replicate` cannot hold it (the step
  plan's rule refuses that unless `parallelism.allow_dcn_sharding`); `dp_replicate x dp_shard`
  must divide by the slice count, so cp and tp groups never leave a slice. With PP the DCN split is
  taken over `layout_shape` (pp folded into the outermost axis): the stages take the slices first
  (graph-mode PP over the DCN), and `pp x dp_replicate x dp_shard` must divide by the slice count.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from models.common import distributed
from models.contract import ModelShape
from models.errors import ConfigError
from parallelisms.context_parallel import check_seq_len

# Mesh axis names, outermost first. The busiest axis (tp) is innermost so that on TPU the
# topology-aware order keeps it on the fastest ICI links and on GPU it stays inside a host;
# cp (an all-gather of k/v per layer) comes next, as in TorchTitan. An axis of degree 1 is
# still built, so code indexes `mesh["tp"]` or `mesh["cp"]` unconditionally.
MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
# Names of the config keys each degree comes from, used in error messages.
_KEYS = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "num_slices": "parallelism.num_slices",
}


def resolve_num_slices(configured: int, env: Mapping[str, str] | None = None) -> int:
    """The job's slice count: `[parallelism] num_slices`, or with 0 the launcher's
    `MEGASCALE_NUM_SLICES` (else 1). ConfigError when both are set and disagree, or the variable is
    not a count."""
    env = os.environ if env is None else env
    raw = env.get("MEGASCALE_NUM_SLICES", "").strip()
    if raw and (not raw.isdigit() or int(raw) < 1):
        raise ConfigError(f"environment variable MEGASCALE_NUM_SLICES is {raw!r}; allowed: the number of slices, >= 1")
    from_env = int(raw) if raw else None
    if configured == 0:
        return from_env or 1
    if from_env is not None and from_env != configured:
        raise ConfigError(
            f"{_KEYS['num_slices']}: {configured}, but the launcher's MEGASCALE_NUM_SLICES is {from_env}; "
            f"allowed: {from_env}, or 0 (take it from the environment)"
        )
    return configured


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of each parallelism. `dp_shard=-1` is resolved to fill the world."""

    dp_replicate: int = 1
    """HSDP replicas (gradients all-reduced across them)."""
    dp_shard: int = -1
    """FSDP shards (parameters, gradients and optimizer state split across them)."""
    cp: int = 1
    """Context parallel degree: the sequence is split (load-balanced) over this many ranks."""
    tp: int = 1
    """Tensor (and sequence) parallel degree."""
    ep: int = 1
    """Expert parallel degree, carved out of `dp_shard * tp`."""
    num_slices: int = 1
    """TPU slices the world spans (the DCN split, outermost; `dcn_mesh_shape`)."""
    pp: int = 1
    """Pipeline parallel degree: the outermost axis; each pp rank holds a slice of the layers and
    the other degrees apply inside it (`mesh_shape` is one stage's mesh)."""
    world_size: int
    """Number of ranks in the job."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size}; allowed: a positive integer")
        for name in ("pp", "dp_replicate", "cp", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{_KEYS[name]}: must be an integer >= 1, got {value!r}; allowed: a positive integer")
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ConfigError(
                f"{_KEYS['dp_shard']}: must be an integer >= 1 or -1 (fill the rest), got {self.dp_shard!r}; allowed: -1 or a positive integer"
            )
        cp_text = f"context_parallel_degree ({self.cp}) x " if self.cp != 1 else ""
        if self.pp != 1:
            cp_text = f"pipeline_parallel_degree ({self.pp}) x {cp_text}"
        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ConfigError(
                    f"{_KEYS['dp_shard']}: -1 cannot fill world size {self.world_size} because "
                    f"data_parallel_replicate_degree ({self.dp_replicate}) x {cp_text}"
                    f"tensor_parallel_degree ({self.tp}) = {others} does not divide it; allowed: degrees whose "
                    f"product divides {self.world_size}"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallelism: data_parallel_replicate_degree ({self.dp_replicate}) x "
                f"data_parallel_shard_degree ({self.dp_shard}) x {cp_text}tensor_parallel_degree "
                f"({self.tp}) = {product}, but the world size is {self.world_size}; "
                f"the product must equal the world size (set data_parallel_shard_degree = -1 "
                f"to fill it); allowed: degrees whose product is {self.world_size}"
            )
        if not isinstance(self.num_slices, int) or self.num_slices < 1:
            raise ConfigError(
                f"{_KEYS['num_slices']}: must be an integer >= 1, got {self.num_slices!r}; allowed: a positive integer"
            )
        if self.num_slices > 1 and (self.pp * self.dp_replicate * self.dp_shard) % self.num_slices != 0:
            pp_text = f"pipeline_parallel_degree ({self.pp}) x " if self.pp != 1 else ""
            raise ConfigError(
                f"{_KEYS['num_slices']}: {self.num_slices} slices, but {pp_text}data_parallel_replicate_degree "
                f"({self.dp_replicate}) x data_parallel_shard_degree ({self.dp_shard}) = "
                f"{self.pp * self.dp_replicate * self.dp_shard} does not divide by it (the slices split the "
                "pipeline stages and the data-parallel ranks; cp and tp groups stay inside a slice); allowed: "
                f"{'pipeline and ' if self.pp != 1 else ''}data-parallel degrees whose product is a multiple of "
                f"{self.num_slices}"
            )
        block = self.dp_shard * self.cp * self.tp
        if block % self.ep != 0:
            raise ConfigError(
                f"{_KEYS['ep']}: {self.ep} must divide data_parallel_shard_degree x "
                f"{'context_parallel_degree x ' if self.cp != 1 else ''}tensor_parallel_degree = "
                f"{block} (expert parallelism borrows its ranks from the FSDP x CP x TP ranks); allowed: divisors "
                f"of {block}"
            )

    # --- what is on -------------------------------------------------------------------------
    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def stage_world_size(self) -> int:
        """Ranks of one pipeline stage (the whole world without PP)."""
        return self.world_size // self.pp

    # --- sizes ------------------------------------------------------------------------------
    @property
    def dp_degree(self) -> int:
        """Number of distinct data shards per step (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that see the same batch rows (for per-device token counts in metrics): each
        of the pp x cp x tp ranks of a data-parallel group processes 1/(pp x cp x tp) of its tokens
        (a pp rank runs its layers over all of them)."""
        return self.pp * self.cp * self.tp

    @property
    def efsdp(self) -> int:
        """FSDP degree of expert parameters: the `dp_shard x cp x tp` ranks left after `ep`."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def layout_shape(self) -> tuple[int, int, int, int]:
        """The whole world's mesh as a TPU layout places it: `mesh_shape` with pp (outermost,
        graph-mode PP) folded into dp_replicate, the same row-major rank order."""
        return (self.pp * self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dcn_mesh_shape(self) -> tuple[int, int, int, int]:
        """How many slices each axis of `layout_shape` spans (product `num_slices`): all on the
        outermost axis (`pp x dp_replicate`: the pipeline stages first, then the HSDP replicas) when
        it divides by the slice count, else what it holds there and the rest on `dp_shard`. With
        pp a multiple of the slice count each slice holds `pp / num_slices` whole stages (PP over the
        DCN, docs/pipeline_parallel.md "Across slices")."""
        on_replicate = math.gcd(self.pp * self.dp_replicate, self.num_slices)
        return (on_replicate, self.num_slices // on_replicate, 1, 1)

    @property
    def ici_mesh_shape(self) -> tuple[int, int, int, int]:
        """The mesh inside one slice: `layout_shape / dcn_mesh_shape` (`mesh_shape` without PP)."""
        return tuple(m // d for m, d in zip(self.layout_shape, self.dcn_mesh_shape))

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """Data-parallel rank of this process: the CP and TP ranks of one dp group get the
        same number.

        It is the row-major index of (dp_replicate, dp_shard) coordinates, i.e. the rank in
        the flattened `dp` axis; the data loader reads shard `dp_rank` of `dp_degree`.
        """
        if mesh is None:
            assert self.world_size == 1, "a mesh is needed when world_size > 1"
            return 0
        coordinate = mesh.get_coordinate()
        assert coordinate is not None, "this rank is not part of the mesh"
        names = mesh.mesh_dim_names
        assert names is not None and tuple(names) == MESH_AXES, f"unexpected mesh axes {names}"
        replicate, shard, _, _ = coordinate
        return replicate * self.dp_shard + shard

    # --- model checks ----------------------------------------------------------------------
    def validate_for_model(self, shape: ModelShape, *, seq_len: int) -> None:
        """Raise ConfigError if a degree does not divide a size of the model it must split.

        Tensor parallelism splits heads, kv heads and MLP hidden units (or the sizes the shape's
        `tp_splits` names), and, with sequence parallelism, the sequence; expert parallelism splits the experts. `dim` and
        `vocab_size` need not divide: DTensor shards embedding rows and norm weights
        unevenly when needed.
        """
        if self.tp_enabled:  # with cp, the sequence-parallel split of s / cp is checked below
            splits = shape.tp_splits
            if splits is None:  # the decoders' heads, kv heads and MLP hidden units
                splits = (
                    ("n_heads", shape.n_heads),
                    ("n_kv_heads", shape.n_kv_heads),
                    (
                        "MoE expert hidden size" if shape.is_moe else "FFN hidden size",
                        shape.moe_hidden if shape.is_moe else shape.ffn_hidden,
                    ),
                )
            checks = [*splits, ("sequence length (sequence parallel)", seq_len)]
            for what, value in checks:
                if value and value % self.tp != 0:
                    raise ConfigError(
                        f"{_KEYS['tp']}: {self.tp} does not divide the model's {what} "
                        f"({value}); allowed: divisors of {value}"
                    )
        if self.cp_enabled:
            check_seq_len(seq_len, self.cp)
            if self.tp_enabled and (seq_len // self.cp) % self.tp != 0:
                raise ConfigError(
                    f"{_KEYS['tp']}: {self.tp} does not divide the sequence length per context-"
                    f"parallel rank ({seq_len} / {self.cp} = {seq_len // self.cp}); allowed: "
                    f"divisors of {seq_len // self.cp}"
                )
        if self.ep_enabled:
            if not shape.is_moe:
                raise ConfigError(f"{_KEYS['ep']}: {self.ep} > 1 but the model has no experts; allowed: 1")
            if shape.num_experts % self.ep != 0:
                raise ConfigError(
                    f"{_KEYS['ep']}: {self.ep} does not divide the number of experts "
                    f"({shape.num_experts}); allowed: divisors of {shape.num_experts}"
                )


def tpu_mesh_layout(parallel_dims: ParallelDims, *, target: str | None, env=None, generation=None):
    """The layout torch-tpu will give this mesh on a TPU (`parallelisms/tpu_topology.py`), checked
    before anything is built; ConfigError (naming the axis and the slice) when it cannot be laid out
    even splitting physical axes; None when the slice is not known yet. `generation`: the local TPU
    generation, or a function returning it (called only when the launcher's variable is set).

    What is known when: the slice a run is on, from torch-tpu's launcher (`TORCH_TPU_TOPOLOGY`,
    which describes the whole slice only on one host) when its device count is the world size; else
    the recipe's `[job] target` when its device count is the world size (the recipe check, or a run
    on the target it names). Otherwise only torch-tpu knows, at `build_mesh` (`_tpu_rank_grid`).
    """
    from parallelisms import tpu_topology

    env = os.environ if env is None else env
    # Several slices: each slice holds the ICI part of the mesh (`ici_mesh_shape`), laid out on that
    # slice as on a single one; the DCN part is torch-tpu's hybrid mesh (build_mesh).
    devices = parallel_dims.world_size // parallel_dims.num_slices
    shape = parallel_dims.ici_mesh_shape if parallel_dims.num_slices > 1 else parallel_dims.layout_shape
    if target and parallel_dims.num_slices > 1 and isinstance(target, str) and re.search(r"x\d+$", target):
        target = target.rsplit("x", 1)[0]  # v6e-256x2 -> one slice, v6e-256
    topology = None
    if env.get("TORCH_TPU_TOPOLOGY"):
        if callable(generation):
            generation = generation()
        topology = tpu_topology.topology_from_env(generation, env)
    if (topology is None or topology.devices != devices) and target:
        topology = tpu_topology.topology_of(target)
    if topology is None or topology.devices != devices:
        return None
    mapping = tpu_topology.map_mesh(topology, shape, names=MESH_AXES)
    named = tpu_topology.topology_of(target) if target and parallel_dims.num_slices == 1 else None
    if named is not None and (named.chips, named.devices_per_chip) == (topology.chips, topology.devices_per_chip):
        # the trainer's compact EP groups (device_order.target_order), which read the target alone
        mapping = tpu_topology.compact_expert_groups(mapping, parallel_dims.ep) or mapping
    return mapping


def _tpu_rank_grid(shape: tuple[int, ...], dcn_mesh_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Global ranks laid out in `shape`, ordered by the TPU interconnect topology.

    torch-tpu places each axis on whole physical axes of the slice and raises NotImplementedError
    where it cannot (e.g. cp 4 on a 16x16 v6e-256); only then is it asked again with
    allow_split_physical_axes=True (an axis on a segment of a physical axis: the costs are in the
    banner's `mesh:` notes when the slice was known at start-up, `tpu_mesh_layout`).
    Reached only when the device type is "tpu", i.e. when torch has loaded the torch-tpu
    backend itself; this file never imports torch_tpu (it has side effects on CPU hosts).
    """
    tpu = getattr(torch, "tpu", None)
    if tpu is None or not hasattr(tpu, "distributed"):
        raise RuntimeError("device type 'tpu' requested but torch.tpu is not available")
    # The JAX convention: axes ordered by increasing network intensity, so tp (last) gets
    # the nearest neighbours; on several slices the DCN split lands on axis 0 (dp_replicate).
    # Every rank computes the layout from the same all-gathered device list, so every rank fails
    # (and retries) alike.
    # On several slices the split is ours (`ParallelDims.dcn_mesh_shape`), not torch-tpu's inference.
    dcn = {} if dcn_mesh_shape is None else {"dcn_mesh_shape": tuple(dcn_mesh_shape)}
    try:
        return tpu.distributed.topology_aware_mesh(shape, **dcn)
    except NotImplementedError as whole:
        try:
            ranks = tpu.distributed.topology_aware_mesh(shape, allow_split_physical_axes=True, **dcn)
        except Exception as e:
            raise ConfigError(
                f"parallelism: torch-tpu cannot lay out the mesh {dict(zip(MESH_AXES, shape))} on this slice, "
                f"not even splitting physical axes ({type(e).__name__}: {e}); whole axes: {whole}; allowed: "
                "degrees whose mesh axes are products of the slice's physical axes"
            ) from e
        if distributed.rank() == 0:
            print(
                f"titan-tpu: mesh: {dict(zip(MESH_AXES, shape))} is no product of whole physical axes here; "
                f"built with allow_split_physical_axes=True ({str(whole).split('. ')[0]})",
                flush=True,
            )
        return ranks


def build_mesh(parallel_dims: ParallelDims, device_type: str, *, target: str | None = None, order=None) -> DeviceMesh:
    """Build the named world mesh `("dp_replicate", "dp_shard", "cp", "tp")`.

    Needs an initialized default process group of `parallel_dims.world_size` ranks. The grid is
    always the ranks in row-major order, so that on every axis (and every flattened or split one)
    a rank's group rank is its coordinate: the shard invariant of parallelisms/device_order.py,
    checked here on every mesh the run shards over (`check_mesh_order`). A device layout (torch-tpu's
    order, compact EP groups) is applied by renumbering the processes before the process group
    (`order`, a `RankOrder`: trainer.job.rank_order_of), never by permuting the grid. On a TPU the
    groups are compared with torch-tpu's own layout (`topology_aware_mesh`) and the banner says
    whether they agree. The flattened `dp` axis (replicate x shard) is created too
    (`flat_dp_mesh(mesh)`); with cp > 1 also `dp_shard_cp` (`dp_shard_cp_mesh(mesh)`); with ep > 1
    the expert mesh (`build_ep_mesh`).
    """
    from parallelisms.device_order import check_mesh_order

    assert distributed.is_up(), "init the process group before build_mesh"
    if dist.get_world_size() != parallel_dims.world_size:
        raise ConfigError(
            f"parallelism: degrees were resolved for world size {parallel_dims.world_size} but "
            f"the process group has {dist.get_world_size()} ranks; allowed: resolve the degrees for "
            f"{dist.get_world_size()} ranks"
        )
    shape = parallel_dims.mesh_shape
    if parallel_dims.pp_enabled:
        return _build_pp_mesh(parallel_dims, device_type)
    ranks = torch.arange(parallel_dims.world_size).reshape(shape)
    if device_type == "tpu":
        dcn = parallel_dims.dcn_mesh_shape if parallel_dims.num_slices > 1 else None
        _compare_with_torch_tpu(ranks, _tpu_rank_grid(shape, dcn), order, parallel_dims)
    check_slice_major(parallel_dims, rank=dist.get_rank())
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=MESH_AXES)
    meshes = {"world": mesh, "dp": flat_dp_mesh(mesh)}
    if parallel_dims.cp_enabled:
        meshes["dp_shard_cp"] = dp_shard_cp_mesh(mesh)
    if parallel_dims.ep_enabled:
        meshes["expert"] = build_ep_mesh(parallel_dims, mesh)
    mesh._titan_checked_axes = check_mesh_order(meshes)  # the recipe check reports it
    return mesh


PP_AXES = ("pp", *MESH_AXES)
"""The world mesh's axes with pipeline parallelism (`pp` outermost)."""


def _build_pp_mesh(parallel_dims: ParallelDims, device_type: str) -> DeviceMesh:
    """With pp > 1: the world mesh `PP_AXES` in rank order, and this rank's stage mesh (`MESH_AXES`
    over the ranks of its pp stage) returned, carrying the 1-D pp axis (`pp_mesh`). With cp > 1 the cp axis
    is the stage's (SimpleFSDP over its `dp_shard_cp`); with ep > 1 the expert mesh is the stage's own
    (`build_ep_mesh` over the stage mesh: EP groups never cross the pp axis). On several slices the
    ranks are slice-major and pp is outermost, so the slices split the pp axis (`dcn_mesh_shape`):
    each stage's FSDP group stays inside a slice and only the stage permutes (and the HSDP
    all-reduce, if any) cross the DCN."""
    from parallelisms.device_order import check_mesh_order

    check_slice_major(parallel_dims, rank=dist.get_rank())
    ranks = torch.arange(parallel_dims.world_size).reshape((parallel_dims.pp, *parallel_dims.mesh_shape))
    world = DeviceMesh(device_type, ranks, mesh_dim_names=PP_AXES)
    stage = world[MESH_AXES]
    stage._titan_pp_mesh = world["pp"]
    meshes = {"world": world, "stage": stage, "pp": world["pp"], "dp": flat_dp_mesh(stage)}
    if parallel_dims.cp_enabled:
        meshes["dp_shard_cp"] = dp_shard_cp_mesh(stage)
    if parallel_dims.ep_enabled:
        meshes["expert"] = build_ep_mesh(parallel_dims, stage)
    stage._titan_checked_axes = check_mesh_order(meshes)
    return stage


def stage_group_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Every rank of a stage mesh (`build_mesh`'s with pp > 1) as one 1-D axis `stage` (cached by
    DeviceMesh): the ranks that run the same layers on different tokens, over which a pp rank sums
    what each counted of its own tokens (the MoE layers' expert counts and loads)."""
    return mesh[MESH_AXES]._flatten("stage")


def pp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The 1-D `pp` mesh of a stage mesh `build_mesh` returned with pp > 1; None without PP."""
    return getattr(mesh, "_titan_pp_mesh", None) if mesh is not None else None


def axis_groups(grid: torch.Tensor) -> list[set[frozenset[int]]]:
    """Per axis of a rank grid, the set of its groups (the ranks of each line along the axis)."""
    out = []
    for d in range(grid.dim()):
        lines = grid.movedim(d, -1).reshape(-1, grid.shape[d]).tolist()
        out.append({frozenset(line) for line in lines})
    return out


def _compare_with_torch_tpu(ranks: torch.Tensor, tpu_grid: torch.Tensor, order, parallel_dims: ParallelDims) -> None:
    """Rank 0 prints whether the renumbered processes form torch-tpu's own groups on each axis (its
    `topology_aware_mesh`, in process-group ranks). They agree when the device order followed the
    slice's layout and ranks follow devices; they differ where the trainer's compact EP groups
    reorder dp_shard (by design) or the layout was unknown at start-up (rank order: correct, not
    topology-aware). The mesh is `ranks` either way: this is a report, never a change of placement."""
    ours, theirs = axis_groups(ranks), axis_groups(torch.as_tensor(tpu_grid).reshape(ranks.shape))
    differ = [axis for axis, a, b in zip(MESH_AXES, ours, theirs) if a != b]
    if distributed.rank() != 0:
        return
    source = order.source if order is not None else "the launcher's order"
    if not differ:
        print(f"titan-tpu: mesh: the process groups are torch-tpu's own on every axis ({source})", flush=True)
    else:
        print(
            f"titan-tpu: mesh: the groups of {', '.join(differ)} differ from torch-tpu's layout ({source}); "
            "shards stay correct (the mesh is in rank order), the groups may not be the topology's: "
            "set [job] target to this slice, or parallelism.device_order to its name",
            flush=True,
        )


def check_slice_major(parallel_dims: ParallelDims, *, rank: int, env: Mapping[str, str] | None = None) -> None:
    """Off TPU the mesh is row-major over the global ranks, so slice s must hold ranks
    s x (world / slices) onwards: what the launcher's node rank (slice id x hosts per slice +
    worker id) gives. ConfigError when this rank's `MEGASCALE_SLICE_ID` says otherwise."""
    env = os.environ if env is None else env
    raw = env.get("MEGASCALE_SLICE_ID", "").strip()
    if parallel_dims.num_slices <= 1 or not raw.isdigit():
        return
    expected = rank // (parallel_dims.world_size // parallel_dims.num_slices)
    if int(raw) != expected:
        raise ConfigError(
            f"parallelism.num_slices: rank {rank} of {parallel_dims.world_size} has MEGASCALE_SLICE_ID={raw}, "
            f"but slice-major numbering puts it on slice {expected}; allowed: start every host through "
            "python -m trainer.launch (node rank = slice id x hosts per slice + worker id)"
        )


def flat_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D `dp` mesh (dp_replicate x dp_shard flattened); cached by DeviceMesh."""
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


def dp_shard_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D `dp_shard_cp` axis (dp_shard x cp flattened), cached by DeviceMesh: with context
    parallelism SimpleFSDP shards parameters over it (as TorchTitan does), so the cp ranks,
    which hold the same parameters, share their storage and average their gradients."""
    return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")


def fsdp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The world's ranks as `("dp_replicate", "dp_shard_cp", "tp")`: the mesh SimpleFSDP
    (`data_parallel(..., shard_axis="dp_shard_cp")`) takes when cp > 1; its `tp` axis is the
    world mesh's."""
    return DeviceMesh._concatenate([mesh["dp_replicate"], dp_shard_cp_mesh(mesh), mesh["tp"]])


def build_ep_mesh(parallel_dims: ParallelDims, mesh: DeviceMesh) -> DeviceMesh:
    """The expert mesh `("dp_replicate", "efsdp", "ep")` over the same ranks as `mesh` (the world
    mesh, or with pp > 1 the stage mesh).

    The `dp_shard x cp x tp` block is flattened and split again into `efsdp x ep` with `ep`
    innermost, so an EP group is a run of neighbouring ranks (the TP ones first).
    """
    # the world's ranks, or with pp > 1 one stage's (its expert mesh stays inside the stage)
    assert math.prod(mesh.mesh.shape) == parallel_dims.stage_world_size
    # made once per world mesh (build_mesh checks it, expert_parallel shards over it)
    cached = getattr(mesh, "_titan_ep_mesh", None)
    if cached is not None and cached[0] == parallel_dims.ep:
        return cached[1]
    ep_mesh = _build_ep_mesh(parallel_dims, mesh)
    mesh._titan_ep_mesh = (parallel_dims.ep, ep_mesh)
    return ep_mesh


def _build_ep_mesh(parallel_dims: ParallelDims, mesh: DeviceMesh) -> DeviceMesh:
    flat = mesh["dp_shard", "cp", "tp"]._flatten("dp_shard_cp_tp")
    inner = flat._unflatten(0, (parallel_dims.efsdp, parallel_dims.ep), ("efsdp", "ep"))
    if not parallel_dims.dp_replicate_enabled:
        return inner._unflatten(0, (1, parallel_dims.efsdp), ("dp_replicate", "efsdp"))
    # With replicas, concatenate the outer axis with the split inner block.
    return DeviceMesh._concatenate([mesh["dp_replicate"], inner])
