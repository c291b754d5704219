"""The four faults of a mesh laid out in torch-tpu's device order (tpu_first_contact.md N11), on CPU
gloo processes with the product's own code, and the product's answer to them.

    PYTHONPATH=. python tests/support/device_order_faults.py [--order v6e-8|tpu7x-8|v6e-32|0,1,3,2|random:SEED]
        [--world 8] [--ep N] [--mesh product|layout]

`--mesh layout` builds what `build_mesh` built on a TPU before the device order existed:
`DeviceMesh` over the layout's rank grid (launcher rank = process-group rank = device id), where a
rank's coordinate differs from its group rank. `--mesh product` does what the trainer does now:
process `order[p]` joins the process group as rank p and `build_mesh` lays the ranks out in order.
Run against an older checkout (`PYTHONPATH=<old tree> python tests/support/device_order_faults.py
--mesh layout`) it shows the faults; on this one the layout mesh is refused at start-up (exit 2).

The experiments (1-D FSDP over the world, `2 x world` rows, row i holding i):
- checkpoint: SimpleFSDP weight saved with DCP by every rank, read back in one process
  (what scripts/convert.py does): the rows must come back in order;
- hf_load: the weight loaded rank by rank through `local_box` (the initial HF/DCP load), the model's
  forward reads the rows it computes with;
- experts: `world` experts over EP `world / 2` (`--ep`): the experts a rank holds (`distribute_tensor`, by
  coordinate) must be the ones the dispatch sends it (its group rank);
- uneven: a `world + world / 2 + 1`-row weight (the last shards short or empty) through forward and
  backward; its gradient must be whole.
Exit status: 0 all hold, 1 a fault, 2 the mesh was refused.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXPERIMENTS = ("checkpoint", "hf_load", "experts", "uneven")

# The checkout on PYTHONPATH is imported alone: the editable install's finder would otherwise supply
# the modules an older checkout lacks (e.g. parallelisms.device_order) from this one.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]


def _layout_order(name: str, world: int, ep: int = 1) -> list[int]:
    """The layout's order: a TPU target's (with its compact EP groups for `ep`, as the trainer lays
    them out; computed by the port of this checkout), a permutation, or `random:SEED`."""
    import random

    import numpy as np

    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.tpu_topology import topology_of, trainer_layout

    if "," in name:
        return [int(x) for x in name.split(",")]
    if name.startswith("random:"):
        order = list(range(world))
        random.Random(int(name.split(":", 1)[1])).shuffle(order)
        return order
    name = name.replace("tpu7x-", "v7x-")  # torch-tpu's name of the generation
    dims = ParallelDims(world_size=world, dp_shard=world, ep=ep)
    return [
        int(d) for d in np.asarray(trainer_layout(topology_of(name), dims.mesh_shape, ep=ep).device_ids).reshape(-1)
    ]


def _mesh(order: list[int], mode: str, *, ep: int = 1):
    from torch.distributed.device_mesh import DeviceMesh

    from parallelisms.parallel_dims import MESH_AXES, ParallelDims, build_mesh, flat_dp_mesh

    world = len(order)
    dims = ParallelDims(world_size=world, dp_shard=world, ep=ep)
    if mode == "product":
        return dims, build_mesh(dims, "cpu")
    mesh = DeviceMesh("cpu", torch.tensor(order).reshape(dims.mesh_shape), mesh_dim_names=MESH_AXES)
    flat_dp_mesh(mesh)
    return dims, mesh


def _fsdp_linear(mesh, rows: int, cols: int = 1, fill: torch.Tensor | None = None):
    from parallelisms.simple_fsdp import data_parallel

    lin = torch.nn.Linear(cols, rows, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.zeros(rows, cols) if fill is None else fill)
    data_parallel(lin, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    return lin


def checkpoint(order, mode, folder) -> tuple[list, list]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, mesh = _mesh(order, mode)
    rows = 2 * len(order)
    lin = _fsdp_linear(mesh, rows, fill=torch.arange(rows, dtype=torch.float32).view(rows, 1))
    dcp.save({"w": lin.state_dict()["weight"]}, checkpoint_id=os.path.join(folder, "ckpt"))
    dist.barrier()
    got = None
    if dist.get_rank() == 0:
        dcp_to_torch_save(os.path.join(folder, "ckpt"), os.path.join(folder, "full.pt"))
        got = torch.load(os.path.join(folder, "full.pt"))["w"].view(-1).int().tolist()
    dist.barrier()
    return got, list(range(rows))


def hf_load(order, mode, folder) -> tuple[list, list]:
    from torch.distributed.tensor import DTensor

    from trainer.checkpoint.initial import local_box

    _, mesh = _mesh(order, mode)
    rows = 2 * len(order)
    full = torch.arange(rows, dtype=torch.float32).view(rows, 1)
    lin = _fsdp_linear(mesh, rows)
    for param in lin.parameters():
        assert isinstance(param, DTensor)
        (offset, _), (size, _) = local_box(param)
        with torch.no_grad():
            param.to_local().copy_(full[offset : offset + size])
    with torch.no_grad():
        got = lin(torch.ones(1, 1)).view(-1).int().tolist()
    return got, list(range(rows))


def experts(order, mode, folder) -> tuple[list, list]:
    from torch.distributed.tensor import Shard, distribute_tensor

    from parallelisms.parallel_dims import build_ep_mesh

    world = len(order)
    dims, mesh = _mesh(order, mode, ep=int(os.environ.get("TITAN_FAULTS_EP", world // 2)))
    ep_mesh = build_ep_mesh(dims, mesh)["ep"]
    num_experts = world
    held = distribute_tensor(
        torch.arange(num_experts, dtype=torch.float32).view(num_experts, 1), ep_mesh, [Shard(0)], src_data_rank=None
    ).to_local()
    per = num_experts // ep_mesh.size()
    sent = ep_mesh.get_local_rank()  # the rank the dispatch's all-to-all sends experts sent*per.. to
    return held.view(-1).int().tolist(), list(range(sent * per, (sent + 1) * per))


def uneven(order, mode, folder) -> tuple[list, list]:
    world = len(order)
    rows = world + world // 2 + 1
    _, mesh = _mesh(order, mode)
    lin = _fsdp_linear(mesh, rows, cols=2)
    try:
        lin(torch.ones(1, 2)).sum().backward()
    except RuntimeError as e:
        return [f"backward failed: {str(e).splitlines()[0][:90]}"], ["a whole gradient"]
    param = lin._parameters["weight"]  # the stored shard (`lin.weight` would gather it)
    local = param.grad.to_local()
    return [int(x) for x in local.sum(dim=1).tolist()], [2] * param.to_local().shape[0]


def _worker(launcher: int, order: list[int], mode: str, init_file: str, folder: str) -> None:
    torch.set_num_threads(1)
    world = len(order)
    rank = order.index(launcher) if mode == "product" else launcher
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        if mode == "layout":
            try:  # the product's start-up check, where this checkout has one
                from parallelisms.device_order import check_mesh_order
            except ImportError:
                check_mesh_order = None
            if check_mesh_order is not None:
                from models.errors import ConfigError
                from parallelisms.parallel_dims import flat_dp_mesh

                try:
                    _, mesh = _mesh(order, mode)  # DeviceMesh itself accepts any grid
                    check_mesh_order({"world": mesh, "dp": flat_dp_mesh(mesh)})
                except ConfigError as e:
                    results["refused"] = str(e)
        if "refused" not in results:
            for name in EXPERIMENTS:
                sub = os.path.join(folder, name)
                os.makedirs(sub, exist_ok=True)
                try:
                    results[name] = globals()[name](order, mode, sub)
                except AssertionError as e:  # the product's shard_rank guard on a permuted mesh
                    results[name] = ([f"refused: {e}"], ["-"])
        torch.save({"rank": rank, "launcher": launcher, **results}, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run(order: list[int], mode: str) -> tuple[int, list[str]]:
    """Run the experiments on `len(order)` processes; (exit status, report lines)."""
    world = len(order)
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(order, mode, os.path.join(folder, "pg"), folder), nprocs=world)
        ranks = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    if "refused" in ranks[0]:
        return 2, [f"error: {ranks[0]['refused']}"]
    lines, status = [f"mesh {mode}, order {order}"], 0
    for name in EXPERIMENTS:
        bad = []
        for r in ranks:
            got, want = r[name]
            if got is not None and got != want:
                bad.append((r["rank"], r["launcher"], got, want))
        status = status or int(bool(bad))
        lines.append(f"{name:10s} {'FAULT' if bad else 'holds'}")
        for rank, launcher, got, want in bad[:4]:
            lines.append(f"    rank {rank} (launcher {launcher}): got {got}, want {want}")
    return status, lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--order", default="v6e-8", help="a TPU target of 8 devices or a permutation (default v6e-8)")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--mesh", choices=("product", "layout"), default="product")
    parser.add_argument("--ep", type=int, default=0, help="EP degree of the experts experiment (default world / 2)")
    args = parser.parse_args(argv)
    ep = args.ep or args.world // 2
    os.environ["TITAN_FAULTS_EP"] = str(ep)  # the spawned processes read it
    status, lines = run(_layout_order(args.order, args.world, ep), args.mesh)
    print("\n".join(lines), file=sys.stderr if status == 2 else sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
