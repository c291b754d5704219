"""Run `trainer.train` the way users do, for the end-to-end tests (no tests here).

One process runs `python -m trainer.train`; several run under `torchrun --standalone`. Every
process gets one thread (OMP_NUM_THREADS=1) and runs from the repository root.
"""

import itertools
import json
import os
import random
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLOBAL_BATCH = 4
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


ORDER_SEED = int(os.environ.setdefault("TITAN_TEST_ORDER_SEED", str(random.SystemRandom().randrange(10**6))))
"""The device orders of this test run are drawn from this seed (tests/conftest.py draws it, before
pytest-xdist starts its workers, and prints it; set TITAN_TEST_ORDER_SEED to redo a run's orders)."""
_draws = itertools.count()


def draw_device_order(nproc: int) -> str:
    """A permutation of `nproc` ranks other than the identity, for `[parallelism] device_order`:
    every multi-process run of the tests lays its processes out in another order (the mesh must not
    care: parallelisms/device_order.py). Successive calls draw different ones."""
    rng = random.Random(f"{ORDER_SEED}/{nproc}/{next(_draws)}")
    order = list(range(nproc))
    while order == sorted(order):
        rng.shuffle(order)
    return ",".join(map(str, order))


def launch_command(nproc: int, args, extra_launcher=()) -> list[str]:
    """The command line for `nproc` trainer processes (torchrun launcher options in
    `extra_launcher`); with several, a random device order (`draw_device_order`) unless `args`
    name one."""
    if nproc == 1:
        return [sys.executable, "-m", "trainer.train", *args]
    if not any(str(a).startswith("--parallelism.device_order") for a in args):
        args = [*args, f"--parallelism.device_order={draw_device_order(nproc)}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        *extra_launcher,
        f"--nproc_per_node={nproc}",
        "-m",
        "trainer.train",
        *args,
    ]


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def read_metrics(folder) -> dict[int, dict]:
    """metrics.jsonl by step (one record per step: a restarted run moves the records it redoes
    to metrics.rolled_back.jsonl)."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


QUIET_RUN = {
    "training.mixed_precision_param": "float32",
    "lr_scheduler.warmup_steps": "2",
    "metrics.log_freq": "1",
    "metrics.enable_tensorboard": "false",
    "validation.enable": "false",
    "checkpoint.enable": "false",
}
"""The overrides of a short in-process run that logs every step and writes nothing else."""


def train_in_process(recipe: str, folder, overrides: dict) -> dict[int, dict]:
    """`trainer.train.main` on `recipe` with QUIET_RUN, `overrides` and `job.dump_folder = folder`;
    its metrics by step. `main`, not `train`: it releases the run lock and the process group, which
    a later test's planner (its own fake group) needs gone."""
    from trainer.train import main

    settings = {**QUIET_RUN, **overrides, "job.dump_folder": str(folder)}
    assert main(["--config", recipe, *(f"--{k}={v}" for k, v in settings.items())]) == 0
    return read_metrics(folder)


def assert_recipe_learns(monkeypatch, recipe: str, folder, overrides: dict, *, steps: int = 6) -> list[float]:
    """A family's debug-recipe check: `recipe` trained `steps` steps in this process from the
    repository root (`train_in_process`: fp32, every step logged, nothing saved, with `overrides`),
    one loss logged per step, and the last more than 0.5 below the first; -> the losses."""
    monkeypatch.chdir(REPO)
    records = train_in_process(recipe, folder, {"training.steps": steps, **overrides})
    losses = [records[s]["loss"] for s in sorted(records)]
    assert len(losses) == steps
    assert losses[-1] < losses[0] - 0.5, losses
    return losses


def train(folder, nproc: int, degrees: dict, *args: str) -> dict[int, dict]:
    """Train on `nproc` processes with these parallel degrees and a global batch of GLOBAL_BATCH sequences."""
    dp = degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1)
    run(
        launch_command(
            nproc,
            [
                *args,
                f"--job.dump_folder={folder}",
                f"--training.local_batch_size={GLOBAL_BATCH // dp}",
                f"--parallelism.data_parallel_replicate_degree={degrees.get('dp_replicate', 1)}",
                f"--parallelism.data_parallel_shard_degree={degrees.get('dp_shard', 1)}",
                f"--parallelism.tensor_parallel_degree={degrees.get('tp', 1)}",
                f"--parallelism.expert_parallel_degree={degrees.get('ep', 1)}",
            ],
        )
    )
    return read_metrics(folder)


def train_losses(folder, nproc: int, degrees: dict, steps: int, *args: str) -> list[float]:
    """`train`'s logged losses of steps 1..`steps` (`args` must run that many steps, logging each)."""
    records = train(folder, nproc, degrees, *args)
    assert sorted(records) == list(range(1, steps + 1))
    return [records[s]["loss"] for s in range(1, steps + 1)]


def assert_losses_close(got: list[float], want: list[float], rtol: float = 1e-5) -> float:
    """The largest relative difference of two loss curves, asserted below `rtol`."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert worst < rtol, (got, want)
    return worst


TINY_RUN = (
    "--config",
    "configs/llama3_debug.toml",
    "--training.seq_len=64",
    "--model.n_layers=1",
    "--validation.enable=false",
    "--metrics.enable_tensorboard=false",
    "--training.local_batch_size=2",
)
"""The debug recipe cut to 1 layer at seq 64, batch 2, nothing but training (the contract tests that
need a run to start, write or fail, not to learn)."""

MOE_SHORT_RUN = (
    "--config",
    "configs/qwen3_moe_debug.toml",
    "--training.seq_len=64",
    "--model.n_layers=2",
    "--metrics.log_freq=1",
    "--validation.enable=false",
    "--training.mixed_precision_param=float32",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=false",
    "--training.steps=3",
)
"""The MoE debug recipe cut to 3 logged fp32 steps of 2 layers at seq 64, nothing saved (the MoE parity tests)."""
