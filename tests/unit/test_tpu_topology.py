"""The mesh a TPU builds (parallelisms/tpu_topology.py): torch-tpu's layout rules, ported.

torch-tpu's `topology_aware_mesh` puts each mesh axis on whole physical axes of the slice and
raises NotImplementedError otherwise; only with allow_split_physical_axes=True may an axis take a
segment of one. These tests pin the port on the cases that matter (the v6e 128k recipes, v7x cp 2,
small slices), the trainer's use of it (the fallback in `_tpu_rank_grid`, the rule in `plan_job`,
the banner), the planner's search and the recipe check's column. tests/xla/test_tpu_topology_ttpu.py
checks the port against torch-tpu's own function.
"""

from __future__ import annotations

import itertools
import math
import os
import types

import numpy as np
import pytest
import torch

import planner
from models.errors import ConfigError
from parallelisms import parallel_dims as pd
from parallelisms import tpu_topology as tt
from trainer.config import build_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _recipe(name: str) -> str:
    return os.path.join(ROOT, "configs", name)


def test_topologies_of_the_planner_targets():
    v6e = tt.topology_of("v6e-256")
    assert (v6e.chips, v6e.physical_shape, v6e.wrap, v6e.device_kind) == (
        (16, 16, 1),
        (16, 16, 1),
        (True, True, False),
        "TPU v6 lite",
    )
    assert str(v6e) == "v6e-256 (16x16 chips, wraparound on x/y)"
    v7x = tt.topology_of("v7x-256")  # 256 TensorCores = 128 chips, two devices each
    assert (v7x.chips, v7x.physical_shape, v7x.devices) == ((4, 4, 8), (4, 4, 8, 2), 256)
    assert tt.topology_of("v7x-1024").chips == (8, 8, 8)
    assert tt.topology_of("v5p-128").physical_shape == (4, 4, 4)  # 64 megacore chips: a cube, a torus
    assert tt.topology_of("v5p-128").wrap == (True, True, True)
    assert tt.topology_of("v5p-64").wrap == (False, False, False)  # 2x4x4: below a cube
    assert tt.topology_of("v6e-16").wrap == (False, False, False)
    assert tt.topology_of("h100-64") is None and tt.topology_of("v6e-96") is None


def test_the_deviceless_compile_topologies_come_from_the_grids():
    """The compile-only topology names (tools/tpu_compile.py, scripts/estimate_xla.py) are the
    slices' chip grids: the names the earlier table spelled out and the compiles ran on."""
    import planner
    from tools.tpu_compile import topology_name

    expected = {
        "v6e-8": "v6e:2x4",
        "v6e-16": "v6e:4x4",
        "v6e-256": "v6e:16x16",
        "v5e-4": "v5e:2x2",
        "v5p-128": "v5p:4x4x4",
        "v7x-8": "tpu7x:2x2x1",
        "v7x-256": "tpu7x:4x4x8",
        "v7x-512": "tpu7x:4x8x8",
        "v7x-1024": "tpu7x:8x8x8",
    }
    for name, topology in expected.items():
        assert topology_name(planner.parse_target(name)) == topology, name


def test_keys_and_axes_are_parallel_dims_own():
    assert tt.MESH_AXES == pd.MESH_AXES
    assert all(pd._KEYS[a] == tt.KEYS[a] for a in tt.MESH_AXES)


