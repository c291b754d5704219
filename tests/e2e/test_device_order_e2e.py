"""A run laid out in torch-tpu's device order is the same run, end to end through `trainer.train`.

The debug Llama 3 recipe (2 layers, seq 64, fp32) on 4 gloo processes, FSDP 4, under
`--parallelism.device_order=v6e-4` (torch-tpu's tray ring of a v6e-4: launcher ranks 2 and 3 take
places 3 and 2) against the identity order:
- the losses are equal bit for bit: the renumbered process group computes exactly what the identity
  one does, place by place (same data per place, same reduction order);
- the step-3 checkpoint converts to Hugging Face safetensors (`scripts/convert.py to-hf`, one
  process, the DCP metadata) byte for byte as the identity run's: nothing is stored permuted;
- that checkpoint resumes on dp_shard 2 x tp 2 under another (random) order and follows the
  identity run's steps 4-5 within 1e-5 (another mesh: fp32 summation order only);
- the HF export loads as `initial_load_path` under a random order and the first loss equals the
  one-process start from it within 1e-5 (a permuted load would change the loss at the first digit).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.e2e.test_parallel_e2e import COMMON as PARALLEL_COMMON
from tests.e2e.test_resume_e2e import COMMON as RESUME_COMMON
from tests.support.trainer_runs import ENV, GLOBAL_BATCH, REPO, launch_command, read_metrics, run

pytestmark = pytest.mark.multiprocess

COMMON = [*RESUME_COMMON, "--checkpoint.interval=3"]
"""test_resume_e2e's fp32 debug run with checkpoints, saved at step 3."""


def _train(folder, nproc: int, *args: str, tp: int = 1) -> dict[int, float]:
    dp = nproc // tp
    run(
        launch_command(
            nproc,
            [
                *COMMON,
                f"--job.dump_folder={folder}",
                f"--training.local_batch_size={GLOBAL_BATCH // dp}",
                f"--parallelism.data_parallel_shard_degree={dp}",
                f"--parallelism.tensor_parallel_degree={tp}",
                *args,
            ],
        )
    )
    return {step: record["loss"] for step, record in read_metrics(folder).items()}


def _to_hf(checkpoint, out) -> bytes:
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/convert.py",
            "to-hf",
            "--checkpoint",
            str(checkpoint),
            "--model.name",
            "llama3",
            "--model.flavor",
            "debugmodel",
            "--model.n_layers=2",
            str(out),
        ],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (out / "model.safetensors").read_bytes()


def test_a_run_in_torch_tpus_order_is_the_identity_run(tmp_path):
    ident = _train(tmp_path / "identity", 4, "--training.steps=3", "--parallelism.device_order=identity")
    tray = _train(tmp_path / "v6e4", 4, "--training.steps=3", "--parallelism.device_order=v6e-4")
    assert [tray[s] for s in (1, 2, 3)] == [ident[s] for s in (1, 2, 3)], (tray, ident)
    hf = _to_hf(tmp_path / "v6e4" / "checkpoints" / "step-3", tmp_path / "hf_v6e4")
    assert hf == _to_hf(tmp_path / "identity" / "checkpoints" / "step-3", tmp_path / "hf_identity")


def test_a_checkpoint_and_an_hf_start_in_one_order_resume_in_another(tmp_path):
    ident = _train(tmp_path / "identity", 4, "--training.steps=5", "--parallelism.device_order=identity")
    tray = tmp_path / "v6e4"
    _train(tray, 4, "--training.steps=3", "--parallelism.device_order=v6e-4")
    resumed = tmp_path / "resumed"
    shutil.copytree(tray / "checkpoints" / "step-3", resumed / "checkpoints" / "step-3")
    got = _train(resumed, 4, "--training.steps=5", tp=2)  # a random order (launch_command)
    assert sorted(got) == [4, 5]
    worst = max(abs(got[s] - ident[s]) / ident[s] for s in (4, 5))
    print(f"resumed on dp 2 x tp 2 in another order: max relative loss difference {worst:.2e}")
    assert worst < 1e-5

    _to_hf(tray / "checkpoints" / "step-3", tmp_path / "hf")
    start = ["--training.steps=1", "--checkpoint.enable=false", f"--checkpoint.initial_load_path={tmp_path / 'hf'}"]
    start += ["--checkpoint.initial_load_format=hf"]
    one = _train(tmp_path / "hf_one", 1, *start)
    four = _train(tmp_path / "hf_four", 4, *start)
    print(f"HF start: 1 process {one[1]:.6f}, 4 in a random order {four[1]:.6f}")
    assert abs(four[1] - one[1]) / one[1] < 1e-5


# --- every mesh in every order (scheduled: the default tier runs each parallelism in one random
# order through launch_command, and FSDP in v6e-4's order bit for bit above) ---------------------

PARITY = [*PARALLEL_COMMON, "--training.steps=3"]
"""test_parallel_e2e's fp32 debug run, 3 steps."""
GRAPH = ["--compile.mode=graph", "--compile.backend=aot_eager"]
MESHES = {
    "fsdp4": ("llama", dict(dp_shard=4), []),
    "hsdp2x2": ("llama", dict(dp_replicate=2, dp_shard=2), []),
    "fsdp2xtp2": ("llama", dict(dp_shard=2, tp=2), []),
    "fsdp2xcp2": ("llama", dict(dp_shard=2), ["--parallelism.context_parallel_degree=2"]),
    "graph_fsdp4": ("llama", dict(dp_shard=4), GRAPH),
    "scan_fsdp2xtp2": ("llama", dict(dp_shard=2, tp=2), [*GRAPH, "--compile.scan_layers=true"]),
    "ep4": ("moe", dict(dp_shard=4, ep=4), []),
    "ep2xfsdp4": ("moe", dict(dp_shard=4, ep=2), []),
}
ORDERS = ("identity", "v6e-4", "random")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from tests.support.trainer_runs import MOE_SHORT_RUN, train

    def losses(args):
        records = train(tmp_path_factory.mktemp("one"), 1, {}, *args)
        return [records[s]["loss"] for s in sorted(records)]

    return {"llama": losses(PARITY), "moe": losses(MOE_SHORT_RUN)}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_mesh_is_the_same_run_in_every_order(tmp_path, one_process, mesh):
    """Identity, v6e-4's tray ring and a random order on 4 processes: the losses of every order
    equal the identity order's bit for bit (the same computation place by place) and the one
    process's within 1e-5 (fp32 summation order over 3 steps; graph modes: another summation order
    of the same math, as tests/e2e/test_parallel_e2e.py argues)."""
    from tests.support.trainer_runs import MOE_SHORT_RUN, draw_device_order, train

    family, degrees, extra = MESHES[mesh]
    base = PARITY if family == "llama" else list(MOE_SHORT_RUN)
    got = {}
    for order in ORDERS:
        spec = draw_device_order(4) if order == "random" else order
        records = train(tmp_path / order, 4, degrees, *base, *extra, f"--parallelism.device_order={spec}")
        got[order] = [records[s]["loss"] for s in sorted(records)]
    ref = one_process[family]
    worst = max(abs(a - b) / b for a, b in zip(got["identity"], ref))
    print(
        f"{mesh}: vs 1 process {worst:.2e}; "
        + ", ".join(
            f"{o} vs identity {max(abs(a - b) for a, b in zip(got[o], got['identity'])):.1e}" for o in ORDERS[1:]
        )
    )
    assert worst < 1e-5, (got["identity"], ref)
    for order in ORDERS[1:]:
        assert got[order] == got["identity"], (order, got[order], got["identity"])
