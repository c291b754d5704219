"""The once-per-step gradient mean over dp_replicate (`training.replicate_reduce = "step"`,
parallelisms/replicate_reduce.py) on thread ranks: HSDP 2 x 2 (dp_replicate x dp_shard), Llama 3
debug (2 layers), fp32, two micro-batches accumulated.

- fp32: the gradients equal the per-micro-batch reduction's (the default) up to summation order.
  Both are the mean of the same 8 per-sequence-pair gradients, summed in another order; fp32
  summation of a handful of terms differs by a few ulps of the largest term, so the bound is
  1e-6 x max |g| per tensor (measured: see the printed line).
- bf16 on the wire with fp32 accumulation: per element, |mean_bf16 - m| <= u (1 + u) mean_r |g_r|
  + u |m| + 1e-6 max |g|, u = 2^-8, g_r the replica-local gradients before the mean and m their fp32 mean
  (the module docstring's bound; the last term the fp32 order slack above). Every replica ends
  with the same bytes.
- The eager reducer issues every bucket from the backward's hooks, the first before the
  backward's last gradient is final (it overlaps the backward).
- Graph mode's `reduce_grads` gives the eager reducer's values.
"""

import pytest
import torch

from parallelisms import ParallelDims
from parallelisms.replicate_reduce import BF16_UNIT_ROUNDOFF, ReplicateReducer, canonical, deferred_meshes, reduce_grads
from tests.support.parallel_harness import (
    LLAMA3_PLAN,
    Llama3,
    batch,
    full,
    llama3_args,
    lm_loss,
    parallel_fp32_model,
    reference_state,
    run_threads,
)

WORLD, DEGREES = 4, dict(dp_replicate=2, dp_shard=2)


@pytest.fixture(scope="module")
def state():
    return reference_state("llama3", seed=5)


def _model(state, mode: str):
    dims = ParallelDims(world_size=WORLD, **DEGREES)
    model, mesh = parallel_fp32_model(Llama3, llama3_args(), LLAMA3_PLAN, dims, state, replicate_reduce=mode)
    return model, dims.dp_rank(mesh), dims.dp_degree


def _backward(model, dp_rank, dp_degree, reducer=None, events=None):
    """Two micro-batches of 2 sequences per dp rank (a global batch of 16), mean loss."""
    inputs, labels = batch(4096, batch_size=4 * dp_degree, seed=11)
    micro = list(zip(inputs.chunk(dp_degree)[dp_rank].chunk(2), labels.chunk(dp_degree)[dp_rank].chunk(2)))
    for i, (x, y) in enumerate(micro):
        if reducer is not None and i == len(micro) - 1:
            reducer.arm()
        (lm_loss(model(x), y) / len(micro)).backward()
    if events is not None:
        events.append(("backward done", reducer._next if reducer is not None else None))


def _run(state, mode: str, dtype=torch.float32, bucket_mb: float = 0.05):
    model, dp_rank, dp_degree = _model(state, mode)
    reducer = ReplicateReducer(model, dtype=dtype, bucket_mb=bucket_mb) if mode == "step" else None
    events = []
    issued_at = []
    if reducer is not None:
        issue = reducer._issue

        def traced(bucket):  # how many gradients were final (hooks fired) when each bucket was issued
            issued_at.append(sum(reducer._final))
            issue(bucket)

        reducer._issue = traced
    _backward(model, dp_rank, dp_degree, reducer, events)
    local = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    if reducer is not None:
        reducer.finish()
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    mine = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    return dict(
        grads=grads,
        local=local,
        mine=mine,
        issued_at=issued_at,
        n_buckets=len(reducer.buckets) if reducer else 0,
        n_params=len(list(model.parameters())),
    )


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_once_per_step_equals_the_per_micro_batch_reduction(state):
    base = run_threads(WORLD, lambda: _run(state, "micro_batch"))
    step = run_threads(WORLD, lambda: _run(state, "step"))
    worst = max(_rel(s["grads"][n], b["grads"][n]) for s, b in zip(step, base) for n in b["grads"])
    print(f"replicate_reduce step vs micro_batch, fp32: max rel gradient difference {worst:.2e}")
    assert worst < 1e-6
    # Without the deferral the per-micro-batch gradients would be reduced already: the replica-local
    # gradients before finish() differ between replicas (ranks 0 and 2 hold the same shard).
    assert _rel(step[0]["local"]["output.weight"], step[2]["local"]["output.weight"]) > 1e-3


def test_buckets_are_issued_during_the_backward(state):
    results = run_threads(WORLD, lambda: _run(state, "step"))
    for r in results:
        assert r["n_buckets"] > 2, r["n_buckets"]
        assert len(r["issued_at"]) == r["n_buckets"]  # every bucket from a hook, none left for finish
        # the first bucket went out while most gradients were not yet final
        assert r["issued_at"][0] < r["n_params"] // 2, r["issued_at"]


def test_bf16_on_the_wire_with_fp32_accumulation_is_within_its_bound(state):
    step = run_threads(WORLD, lambda: _run(state, "step"))
    bf16 = run_threads(WORLD, lambda: _run(state, "step", torch.bfloat16))
    u = BF16_UNIT_ROUNDOFF
    worst = 0.0
    for shard in range(2):  # ranks `shard` and `2 + shard` are the replicas of one shard
        a, b = bf16[shard], bf16[2 + shard]
        for n in a["mine"]:
            assert torch.equal(a["mine"][n], b["mine"][n]), n  # replicas end with the same bytes
            g0, g1 = a["local"][n], b["local"][n]
            m = (g0 + g1) / 2
            assert torch.allclose(m, step[shard]["mine"][n], rtol=0, atol=1e-6 * m.abs().max().item())
            # u(1 + u): the mean's rounding also sees the first rounding's error (u x mean |g_r|)
            bound = u * (1 + u) * (g0.abs() + g1.abs()) / 2 + u * m.abs() + 1e-6 * m.abs().max()
            err = (a["mine"][n] - m).abs()
            assert (err <= bound).all(), (n, (err - bound).max().item())
            worst = max(worst, (err / bound.clamp_min(1e-30)).max().item())
    loose = max(_rel(b["grads"][n], s["grads"][n]) for b, s in zip(bf16, step) for n in s["grads"])
    print(f"bf16 wire: max error / bound {worst:.2f}; max rel gradient difference vs fp32 {loose:.2e}")
    assert loose > 0  # it did round


def test_graph_reduce_equals_the_eager_reducer(state):
    def body():
        model, dp_rank, dp_degree = _model(state, "step")
        _backward(model, dp_rank, dp_degree)
        params = list(model.parameters())
        locals_ = [p.grad.to_local().clone() for p in params]
        deferred = deferred_meshes(model)
        meshes = canonical([deferred.get(id(p)) for p in params])
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            out[dtype] = reduce_grads(locals_, meshes, dtype=dtype, bucket_mb=0.05)
        reducer = ReplicateReducer(model, dtype=torch.bfloat16, bucket_mb=0.05)
        reducer.finish()
        return out, [p.grad.to_local() for p in params], locals_

    for out, eager_bf16, locals_ in run_threads(WORLD, body):
        for got, want in zip(out[torch.bfloat16], eager_bf16):
            assert torch.equal(got, want)
        assert any(not torch.equal(a, b) for a, b in zip(out[torch.float32], locals_))
