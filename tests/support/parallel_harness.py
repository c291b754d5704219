"""Shared helpers of the tests/test_parallel_*.py files (this module has no tests itself).

- `run_threads(world_size, fn)` (scripts/bench/thread_world.py): run `fn()` on `world_size` ranks that
  are threads of this process, with the in-process "threaded" process group (fast; DTensor, TP
  and SimpleFSDP run unchanged). The global RNG is shared by the threads, so random numbers are
  drawn in the main thread (or under `RNG_LOCK`).
- `run_processes(world_size, fn, *args)`: `torch.multiprocessing.spawn` with gloo, for what
  threads cannot do (torch.compile).
- Small Llama 3 / Qwen 3 models of the real debug flavors (fewer layers, short sequences).
- `assert_matches_single_process`: a family's loss and gradients parallelized over 2 (or 4) thread
  ranks against one process (the gpt-oss, DeepSeek-V4 and Qwen 3.5 tests).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.llama3 import FLAVORS as LLAMA3_FLAVORS
from models.llama3 import Transformer as Llama3
from models.llama3.plan import PLAN as LLAMA3_PLAN
from models.qwen3 import FLAVORS as QWEN3_FLAVORS
from models.qwen3 import Transformer as Qwen3
from models.qwen3.plan import PLAN as QWEN3_PLAN
from trainer.runtime.device import cpu_backend
from trainer.step import lm_loss  # noqa: F401  (re-exported for the parallel tests)

from thread_world import full, load_full_state, rel_diff, run_threads  # noqa: F401  (re-exported for the parallel tests)

RNG_LOCK = threading.Lock()
# full_tensor() of 2-D (_StridedShard, Shard) weights in the checks warns about sequential
# all-gathers on every call; the layout is intended (see simple_fsdp.py).
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
SEQ_LEN = 16


def llama3_args(n_layers: int = 2):
    return dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=n_layers, max_seq_len=SEQ_LEN)


def qwen3_args(n_layers: int = 2):
    return dataclasses.replace(QWEN3_FLAVORS["debugmodel"], n_layers=n_layers, max_seq_len=SEQ_LEN)


FAMILIES = {"llama3": (Llama3, llama3_args, LLAMA3_PLAN), "qwen3": (Qwen3, qwen3_args, QWEN3_PLAN)}


def reference_state(family: str = "llama3", seed: int = 0, n_layers: int = 2) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a freshly initialised single-process model."""
    cls, make_args, _ = FAMILIES[family]
    with torch.device("meta"):
        model = cls(make_args(n_layers))
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def batch(vocab_size: int, batch_size: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@torch.no_grad()
def parallel_fp32_model(cls, args, plan, dims, state: dict[str, torch.Tensor], **parallelize):
    """On a rank: `cls(args)` built on meta, parallelized by `plan` over `dims` (fp32 params and
    reductions; `parallelize`: more `parallelize_model` keywords), materialized, initialised (the
    RoPE buffers) and holding `state`; -> (model, mesh)."""
    from parallelisms import build_mesh, parallelize_model

    mesh = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = cls(args)
    parallelize_model(
        model,
        plan=plan,
        parallel_dims=dims,
        mesh=mesh,
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        **parallelize,
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()  # rebuilds the RoPE buffers; the weights come next
    load_full_state(model, state)
    return model, mesh


def assert_matches_single_process(
    cls,
    args,
    plan,
    degrees: dict,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    perturb: tuple[str, ...] = (),
    aux_loss_coef: float = 0.01,
    tolerance=lambda name: 1e-5,
    without_grad=lambda name: False,
    world_size: int = 2,
) -> None:
    """The model families' parity check: `cls(args)` in one process (seed 0; then the parameters
    whose names end with one of `perturb` drawn at 0.1 x N(0, 1), so that the sharding of zero-initialised
    biases and sinks shows) against the same weights parallelized by `plan` over `degrees` on
    `world_size` thread ranks, each on its data-parallel share of (`inputs`, `labels`), loss = LM + `aux_loss_coef`
    x the model's aux loss. The ranks' mean loss equals the whole batch's (rel 1e-6) and every
    gradient the single process's (relative, below `tolerance(name)`); only the parameters
    `without_grad(name)` may have no gradient, on both sides alike."""
    import pytest

    from parallelisms import ParallelDims

    torch.manual_seed(0)
    ref = cls(args)
    with torch.no_grad():
        ref.init_weights()
        for name, p in ref.named_parameters():
            if perturb and name.endswith(perturb):
                p.copy_(torch.randn(p.shape) * 0.1)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    lm = lm_loss(ref(inputs), labels)
    (lm + aux_loss_coef * ref.pop_aux_loss()).backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    missing = [n for n, p in ref.named_parameters() if p.grad is None]
    assert all(without_grad(n) for n in missing), missing

    def rank_fn():
        dims = ParallelDims(world_size=world_size, **degrees)
        model, mesh = parallel_fp32_model(cls, args, plan, dims, state)
        r, n = dims.dp_rank(mesh), inputs.shape[0] // dims.dp_degree
        loss = lm_loss(model(inputs[r * n : (r + 1) * n]), labels[r * n : (r + 1) * n])
        (loss + aux_loss_coef * model.pop_aux_loss()).backward()
        return loss.item(), {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}

    results = run_threads(world_size, rank_fn)
    assert sum(loss for loss, _ in results) / world_size == pytest.approx(lm.item(), rel=1e-6)
    for _, grads in results:
        assert set(grads) == set(want)
        for name, g in want.items():
            assert rel_diff(grads[name], g) < tolerance(name), name


def _process_entry(rank: int, world_size: int, init_file: str, fn, args, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(cpu_backend(), init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_processes(world_size: int, fn, *args) -> list:
    """Run `fn(*args)` on `world_size` gloo processes (fn must be importable); results by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg")
        mp.spawn(_process_entry, args=(world_size, init_file, fn, args, tmp), nprocs=world_size)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
