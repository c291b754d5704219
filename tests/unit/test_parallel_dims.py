"""ParallelDims: degree resolution, validation errors, the named meshes (fake process group)."""

import dataclasses

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from models.errors import ConfigError
from models.llama3 import FLAVORS as LLAMA3
from models.qwen3 import FLAVORS as QWEN3
from parallelisms import ParallelDims, build_ep_mesh, build_mesh, flat_dp_mesh


def test_dp_shard_fills_the_world():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=16)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 4, 2)
    assert dims.dp_degree == 8 and dims.non_data_parallel_size == 2
    assert dims.dp_shard_enabled and dims.dp_replicate_enabled and dims.tp_enabled
    assert not dims.ep_enabled
    single = ParallelDims(world_size=1)
    assert (single.dp_shard, single.dp_degree, single.dp_enabled) == (1, 1, False)
    assert single.dp_rank(None) == 0


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(dp_shard=3, world_size=4), "data_parallel_shard_degree (3)"),
        (dict(dp_shard=2, tp=3, world_size=4), "tensor_parallel_degree (3)"),
        (dict(dp_replicate=3, dp_shard=-1, world_size=4), "parallelism.data_parallel_shard_degree: -1"),
        (dict(tp=0, world_size=4), "parallelism.tensor_parallel_degree: must be"),
        (dict(dp_shard=-2, world_size=4), "parallelism.data_parallel_shard_degree: must be"),
        (dict(dp_replicate=0, world_size=4), "parallelism.data_parallel_replicate_degree: must be"),
        (dict(dp_shard=2, tp=2, ep=3, world_size=4), "parallelism.expert_parallel_degree: 3 must divide"),
        (dict(cp=0, world_size=4), "parallelism.context_parallel_degree: must be"),
        (dict(dp_shard=2, cp=3, world_size=4), "context_parallel_degree (3)"),
        (dict(cp=3, dp_shard=-1, world_size=4), "context_parallel_degree (3) x tensor_parallel_degree (1) = 3"),
    ],
)
def test_bad_degrees_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match="parallelism") as info:
        ParallelDims(**kwargs)
    assert key in str(info.value)


def test_constructor_is_keyword_only():
    with pytest.raises(TypeError):
        ParallelDims(1, 2, 1, 1, 2)  # type: ignore[misc]


def test_validate_for_model():
    llama = dataclasses.replace(LLAMA3["debugmodel"], max_seq_len=64)  # 16 heads, 4 kv heads
    ParallelDims(dp_shard=2, tp=4, world_size=8).validate_for_model(llama.shape(), seq_len=64)
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree: 8 does not divide the model's n_kv_heads \(4\)"):
        ParallelDims(dp_shard=1, tp=8, world_size=8).validate_for_model(llama.shape(), seq_len=64)
    with pytest.raises(ConfigError, match=r"n_heads \(16\)"):
        ParallelDims(dp_shard=1, tp=3, world_size=3).validate_for_model(llama.shape(), seq_len=64)
    with pytest.raises(ConfigError, match="sequence length"):
        ParallelDims(dp_shard=1, tp=4, world_size=4).validate_for_model(llama.shape(), seq_len=30)
    # heads and kv heads divide by 3, the FFN width does not
    qwen = dataclasses.replace(QWEN3["debugmodel"], n_heads=12, n_kv_heads=6, hidden_dim=770, max_seq_len=60)
    with pytest.raises(ConfigError, match=r"FFN hidden size \(770\)"):
        ParallelDims(dp_shard=1, tp=3, world_size=3).validate_for_model(qwen.shape(), seq_len=60)
    with pytest.raises(ConfigError, match="expert_parallel_degree: 2 > 1 but the model has no experts"):
        ParallelDims(dp_shard=2, ep=2, world_size=2).validate_for_model(llama.shape(), seq_len=64)
    moe = QWEN3["debugmodel_moe"]  # 8 experts
    ParallelDims(dp_shard=4, ep=4, world_size=4).validate_for_model(moe.shape(), seq_len=64)
    with pytest.raises(ConfigError, match=r"does not divide the number of experts \(8\)"):
        ParallelDims(dp_shard=6, ep=3, world_size=6).validate_for_model(moe.shape(), seq_len=64)