@pytest.mark.parametrize("shape, cp", [((1, 64, 4, 1), 4), ((1, 32, 8, 1), 8)])
def test_v6e_128k_shapes_map_only_with_split_axes(shape, cp):
    topo = tt.topology_of("v6e-256")
    with pytest.raises(tt.UnmappableAxis) as e:
        tt.assign(topo, shape, allow_split=False)
    assert str(e.value) == (
        f"parallelism.context_parallel_degree: cp = {cp} is not a product of whole physical axes of v6e-256 "
        "(16x16 chips, wraparound on x/y) (left after the inner axes: 16x16x-); torch-tpu's topology_aware_mesh "
        "maps each mesh axis onto whole axes unless allowed to split one; allowed without a split: 1, 16, 256"
    )
    layout = tt.map_mesh(topo, shape)
    assert layout.split and layout.method == "split axes"
    fsdp = shape[1]
    assert layout.summary() == (f"fsdp {fsdp} <- x[::{cp}]*y (split), cp {cp} <- x[:{cp}] (split, no wraparound)")
    ids = np.asarray(layout.device_ids)
    # a cp group: cp consecutive chips along x (ids are x-fastest); fsdp walks y first (its minor
    # part), then x in steps of cp
    assert ids[0, 0, :, 0].tolist() == list(range(cp)) and ids[0, 1, 0, 0] == 16 and ids[0, 16, 0, 0] == cp
    cp_axis = layout.axes[2]
    assert (cp_axis.parts, cp_axis.wrap, cp_axis.split) == (((0, cp, 1),), False, True)
    notes = layout.notes()
    assert len(notes) == 2 and f"{cp} consecutive of the 16 along x: a ring segment without wraparound" in notes[1]


def test_tp4_on_v6e_256_needs_a_split_and_pure_fsdp_does_not():
    topo = tt.topology_of("v6e-256")
    for shape in ((1, 64, 1, 4), (1, 16, 4, 4)):
        with pytest.raises(tt.UnmappableAxis, match="parallelism.tensor_parallel_degree: tp = 4"):
            tt.assign(topo, shape, allow_split=False)
        assert tt.map_mesh(topo, shape).split
    whole = tt.assign(topo, (1, 256, 1, 1), allow_split=False)
    assert (whole.method, whole.summary(), whole.notes()) == ("whole axes", "fsdp 256 <- x*y", [])
    assert tt.map_mesh(topo, (1, 16, 16, 1)).summary() == "fsdp 16 <- y, cp 16 <- x"


def test_v7x_cp2_takes_the_core_axis():
    layout = tt.assign(tt.topology_of("v7x-256"), (1, 128, 2, 1), allow_split=False)
    assert layout.method == "whole axes" and layout.summary() == "fsdp 128 <- x*y*z, cp 2 <- core"
    ids = np.asarray(layout.device_ids)
    assert ids[0, 0, :, 0].tolist() == [0, 1]  # the two TensorCores of chip (0, 0, 0)
    assert tt.map_mesh(tt.topology_of("v7x-512"), (1, 512, 1, 1)).summary() == "fsdp 512 <- x*y*z*core"


def test_small_slices_take_the_tray_ring_whatever_the_shape():
    layout = tt.map_mesh(tt.topology_of("v6e-8"), (1, 4, 2, 1))
    assert layout.method == "tray ring" and not layout.split
    assert np.asarray(layout.device_ids).reshape(-1).tolist() == [0, 1, 2, 3, 7, 6, 5, 4]
    assert layout.summary() == "fsdp 4 x cp 2 <- tray ring order of 8 devices"
    v7x = tt.map_mesh(tt.topology_of("v7x-16"), (1, 8, 2, 1))
    assert np.asarray(v7x.device_ids).reshape(-1).tolist() == [0, 1, 2, 3, 6, 7, 4, 5, 8, 9, 10, 11, 14, 15, 12, 13]


def test_a_shape_that_cannot_map_is_refused_with_the_key_and_the_slice():
    topo = tt.topology_of("v6e-256")
    with pytest.raises(ConfigError) as e:
        tt.map_mesh(topo, (1, 64, 2, 1))  # 128 devices on a 256-device slice: no layout at all
    assert str(e.value) == (
        "parallelism: the mesh (1, 64, 2, 1) has 128 devices but v6e-256 (16x16 chips, "
        "wraparound on x/y) has 256; allowed: degrees whose product is 256"
    )
    # and the split search names the axis when the factors left cannot make it
    with pytest.raises(tt.UnmappableAxis) as e:
        tt._split_axes((16, 16, 1), (1, 3, 1, 1), tt.MESH_AXES, topo)
    assert str(e.value).startswith(
        "parallelism.data_parallel_shard_degree: dp_shard = 3 does not fit the devices left on v6e-256"
    )


