"""A few optimizer steps of Llama 3 (debug flavor, 2 layers) on each mesh match one process.

Same global batch every step, each dp rank its slice; AdamW + global-norm clipping; fp32.
Tolerances: every step's loss within 1e-5 relative; final weights within 1e-5 absolute, i.e.
1 % of one AdamW step (lr 1e-3). Weights are not compared relatively: Adam's first steps
move each element by about lr * sign(grad), so an element whose gradient is a near-zero
result of cancellation turns summation-order noise into an absolute change of up to lr *
(its relative gradient error); eps = 1e-6 (instead of 1e-8) keeps such elements in Adam's
linear regime. Measured (OMP_NUM_THREADS=1): losses <= 1.1e-7 relative, weights <= 6.4e-6.
"""

import pytest
import torch

from parallelisms import ParallelDims, build_mesh, clip_grad_norm_, loss_parallel_context, parallelize_model
from tests.support.parallel_harness import (
    LLAMA3_PLAN,
    RNG_LOCK,
    Llama3,
    batch,
    full,
    llama3_args,
    lm_loss,
    load_full_state,
    reference_state,
    rel_diff,
    run_threads,
)

STEPS = 3
LR, EPS, MAX_NORM = 1e-3, 1e-6, 1.0


def _batches():
    return [batch(4096, batch_size=4, seed=s) for s in range(STEPS)]


def _reference(state):
    model = Llama3(llama3_args())
    model.load_state_dict(state, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, foreach=False)
    losses = []
    for inputs, labels in _batches():
        opt.zero_grad()
        loss = lm_loss(model(inputs), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.detach() for n, p in model.named_parameters()}


def _train_on_rank(world_size, degrees, state, enable_loss_parallel=False, loss_context=False):
    dims = ParallelDims(world_size=world_size, **degrees)
    mesh = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = Llama3(llama3_args())
    parallelize_model(
        model,
        plan=LLAMA3_PLAN,
        parallel_dims=dims,
        mesh=mesh,
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        enable_loss_parallel=enable_loss_parallel,
    )
    model.to_empty(device="cpu")
    with RNG_LOCK, torch.no_grad():
        model.init_weights()  # RoPE buffers; the weights come from `state`
    load_full_state(model, state)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, foreach=False)
    dp_rank, dp_degree = dims.dp_rank(mesh), dims.dp_degree
    losses = []
    for inputs, labels in _batches():
        opt.zero_grad()
        logits = model(inputs.chunk(dp_degree)[dp_rank])
        with loss_parallel_context(loss_context):
            loss = lm_loss(logits, labels.chunk(dp_degree)[dp_rank])
            loss.backward()
        clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(full(loss.detach()))
    # the mean over dp ranks of the per-rank losses is the global-batch loss
    mean = torch.stack(losses).clone()
    torch.distributed.all_reduce(mean)
    mean /= world_size
    return mean, {n: full(p.detach()) for n, p in model.named_parameters()}


MESHES = [
    (2, dict(dp_shard=2)),
    (4, dict(dp_shard=4)),
    (2, dict(dp_shard=1, tp=2)),
    (4, dict(dp_shard=2, tp=2)),
    (4, dict(dp_replicate=2, dp_shard=2)),
    (8, dict(dp_replicate=2, dp_shard=2, tp=2)),  # 3-D: HSDP x TP
]


@pytest.fixture(scope="module")
def reference():
    state = reference_state("llama3", seed=3)
    return state, _reference(state)


@pytest.mark.parametrize("world_size, degrees", MESHES, ids=[str(d) for _, d in MESHES])
def test_steps_match_single_process(reference, world_size, degrees):
    state, (ref_losses, ref_params) = reference
    results = run_threads(world_size, lambda: _train_on_rank(world_size, degrees, state))
    for losses, params in results:
        loss_diff = rel_diff(losses, ref_losses)
        param_diff = max((params[n] - ref_params[n]).abs().max().item() for n in ref_params)
        print(f"{degrees}: loss max rel diff {loss_diff:.2e}, weights max abs diff {param_diff:.2e}")
        assert loss_diff < 1e-5 and param_diff < 1e-5, (loss_diff, param_diff)


def test_loss_parallel_matches(reference):
    """Vocab-sharded logits + loss_parallel give the same training as gathered logits."""
    state, (ref_losses, ref_params) = reference
    # loss_parallel() edits DTensor's global op table on enter and exit, so with thread
    # ranks it is entered once, here, rather than by each rank.
    with loss_parallel_context(True):
        results = run_threads(2, lambda: _train_on_rank(2, dict(dp_shard=1, tp=2), state, enable_loss_parallel=True))
    for losses, params in results:
        assert rel_diff(losses, ref_losses) < 1e-5
        assert max((params[n] - ref_params[n]).abs().max().item() for n in ref_params) < 1e-5