@pytest.fixture
def fake_world():
    def init(rank: int, world_size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "rank, coordinate, dp_rank", [(0, (0, 0, 0, 0), 0), (5, (1, 0, 0, 1), 2), (6, (1, 1, 0, 0), 3)]
)
def test_mesh_axes_and_dp_rank(fake_world, rank, coordinate, dp_rank):
    fake_world(rank, 8)
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, ep=2, world_size=8)
    mesh = build_mesh(dims, "cpu")
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp")
    assert mesh.get_coordinate() == coordinate
    assert dims.dp_rank(mesh) == dp_rank
    # TP ranks of one dp group read the same data; the flattened dp axis agrees.
    assert flat_dp_mesh(mesh).get_local_rank() == dp_rank
    assert mesh["tp"].mesh.tolist() == [rank - rank % 2, rank - rank % 2 + 1]
    ep_mesh = build_ep_mesh(dims, mesh)
    assert ep_mesh.mesh_dim_names == ("dp_replicate", "efsdp", "ep")
    assert ep_mesh.mesh.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_ep_mesh_spans_dp_shard_and_tp(fake_world):
    fake_world(3, 8)
    dims = ParallelDims(dp_shard=-1, tp=2, ep=4, world_size=8)
    assert dims.efsdp == 2
    ep_mesh = build_ep_mesh(dims, build_mesh(dims, "cpu"))
    assert ep_mesh.mesh.tolist() == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert ep_mesh["ep"].mesh.tolist() == [0, 1, 2, 3]


def test_cp_axis(fake_world):
    """cp sits between dp_shard and tp; its ranks share a dp rank; EP borrows from dp_shard x cp x tp."""
    fake_world(5, 8)
    dims = ParallelDims(dp_shard=-1, cp=2, tp=2, ep=4, world_size=8)
    assert (dims.dp_shard, dims.non_data_parallel_size, dims.efsdp, dims.cp_enabled) == (2, 4, 2, True)
    mesh = build_mesh(dims, "cpu")
    assert mesh.get_coordinate() == (0, 1, 0, 1)
    assert mesh["cp"].mesh.tolist() == [5, 7] and mesh["tp"].mesh.tolist() == [4, 5]
    assert dims.dp_rank(mesh) == 1
    assert build_ep_mesh(dims, mesh)["ep"].mesh.tolist() == [4, 5, 6, 7]
    llama = dataclasses.replace(LLAMA3["debugmodel"], max_seq_len=64)
    dims = dataclasses.replace(dims, ep=1)
    dims.validate_for_model(llama.shape(), seq_len=64)
    with pytest.raises(ConfigError, match=r"context_parallel_degree: 2 needs a sequence length divisible by 2 x 2 = 4"):
        dims.validate_for_model(llama.shape(), seq_len=30)
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree: 4 does not divide the sequence length per context"):
        ParallelDims(dp_shard=1, cp=2, tp=4, world_size=8).validate_for_model(llama.shape(), seq_len=12)


def test_mesh_size_must_match_process_group(fake_world):
    fake_world(0, 4)
    with pytest.raises(ConfigError, match="world size 8"):
        build_mesh(ParallelDims(dp_shard=8, world_size=8), "cpu")


def test_tp_needs_every_block_parameter_in_the_plan():
    """A block parameter without a TP (or EP) style under tp > 1 is a clear ConfigError:
    here Qwen 3 MoE blocks with the plan's EP entries removed."""
    import dataclasses as dc

    import torch

    from models.qwen3 import Transformer
    from models.qwen3.plan import PLAN
    from parallelisms import parallelize_model
    from tests.support.parallel_harness import run_threads

    args = dc.replace(QWEN3["debugmodel_moe"], n_layers=1, max_seq_len=16)
    plan = dc.replace(PLAN, ep_block={})

    def rank_fn():
        dims = ParallelDims(dp_shard=1, tp=2, world_size=2)
        with torch.device("meta"):
            model = Transformer(args)
        try:
            parallelize_model(model, plan=plan, parallel_dims=dims, mesh=build_mesh(dims, "cpu"))
        except ConfigError as exc:
            return str(exc)
        return None

    for message in run_threads(2, rank_fn):
        assert message is not None and message.startswith("parallelism.tensor_parallel_degree:")
        assert "layers.0.moe." in message