def test_topology_from_the_launcher_variable():
    t = tt.topology_from_env("v6e", {"TORCH_TPU_TOPOLOGY": "2,4,1"})
    assert (t.chips, t.devices) == ((2, 4, 1), 8)
    t = tt.topology_from_env("v7x", {"TORCH_TPU_TOPOLOGY": "2,2,1,2"})
    assert (t.physical_shape, t.devices) == ((2, 2, 1, 2), 8)
    assert (
        tt.topology_from_env("v6e", {}) is None and tt.topology_from_env(None, {"TORCH_TPU_TOPOLOGY": "2,4,1"}) is None
    )
    assert tt.topology_from_env("v6e", {"TORCH_TPU_TOPOLOGY": "2,x"}) is None


# --- the trainer --------------------------------------------------------------------------------


def _fake_tpu(monkeypatch, behaviour):
    calls = []

    def topology_aware_mesh(shape, **kwargs):
        calls.append(kwargs.get("allow_split_physical_axes", False))
        return behaviour(shape, calls[-1])

    monkeypatch.setattr(
        torch,
        "tpu",
        types.SimpleNamespace(distributed=types.SimpleNamespace(topology_aware_mesh=topology_aware_mesh)),
        raising=False,
    )
    return calls


def test_rank_grid_asks_for_split_axes_only_when_whole_axes_fail(monkeypatch, capsys):
    def whole_only_for_fsdp(shape, split):
        if shape[2] > 1 and not split:
            raise NotImplementedError("Failed to find assignment for logical_axis_index 2 of size 4. More.")
        return torch.arange(256).reshape(shape)

    calls = _fake_tpu(monkeypatch, whole_only_for_fsdp)
    assert pd._tpu_rank_grid((1, 256, 1, 1)).shape == (1, 256, 1, 1) and calls == [False]
    calls.clear()
    assert pd._tpu_rank_grid((1, 64, 4, 1)).shape == (1, 64, 4, 1) and calls == [False, True]
    assert "built with allow_split_physical_axes=True (Failed to find assignment" in capsys.readouterr().out


def test_rank_grid_refuses_when_not_even_a_split_maps(monkeypatch):
    def never(shape, split):
        raise NotImplementedError("no") if not split else TypeError("bad")

    _fake_tpu(monkeypatch, never)
    with pytest.raises(ConfigError, match=r"parallelism: torch-tpu cannot lay out the mesh .* not even splitting"):
        pd._tpu_rank_grid((1, 64, 4, 1))


def test_plan_job_lays_out_the_tpu_mesh_before_building(monkeypatch):
    from trainer.job import plan_job

    monkeypatch.delenv("TORCH_TPU_TOPOLOGY", raising=False)
    plan = plan_job(build_config(_recipe("llama3_8b_128k_v6e.toml")), world_size=256, device_type="tpu")
    assert plan.tpu_mesh.split
    banner = plan.tpu_mesh.banner()
    assert banner[0] == (
        "titan-tpu: mesh on v6e-256 (16x16 chips, wraparound on x/y): fsdp 64 <- x[::4]*y (split), "
        "cp 4 <- x[:4] (split, no wraparound) (torch-tpu's layout: needs allow_split_physical_axes=True)"
    )
    assert any("4 consecutive of the 16 along x" in line for line in banner[1:])
    # not a TPU, or a world the target's slice does not describe: nothing is known yet
    assert (
        plan_job(build_config(_recipe("llama3_8b_128k_v6e.toml")), world_size=256, device_type="cpu").tpu_mesh is None
    )
    dims = pd.ParallelDims(dp_shard=-1, cp=2, world_size=8)
    assert pd.tpu_mesh_layout(dims, target="v6e-256", env={}) is None
    # on a TPU host: the launcher's slice, when it is the whole world
    layout = pd.tpu_mesh_layout(dims, target="v6e-256", env={"TORCH_TPU_TOPOLOGY": "2,4,1"}, generation="v6e")
    assert layout.method == "tray ring"


