"""Layer scan's dp gather with uneven shards (parallelisms/scan.py `GatherShard`).

SimpleFSDP shards like `torch.chunk`: a Qwen 3 q_norm weight of 128 rows over 256 ranks leaves
ranks 128-255 empty. The scan body's gather pads every shard to the chunk size for the
equal-split collectives and cuts the result back; the pod recipes with scan at 256 devices need
it (tools/recipe_check.py found them refused before).
"""

import pytest
import torch
import torch.distributed as dist

from tests.support.parallel_harness import run_threads


@pytest.mark.parametrize("rows,world_size", [(5, 3), (4, 3), (1, 2)], ids=["5-over-3", "4-over-3", "1-over-2"])
@pytest.mark.parametrize("dim", [0, 1])
def test_gather_of_uneven_shards_is_the_full_tensor_and_its_gradient_the_mean(rows, world_size, dim):
    """Forward: exactly the full tensor (padding never shows); backward: each rank's rows of the
    mean of the ranks' gradients (exact up to one fp32 reduce-scatter; empty shards get empty
    gradients)."""
    from parallelisms.scan import GatherShard

    shape = [rows, 3] if dim == 0 else [2, rows]
    full = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(world_size)]

    def rank_fn():
        rank = dist.get_rank()
        group = (dist.group.WORLD.group_name, world_size)
        chunks = full.chunk(world_size, dim=dim)
        shard = (chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)).clone().requires_grad_()
        out = GatherShard.apply(shard, group, (), None, None, dim, rows)
        out.backward(grads[rank])
        return out.detach(), shard.grad

    mean = sum(grads) / world_size
    mean_chunks = mean.chunk(world_size, dim=dim)
    for rank, (out, grad) in enumerate(run_threads(world_size, rank_fn)):
        assert torch.equal(out, full)
        want = mean_chunks[rank] if rank < len(mean_chunks) else mean.narrow(dim, 0, 0)
        assert grad.shape == want.shape
        torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-7)
