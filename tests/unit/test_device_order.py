"""The device order (parallelisms/device_order.py): torch-tpu's layouts renumber the processes, the
mesh stays in rank order, and a mesh that breaks the shard invariant is refused at start-up.

- The orders a TPU target gives are torch-tpu's (the port, checked against the wheel in
  tests/xla/test_tpu_topology_ttpu.py): v6e-8 and tpu7x-8's tray rings, v6e-256 and v7x-512's torus
  orders, the compact EP blocks, two slices.
- Bad values of `[parallelism] device_order` are one ConfigError naming the key.
- A mesh over a layout's rank grid (what build_mesh built on a TPU before) is refused on the axis
  whose group is out of rank order; the product's meshes (world, dp, dp_shard_cp, expert) pass.
- The four faults of tpu_first_contact.md N11 (permuted checkpoints, permuted initial loads, experts
  detached from their dispatch, uneven shards failing in the backward) hold on 8 gloo processes in
  torch-tpu's v6e-8 order with the product's renumbering (tests/support/device_order_faults.py;
  the same script on a checkout before the change shows all four).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from models.errors import ConfigError
from parallelisms import device_order as do
from parallelisms import tpu_topology as tt
from parallelisms.parallel_dims import MESH_AXES, ParallelDims, build_mesh, flat_dp_mesh
from tests.support.parallel_harness import run_threads

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _order(spec: str, world: int, **degrees) -> do.RankOrder:
    return do.resolve_rank_order(spec, ParallelDims(world_size=world, **degrees), device_type="cpu")


def test_a_targets_order_is_torch_tpus_layout():
    # the wheel's create_device_mesh on stand-in devices (tpu_first_contact.md N11)
    assert _order("v6e-8", 8).order == (0, 1, 2, 3, 7, 6, 5, 4)
    assert _order("tpu7x-8", 8).order == (0, 1, 2, 3, 6, 7, 4, 5)
    # on a pod the order is in launcher ranks: host h's processes are ranks 4h..4h+3, its 2 x 2 chips,
    # hosts numbered by position (tpu_topology.launcher_device_ids); torch-tpu's device order
    # [0, 16, 32, 48, ...] (x fastest over the 16 x 16 chips) is launcher ranks [0, 2, 32, 34, ...]
    v6e = tt.topology_of("v6e-256")
    device_of = tt.launcher_device_ids(v6e)
    assert [device_of[r] for r in _order("v6e-256", 256).order[:4]] == [0, 16, 32, 48]
    assert _order("v6e-256", 256).order[:4] == (0, 2, 32, 34)
    v7x = tt.topology_of("v7x-512")
    assert [tt.launcher_device_ids(v7x)[r] for r in _order("v7x-512", 512).order[:4]] == [0, 1, 64, 65]
    # how many processes the order renumbers (tpu_first_contact.md N11: 254 of 256, 224 with the
    # compact EP groups, 504 of 512)
    assert (_order("v6e-256", 256).renumbered, _order("v6e-256", 256, ep=8).renumbered) == (254, 224)
    assert _order("v7x-512", 512).renumbered == 504
    # compact EP groups: each run of 8 places is a 2 x 4 block of v6e-256's 16 x 16 chips
    groups = np.asarray(_order("v6e-256", 256, ep=8).order).reshape(-1, 8)
    for group in groups[:3]:
        chips = [device_of[int(r)] for r in group]
        xs, ys = {d % 16 for d in chips}, {d // 16 for d in chips}
        assert len(xs) * len(ys) == 8 and max(xs) - min(xs) < len(xs) and max(ys) - min(ys) < len(ys), group
    # the launcher's ranks: host by host, each host's 2 x 2 chips x fastest, hosts x fastest
    assert device_of[:8] == [0, 1, 16, 17, 2, 3, 18, 19] and sorted(device_of) == list(range(256))
    assert tt.launcher_device_ids(tt.topology_of("v6e-8")) == list(range(8))  # one host
    # two slices: each laid out as one, slice-major (the DCN split on dp_replicate)
    two = _order("v6e-8", 16, dp_replicate=2, num_slices=2)
    assert two.order == (0, 1, 2, 3, 7, 6, 5, 4, 8, 9, 10, 11, 15, 14, 13, 12)
    # identity and auto off a TPU renumber nothing; a permutation is taken as given
    assert _order("identity", 8).renumbered == _order("auto", 8).renumbered == 0
    order = _order("3,1,0,2", 4)
    assert (order.process_rank(3), order.launcher_rank(0), order.renumbered) == (0, 3, 3)


@pytest.mark.parametrize(
    "spec, world, degrees, message",
    [
        ("v6e-9", 8, {}, "'v6e-9' is not a device order; allowed: identity, auto"),
        ("sideways", 8, {}, "'sideways' is not a device order"),
        ("v6e-8", 4, {}, r"v6e-8 \(8 devices\) does not match this world: 4 ranks"),
        ("0,1,1,2", 4, {}, "is not a permutation of the 4 ranks 0..3"),
        ("0,1,2", 4, {}, "is not a permutation of the 4 ranks"),
        ("2,1,0,3", 4, dict(dp_replicate=2, num_slices=2), "moves a rank to another slice"),
    ],
    ids=["unknown-target", "unknown-word", "target-of-another-size", "repeated-rank", "short", "across-slices"],
)
def test_bad_device_orders_are_refused_naming_the_key(spec, world, degrees, message):
    with pytest.raises(ConfigError, match=message) as e:
        _order(spec, world, **degrees)
    assert str(e.value).startswith("parallelism.device_order: ") and "allowed:" in str(e.value)


def test_the_recipe_check_reads_the_keys_syntax():
    from trainer.config import build_config

    with pytest.raises(ConfigError, match="parallelism.device_order: 'v6e-8x' is not a device order"):
        build_config("configs/llama3_debug.toml", [("parallelism.device_order", "v6e-8x")])
    assert build_config("configs/llama3_debug.toml", [("parallelism.device_order", "tpu7x-8")])


def _layout_mesh(order, shape):
    mesh = DeviceMesh("cpu", torch.tensor(order).reshape(shape), mesh_dim_names=MESH_AXES)
    return {"world": mesh, "dp": flat_dp_mesh(mesh)}


def test_a_mesh_in_a_layouts_order_is_refused_on_the_axis_it_permutes():
    """What build_mesh built on a TPU before: DeviceMesh over torch-tpu's rank grid. The 1-D FSDP
    world (v6e-8's tray ring) breaks dp_shard; with tp 2 the v6e-8 grid breaks the tp pairs it
    reverses. Every rank refuses alike (the verdict is read off the grids all ranks hold)."""
    v6e8 = _order("v6e-8", 8).order

    def body():
        errors = []
        for shape in [(1, 8, 1, 1), (1, 4, 1, 2)]:
            try:
                do.check_mesh_order(_layout_mesh(v6e8, shape))
            except ConfigError as e:
                errors.append(str(e))
        try:
            do.shard_rank(_layout_mesh(v6e8, (1, 8, 1, 1))["world"], "dp_shard")
        except AssertionError as e:
            assert "group rank" in str(e) and "!= coordinate" in str(e)
            return errors, True
        return errors, False

    results = run_threads(8, body)
    assert all(r[0] == results[0][0] for r in results)
    # shard_rank refuses where coordinate and group rank differ: ranks 4..7 sit at places 7..4
    assert [guarded for _, guarded in results] == [False] * 4 + [True] * 4
    flat, tp = results[0][0]
    assert "world.dp_shard (a group [0, 1, 2, 3, 7, 6, 5, 4] out of rank order)" in flat
    assert "world.tp (a group [7, 6] out of rank order)" in tp
    assert flat.startswith("parallelism.device_order: ") and "allowed: " in flat


@pytest.mark.parametrize(
    "degrees",
    [
        dict(dp_shard=8),
        dict(dp_replicate=2, dp_shard=2, tp=2),
        dict(dp_shard=2, cp=2, tp=2),
        dict(dp_shard=8, ep=4),
        dict(dp_replicate=2, dp_shard=2, cp=2, ep=2),
    ],
    ids=["fsdp", "hsdp_tp", "fsdp_cp_tp", "ep4", "hsdp_cp_ep"],
)
def test_the_products_meshes_keep_the_invariant_on_every_axis(degrees):
    """build_mesh's own check passes and counts every axis of world, dp, dp_shard_cp and the
    expert mesh; every rank's shard index equals its coordinate on each of them."""
    dims = ParallelDims(world_size=8, **degrees)

    def body():
        mesh = build_mesh(dims, "cpu")
        meshes = {"world": mesh, "dp": flat_dp_mesh(mesh)}
        if dims.ep_enabled:
            from parallelisms.parallel_dims import build_ep_mesh

            meshes["expert"] = build_ep_mesh(dims, mesh)
        assert build_ep_mesh_once(dims, mesh)
        return do.check_mesh_order(meshes)

    def build_ep_mesh_once(dims, mesh):
        from parallelisms.parallel_dims import build_ep_mesh

        return not dims.ep_enabled or build_ep_mesh(dims, mesh) is build_ep_mesh(dims, mesh)

    checked = run_threads(8, body)
    assert checked[0] == 4 + 1 + (3 if dims.ep_enabled else 0)


def _faults(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "support", "device_order_faults.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )


@pytest.mark.multiprocess
def test_checkpoints_initial_loads_experts_and_uneven_shards_hold_in_torch_tpus_order():
    """8 gloo processes in v6e-8's order, the product's renumbering and build_mesh: the DCP
    checkpoint reads back in one process as rows 0..15, the initial load computes with them, each
    rank holds the experts its dispatch is sent, the 13-row weight's gradient is whole. On a
    checkout before the device order (`--mesh layout`) all four fail; here that mesh is refused."""
    product = _faults("--order", "v6e-8", "--mesh", "product")
    assert product.returncode == 0, product.stdout[-3000:] + product.stderr[-3000:]
    assert [line.split()[1] for line in product.stdout.splitlines()[1:] if not line.startswith(" ")] == ["holds"] * 4


def test_auto_on_a_tpu_takes_the_slices_layout_when_it_is_known():
    from parallelisms.parallel_dims import tpu_mesh_layout

    dims = ParallelDims(world_size=8, dp_shard=8)
    known = do.resolve_rank_order(
        "auto", dims, device_type="tpu", tpu_layout=lambda: tpu_mesh_layout(dims, target="v6e-8", env={})
    )
    assert known.order == (0, 1, 2, 3, 7, 6, 5, 4) and "torch-tpu's order on v6e-8" in known.source
    unknown = do.resolve_rank_order(
        "auto", dims, device_type="tpu", tpu_layout=lambda: tpu_mesh_layout(dims, target=None, env={})
    )
    assert unknown.renumbered == 0 and "unknown before the process group" in unknown.source
    assert do.resolve_rank_order("auto", dims, device_type="cuda").source == "identity (auto on cuda)"


def test_torch_tpus_own_layout_is_compared_with_the_meshs_groups(capsys, monkeypatch):
    """After the process group, torch-tpu's `topology_aware_mesh` (in process-group ranks) is
    compared with the rank-order mesh: the same groups when the renumbering followed the devices,
    a named difference otherwise; the mesh is never changed by it."""
    from parallelisms import parallel_dims as pd

    monkeypatch.setattr(pd.distributed, "rank", lambda: 0)
    ranks = torch.arange(8).reshape(1, 4, 1, 2)
    order = _order("v6e-8", 8, tp=2)
    pd._compare_with_torch_tpu(ranks, torch.arange(8).reshape(1, 4, 1, 2), order, None)
    assert "the process groups are torch-tpu's own on every axis" in capsys.readouterr().out
    # the layout torch-tpu gives when the processes were not renumbered: v6e-8's tray ring
    pd._compare_with_torch_tpu(ranks, torch.tensor(order.order).reshape(1, 4, 1, 2), None, None)
    out = capsys.readouterr().out
    # its tp pairs {7, 6} and {5, 4} are the same sets as the mesh's; the dp_shard groups are not
    assert "the groups of dp_shard differ from torch-tpu's layout (the launcher's order)" in out