def test_plan_job_refuses_a_mesh_torch_tpu_cannot_lay_out(monkeypatch):
    from trainer.job import plan_job

    def refuse(topology, shape, **_):
        raise tt.UnmappableAxis(
            f"parallelism.context_parallel_degree: cp = {shape[2]} ... on {topology}",
            axis="cp",
            size=shape[2],
            split=True,
        )

    monkeypatch.setattr(tt, "map_mesh", refuse)
    with pytest.raises(ConfigError, match=r"^parallelism.context_parallel_degree: cp = 4 \.\.\. on v6e-256"):
        plan_job(build_config(_recipe("llama3_8b_128k_v6e.toml")), world_size=256, device_type="tpu")


# --- the planner and the recipe check ------------------------------------------------------------


def _planner_inputs():
    from tools.recipe_check import plan_inputs

    return plan_inputs(build_config(_recipe("llama3_8b_128k_v6e.toml"), [("model.flavor", "debugmodel")]))


def test_the_planner_proposes_only_shapes_torch_tpu_lays_out(monkeypatch):
    target = planner.parse_target("v6e-256")
    topo = tt.topology_of(target)
    cands = planner.recommend(_planner_inputs(), target, tp_choices=[1, 2, 4], cp_choices=[1, 4], ac_modes=("full",))
    assert cands and {c.tp for c in cands} >= {1, 4}
    for c in cands:
        layout = tt.map_mesh(topo, (c.dp_replicate, c.dp_shard, c.cp, c.tp))
        assert layout.split == any("allow_split_physical_axes=True" in n for n in c.notes), (c.tp, c.cp)
    # a layout torch-tpu refused would never be proposed
    real = tt.map_mesh

    def refuse_tp4(topology, shape, **kw):
        if shape[3] == 4:
            raise tt.UnmappableAxis("parallelism.tensor_parallel_degree: tp = 4 ...", axis="tp", size=4, split=True)
        return real(topology, shape, **kw)

    monkeypatch.setattr(tt, "map_mesh", refuse_tp4)
    cands = planner.recommend(_planner_inputs(), target, tp_choices=[1, 2, 4], cp_choices=[1], ac_modes=("full",))
    assert cands and all(c.tp != 4 for c in cands)


def test_recipe_check_reports_the_tpu_mesh_from_the_port_or_torch_tpu():
    from tools.recipe_check import RecipeCheck, tpu_mesh_check

    cfg = build_config(_recipe("llama3_8b_128k_v6e.toml"))
    report = RecipeCheck(recipe="r")
    tpu_mesh_check(cfg, report, None)
    assert report.tpu_mesh == "fsdp 64 <- x[::4]*y (split), cp 4 <- x[:4] (split, no wraparound) [port]"
    assert len(report.notes) == 2
    # torch-tpu's answers (as tools/torch_tpu_mesh.py returns them): the same layout, or another one
    layout = tt.map_mesh(tt.topology_of("v6e-256"), (1, 64, 4, 1))
    ids = np.asarray(layout.device_ids).reshape(-1).tolist()
    case = (tt.topology_of("v6e-256"), (1, 64, 4, 1))
    whole_error = {"error": "NotImplementedError: Failed to find assignment for logical_axis_index 2 of size 4"}
    report = RecipeCheck(recipe="r")
    tpu_mesh_check(cfg, report, {case: {"whole": whole_error, "split": {"ids": ids}, "version": "0.2.0"}})
    assert report.tpu_mesh.endswith("(split, no wraparound) [torch-tpu 0.2.0]")
    report = RecipeCheck(recipe="r")
    tpu_mesh_check(cfg, report, {case: {"whole": whole_error, "split": {"ids": ids[::-1]}, "version": "0.2.0"}})
    assert report.tpu_mesh == "built by torch-tpu 0.2.0 (split axes) [port disagrees]"
    with pytest.raises(ConfigError, match="torch-tpu 0.2.0 cannot lay out the mesh"):
        tpu_mesh_check(
            cfg,
            RecipeCheck(recipe="r"),
            {case: {"whole": whole_error, "split": {"error": "TypeError: x"}, "version": "0.2.0"}},
        )


def test_recipe_check_lays_out_one_slice_of_a_multislice_target():
    """`v6e-256x2` with dp_replicate 2 (one replica per slice): each slice lays out the single-slice
    mesh (dp_replicate 1 x fsdp 256 on the 16x16 grid); the DCN joins the slices. A replicate degree
    the slices do not divide has no per-slice mesh and is left to the rules."""
    from tools.recipe_check import _mesh_case

    cfg = build_config(
        _recipe("llama3_70b_v6e.toml"),
        [
            ("job.target", "v6e-256x2"),
            ("parallelism.data_parallel_replicate_degree", "2"),
            ("parallelism.num_slices", "2"),
        ],
    )
    topology, shape = _mesh_case(cfg)
    assert topology == tt.topology_of("v6e-256")
    assert shape[0] == 1 and shape[0] * shape[1] * shape[2] * shape[3] == 256, shape
    odd = build_config(
        _recipe("llama3_70b_v6e.toml"),
        [("job.target", "v6e-256x2"), ("parallelism.data_parallel_replicate_degree", "1")],
    )
    assert _mesh_case(odd) is None


def test_target_names_read_here_agree_with_the_planner():
    """parallelisms/ sits below the planner, so tpu_topology reads target names itself: the same
    slice as from the planner's parsed Target, for every grid it knows."""
    import planner

    for gen, grids in tt.GRIDS.items():
        for devices in grids:
            name = f"{gen}-{devices * tt.CORES_PER_DEVICE.get(gen, 1)}"
            target = planner.parse_target(name)
            assert target.devices == devices, name
            assert tt.topology_of(name) == tt.topology_of(target), name


# ------------------------------------------------------------------ compact expert-parallel groups


def _coords(topology: tt.Topology, dev: int) -> tuple[int, int, int]:
    X, Y, _ = topology.chips
    chip = dev // topology.devices_per_chip
    return chip % X, chip // X % Y, chip // (X * Y)


@pytest.mark.parametrize(
    "target,ep,tile",
    [("v6e-256", 8, (2, 4, 1)), ("v7x-512", 16, (2, 2, 2)), ("v7x-128", 8, (1, 2, 2)), ("v5p-128", 8, (2, 2, 2))],
)
def test_each_ep_group_is_a_block_of_chips_and_every_device_stays(target, ep, tile):
    """torch-tpu runs an EP group along one ring (EP 8 on v6e-256: 8 chips of a 16-chip row); the
    trainer's layout makes each group (ep consecutive dp_shard ranks) a block: the chips it holds
    span exactly the tile along each axis, both cores of a chip in the same group."""
    topology = tt.topology_of(target)
    shape = (1, topology.devices, 1, 1)
    torch_tpu = tt.map_mesh(topology, shape)
    line = [_coords(topology, d) for d in np.asarray(torch_tpu.device_ids).reshape(-1)[:ep]]
    assert (
        len({c[0] for c in line}) * len({c[1] for c in line}) * len({c[2] for c in line})
        == ep // topology.devices_per_chip
    )
    assert tt.expert_tile(topology, ep) == tile
    compact = tt.trainer_layout(topology, shape, ep=ep)
    ids = np.asarray(compact.device_ids).reshape(-1)
    assert sorted(ids.tolist()) == list(range(topology.devices))
    for g in range(topology.devices // ep):
        chips = {_coords(topology, d) for d in ids[g * ep : (g + 1) * ep]}
        assert len(chips) == ep // topology.devices_per_chip
        spans = tuple(max(c[a] for c in chips) - min(c[a] for c in chips) + 1 for a in range(3))
        assert spans == tile, (g, spans)
    assert "EP groups reordered into" in compact.summary()
    assert tt.trainer_layout(topology, shape, ep=1).device_ids == torch_tpu.device_ids


def test_the_reorder_does_not_apply_beside_other_axes_or_on_a_tray():
    v6e = tt.topology_of("v6e-256")
    assert tt.compact_expert_groups(tt.map_mesh(v6e, (1, 128, 1, 2)), 8) is None  # tp beside dp_shard
    assert tt.compact_expert_groups(tt.map_mesh(v6e, (2, 128, 1, 1)), 8) is None  # dp_replicate on the slice
    small = tt.topology_of("v6e-8")
    assert tt.compact_expert_groups(tt.map_mesh(small, (1, 8, 1, 1)), 4) is None  # tray ring order
    v7x = tt.topology_of("v7x-512")
    assert tt.expert_tile(v7x, 3) is None  # an odd group would split a chip's cores


def test_the_device_order_renumbers_ranks_into_compact_expert_groups_by_the_recipes_target():
    """The trainer's compact EP groups are a device order (device_order.target_order, computed from
    the recipe's target alone: every rank the same): place p of the rank-order mesh is the device
    `order[p]`, so the EP groups of the mesh (dp_shard flattened with cp and tp, then split into
    efsdp x ep, build_ep_mesh's order) are the compact blocks of devices; without EP, on another
    slice or another world it is torch-tpu's own order or refused."""
    from models.errors import ConfigError
    from parallelisms import device_order as do

    topology = tt.topology_of("v7x-512")
    dims = pd.ParallelDims(world_size=512, dp_shard=512, ep=16)
    order = do.resolve_rank_order("v7x-512", dims, device_type="cpu")
    compact = np.asarray(tt.trainer_layout(topology, dims.mesh_shape, ep=16).device_ids)
    device_of = np.asarray(tt.launcher_device_ids(topology))  # the order is in launcher ranks
    assert np.array_equal(device_of[np.asarray(order.order)].reshape(compact.shape), compact)
    groups = device_of[np.asarray(order.order)].reshape(dims.efsdp, dims.ep)
    # v7x-512 is 4 x 8 x 8 chips; blocks in x, then y, then z order: the sixth is x 2-3, y 4-5, z 0-1
    assert {_coords(topology, int(d)) for d in groups[5]} == {(x, y, z) for x in (2, 3) for y in (4, 5) for z in (0, 1)}
    plain = do.resolve_rank_order("v7x-512", pd.ParallelDims(world_size=512, dp_shard=512), device_type="cpu")
    port = np.asarray(tt.map_mesh(topology, dims.mesh_shape).device_ids).reshape(-1)
    assert device_of[list(plain.order)].tolist() == port.tolist()  # no EP: torch-tpu's order as it is
    with pytest.raises(ConfigError, match="parallelism.device_order: v7x-256"):
        do.resolve_rank_order("v7x-256", dims, device_type="cpu")  # not the world's slice


@pytest.mark.parametrize("target", ["v7x-512", "v7x-128", "v6e-256", "v5p-128"])
def test_the_ep_tile_s_busiest_link_is_the_projector_s(target):
    """`expert_tile` ranks blocks by the busiest link of their all-to-all (`_a2a_axis_load`, closed
    form per axis: a line's middle cut, or a whole wrapped axis's ring). For every block of whole
    chips of 8-128 devices, that figure equals the projector's router (tools/xla_projection.py
    `all_to_all_load`, every block's all-to-all at once). EP 32 on v7x-512 takes 4 x 2 x 2 round the
    wrapped 4 (1.0 buffer per link), not 2 x 2 x 4 (2.0), the mean-hops choice before."""
    from tools.xla_projection import all_to_all_load

    topology = tt.topology_of(target)
    X, Y, Z = topology.chips
    p, wrap = topology.devices_per_chip, topology.wrap[:3]
    seen = 0
    for tile in itertools.product(*[[d for d in range(1, n + 1) if n % d == 0] for n in (X, Y, Z)]):
        if not 8 <= math.prod(tile) * p <= 128:
            continue
        groups = [
            [
                (x0 + x, y0 + y, z0 + z, c)
                for x in range(tile[0])
                for y in range(tile[1])
                for z in range(tile[2])
                for c in range(p)
            ]
            for x0 in range(0, X, tile[0])
            for y0 in range(0, Y, tile[1])
            for z0 in range(0, Z, tile[2])
        ]
        closed = max(tt._a2a_axis_load(t, ring=t == n and w, per_chip=p) for t, n, w in zip(tile, (X, Y, Z), wrap))
        assert closed == pytest.approx(all_to_all_load(groups, (X, Y, Z), wrap)), (target, tile)
        seen += 1
    assert seen >= 4
    if target == "v7x-512":
        assert tt.expert_tile(topology, 32) == (4, 2, 2)
