"""Several TPU slices (multislice, DCN): the launcher's MegaScale translation, the slice rule, and a
simulated 2-slice job on gloo.

Unit part: the MegaScale variables (XPK/GKE: process environment; queued resources: the TPU VM's
`tpu-env` metadata) give the global node rank (slice id x hosts per slice + worker id), the node
count and the rendezvous host (the coordinator's); a misconfigured environment is one `error:`
line, exit 2; a layout that puts FSDP traffic across slices is refused by the step plan's rule.

End-to-end part (`test_two_slices_train_like_one_process`): 2 "slices" x 2 "hosts" x 1 CPU process,
four launchers on loopback with `MEGASCALE_NUM_SLICES=2` and each host's `MEGASCALE_SLICE_ID`, HSDP
with dp_replicate 2 (one replica per slice) x dp_shard 2, against one process and against the same
4-process job on one slice (2 hosts x 2 processes, FSDP 4).

Why the fp32 losses agree to 1e-5 relative: every run sees the same global batch of 4 sequences
from the same seed and init; the mean loss and the gradient are sums of the same per-sequence
terms, grouped differently (the 2-slice run sums 2 per rank, reduce-scatters over dp_shard, then
all-reduces over dp_replicate; one process sums all 4). Reassociating n fp32 additions moves the
result by at most ~n x 2^-24 ~ 6e-8 relative per reduction; over 3 AdamW steps the differences pass
through a few hundred reductions and the update (which divides by sqrt(v) + eps and so can amplify
a relative change of a tiny gradient), so 1e-5 leaves about two orders of magnitude of margin while
a wrong rank order (a replica reading another's rows twice) or a missing cross-slice reduction moves
the second step's loss by > 1e-3. tests/e2e/test_parallel_e2e.py uses the same bound.
"""

import argparse
import subprocess
import sys

import pytest

from models.errors import ConfigError
from parallelisms.parallel_dims import ParallelDims, check_slice_major, resolve_num_slices
from tests.support.trainer_runs import ENV, REPO, read_metrics, train
from trainer import launch
from trainer.step.plan import StepRequest, refusals


def _args(**kw) -> argparse.Namespace:
    base = dict(platform="auto", device="auto", nnodes=None, node_rank=None, master_addr=None, master_port=None)
    return argparse.Namespace(**{**base, "nproc_per_node": None, **kw})


# What XPK puts in a pod of slice 1 of `--num-slices 2` on v6e-256 (64 hosts of 4 chips per slice);
# GKE sets TPU_WORKER_HOSTNAMES to the slice's own hosts.
XPK_SLICE1 = {
    "TPU_WORKER_HOSTNAMES": ",".join(f"wl-slice-job-1-{i}.wl" for i in range(64)),
    "TPU_WORKER_ID": "5",
    "TPU_ACCELERATOR_TYPE": "v6e-256",
    "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
    "MEGASCALE_NUM_SLICES": "2",
    "MEGASCALE_SLICE_ID": "1",
    "MEGASCALE_COORDINATOR_ADDRESS": "wl-slice-job-0-0.wl",
    "MEGASCALE_PORT": "8080",
}


def test_xpk_two_slices_global_rank_and_coordinator():
    seen = {}
    plan = launch.build_plan(_args(), XPK_SLICE1, tpu_env=lambda e: seen.update(e) or {})
    assert (plan.nnodes, plan.node_rank, plan.nproc_per_node) == (128, 64 + 5, 4)
    assert plan.master_addr == "wl-slice-job-0-0.wl"
    assert (plan.multislice.num_slices, plan.multislice.slice_id, plan.multislice.source) == (2, 1, "environment")
    # torch-tpu gets the slice's own view (its slice builder is per slice) ...
    assert (seen["NODE_RANK"], seen["NNODES"], seen["MASTER_ADDR"]) == ("5", "64", "wl-slice-job-1-0.wl")
    # ... and the workers the MegaScale variables libtpu joins the slices with
    # (the coordinator with XPK's MEGASCALE_PORT, which is not every process's: tests/e2e/test_pod_launch.py)
    assert plan.env["MEGASCALE_SLICE_ID"] == "1" and "MEGASCALE_PORT" not in plan.env
    assert plan.env["MEGASCALE_COORDINATOR_ADDRESS"] == "wl-slice-job-0-0.wl:8080"
    argv = plan.torchrun_argv(["--config", "x.toml"])
    assert "--nnodes=128" in argv and "--node_rank=69" in argv
    assert f"--rdzv_endpoint=wl-slice-job-0-0.wl:{launch.DEFAULT_PORT}" in argv
    # one slice: unchanged (MEGASCALE_NUM_SLICES=1 is a single slice)
    single = {**XPK_SLICE1, "MEGASCALE_NUM_SLICES": "1", "MEGASCALE_SLICE_ID": "0"}
    plan = launch.build_plan(_args(), single, tpu_env=lambda e: {})
    assert (plan.nnodes, plan.node_rank, plan.master_addr, plan.multislice) == (64, 5, "wl-slice-job-1-0.wl", None)


def test_queued_resource_two_slices_from_tpu_env_metadata():
    meta = {
        "agent-worker-number": "3",
        "accelerator-type": "v6e-16",
        "worker-network-endpoints": "w0:0:10.0.1.2,w1:0:10.0.1.3,w2:0:10.0.1.4,w3:0:10.0.1.5",
        "tpu-env": "ACCELERATOR_TYPE: 'v6e-16'\nMEGASCALE_COORDINATOR_ADDRESS: '10.0.0.2:8080'\n"
        "MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'\nMEGASCALE_PORT: '8080'\n",
    }
    plan = launch.build_plan(_args(platform="tpu-vm"), {}, metadata=lambda: meta, tpu_env=lambda e: {})
    assert (plan.nnodes, plan.node_rank, plan.nproc_per_node, plan.master_addr) == (8, 7, 4, "10.0.0.2")
    assert plan.multislice.source == "metadata tpu-env"
    assert plan.env["MEGASCALE_COORDINATOR_ADDRESS"] == "10.0.0.2:8080"
    # the process environment wins over the metadata (jax's cloud_tpu_cluster does the same)
    env = {"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "0", "MEGASCALE_COORDINATOR_ADDRESS": "10.9.9.9"}
    plan = launch.build_plan(_args(platform="tpu-vm"), env, metadata=lambda: meta, tpu_env=lambda e: {})
    assert (plan.node_rank, plan.master_addr) == (3, "10.9.9.9")


@pytest.mark.parametrize(
    "change, match",
    [
        ({"MEGASCALE_SLICE_ID": "2"}, "MEGASCALE_SLICE_ID is 2 .* allowed: this host's slice, 0..1"),
        ({"MEGASCALE_SLICE_ID": ""}, "MEGASCALE_SLICE_ID is not set"),
        ({"MEGASCALE_COORDINATOR_ADDRESS": ""}, "MEGASCALE_COORDINATOR_ADDRESS is not set"),
        ({"MEGASCALE_NUM_SLICES": "two"}, "MEGASCALE_NUM_SLICES is 'two'"),
    ],
)
def test_misconfigured_megascale_environment_is_a_config_error(change, match):
    with pytest.raises(ConfigError, match=match):
        launch.build_plan(_args(), {**XPK_SLICE1, **change}, tpu_env=lambda e: {})


def test_cli_misconfigured_slices_one_line_exit_2_and_dry_run_plan():
    base = {k: v for k, v in ENV.items() if not k.startswith(("TPU_", "SLURM_", "MEGASCALE_", "MASTER_"))}
    cmd = [sys.executable, "-m", "trainer.launch", "--device", "cpu", "--dry-run", "--", "--config", "x.toml"]
    bad = subprocess.run(
        cmd,
        cwd=REPO,
        env={**base, **XPK_SLICE1, "MEGASCALE_COORDINATOR_ADDRESS": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: launch: MEGASCALE_COORDINATOR_ADDRESS is not set")
    assert len(bad.stderr.strip().splitlines()) == 1
    manual = subprocess.run(
        [*cmd[:3], "--platform", "manual", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"]
        + ["--nproc-per-node", "1", *cmd[3:]],
        cwd=REPO,
        env={**base, **{k: v for k, v in XPK_SLICE1.items() if k.startswith("MEGASCALE_")}},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert manual.returncode == 2 and "with platform manual" in manual.stderr
    dry = subprocess.run(cmd, cwd=REPO, env={**base, **XPK_SLICE1}, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    first = dry.stdout.splitlines()[0]
    assert first.startswith("launch: gke: node 69/128, 4 processes, rendezvous wl-slice-job-0-0.wl:29501")
    assert "slice 1/2 (environment, coordinator wl-slice-job-0-0.wl)" in first
    assert "export MEGASCALE_SLICE_ID=1" in dry.stdout and "--node_rank=69" in dry.stdout


@pytest.mark.parametrize("platform, tool", [("xpk", "xpk workload create"), ("qr", "queued-resources ssh")])
def test_launch_pod_two_slice_dry_run(platform, tool):
    pre = ["cluster", "wl", "v6e-256", "2"] if platform == "xpk" else ["my-qr", "us-east5-b"]
    proc = subprocess.run(
        ["bash", "scripts/launch_pod.sh", platform, *pre, "--", "--config", "configs/llama3_70b_v6e.toml"],
        cwd=REPO,
        env={**ENV, "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert tool in proc.stdout
    assert ("--num-slices 2" in proc.stdout) if platform == "xpk" else ("--node=all --worker=all" in proc.stdout)
    assert ("--platform\\ gke" if platform == "xpk" else "--platform\\ tpu-vm") in proc.stdout


def test_slice_count_from_the_environment_and_the_dcn_split():
    assert resolve_num_slices(0, {}) == 1 and resolve_num_slices(0, {"MEGASCALE_NUM_SLICES": "4"}) == 4
    with pytest.raises(ConfigError, match="parallelism.num_slices: 2, but the launcher's MEGASCALE_NUM_SLICES is 4"):
        resolve_num_slices(2, {"MEGASCALE_NUM_SLICES": "4"})
    dims = ParallelDims(dp_replicate=4, dp_shard=-1, num_slices=2, world_size=16)
    assert (dims.dcn_mesh_shape, dims.ici_mesh_shape) == ((2, 1, 1, 1), (2, 4, 1, 1))
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, num_slices=4, world_size=16)  # spills onto dp_shard
    assert (dims.dcn_mesh_shape, dims.ici_mesh_shape) == ((2, 2, 1, 1), (1, 4, 1, 1))
    with pytest.raises(ConfigError, match="parallelism.num_slices: 2 slices, but data_parallel_replicate"):
        ParallelDims(dp_replicate=1, dp_shard=1, tp=4, num_slices=2, world_size=4)  # TP across slices
    check_slice_major(ParallelDims(dp_replicate=2, num_slices=2, world_size=4), rank=2, env={"MEGASCALE_SLICE_ID": "1"})
    with pytest.raises(ConfigError, match="slice-major numbering puts it on slice 1"):
        check_slice_major(
            ParallelDims(dp_replicate=2, num_slices=2, world_size=4), rank=2, env={"MEGASCALE_SLICE_ID": "0"}
        )


def test_fsdp_across_slices_is_refused_unless_asked_for():
    (message,) = refusals(StepRequest(num_slices=2, dp_replicate=1))
    assert message.startswith("parallelism.data_parallel_replicate_degree: 1 on 2 slices puts FSDP/EP collectives")
    assert "allowed: a multiple of 2" in message and "allow_dcn_sharding = true" in message
    assert refusals(StepRequest(num_slices=2, dp_replicate=1, allow_dcn_sharding=True)) == []
    assert refusals(StepRequest(num_slices=2, dp_replicate=4)) == []
    assert refusals(StepRequest(num_slices=1, dp_replicate=1)) == []


def test_job_plan_reads_the_slices_from_the_environment(monkeypatch):
    from trainer.config import build_config
    from trainer.job import plan_job

    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    cfg = build_config("configs/llama3_debug.toml", [])
    with pytest.raises(ConfigError, match="data_parallel_replicate_degree: 1 on 2 slices puts FSDP/EP"):
        plan_job(cfg, world_size=4, device_type="cpu")
    cfg = build_config("configs/llama3_debug.toml", [("parallelism.data_parallel_replicate_degree", "2")])
    assert plan_job(cfg, world_size=4, device_type="cpu").parallel_dims.dcn_mesh_shape == (2, 1, 1, 1)
    cfg = build_config("configs/llama3_debug.toml", [("parallelism.allow_dcn_sharding", "true")])
    assert plan_job(cfg, world_size=4, device_type="cpu").parallel_dims.dcn_mesh_shape == (1, 2, 1, 1)
    cfg = build_config("configs/llama3_debug.toml", [("parallelism.num_slices", "4")])
    with pytest.raises(ConfigError, match="num_slices: 4, but the launcher's MEGASCALE_NUM_SLICES is 2"):
        plan_job(cfg, world_size=4, device_type="cpu")


def test_trainer_slice_count_disagreeing_with_the_world_is_one_line_exit_2(tmp_path):
    """One process cannot be two slices: the mesh and MEGASCALE_NUM_SLICES disagree."""
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", *TRAIN, f"--job.dump_folder={tmp_path}"],
        cwd=REPO,
        env={**ENV, "MEGASCALE_NUM_SLICES": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: parallelism.num_slices: 2 slices, but data_parallel")


TRAIN = [
    "--config",
    "configs/llama3_debug.toml",
    "--training.steps=3",
    "--training.seq_len=64",
    "--model.n_layers=2",
    "--metrics.log_freq=1",
    "--checkpoint.enable=false",
    "--validation.enable=false",
    "--training.mixed_precision_param=float32",
    "--metrics.enable_tensorboard=false",
]


def _launch_hosts(tmp_path, name: str, *, slices: int, hosts: int, nproc: int, extra: list[str]) -> list[dict]:
    """Start `slices x hosts` launchers on loopback as GKE hosts (one slice's host list each,
    MegaScale variables set with more than one slice); the losses the job wrote."""
    from tests.e2e.test_launch import _free_port

    port = _free_port()
    dump = tmp_path / name
    base = {
        k: v
        for k, v in ENV.items()
        if not k.startswith(("TPU_", "SLURM_", "MASTER_", "RANK", "WORLD_SIZE", "MEGASCALE_"))
    }
    procs = []
    for slice_id in range(slices):
        for worker in range(hosts):
            env = {
                **base,
                "TPU_WORKER_HOSTNAMES": ",".join(["127.0.0.1"] * hosts),
                "TPU_WORKER_ID": str(worker),
                "TPU_ACCELERATOR_TYPE": f"v6e-{hosts * nproc}",
                "MASTER_PORT": str(port),
            }
            if slices > 1:
                env.update(
                    MEGASCALE_NUM_SLICES=str(slices),
                    MEGASCALE_SLICE_ID=str(slice_id),
                    MEGASCALE_COORDINATOR_ADDRESS="127.0.0.1:8080",
                )
            argv = [sys.executable, "-m", "trainer.launch", "--device", "cpu", "--nproc-per-node", str(nproc)]
            procs.append(
                subprocess.Popen(
                    [*argv, "--", *TRAIN, f"--job.dump_folder={dump}", *extra],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"launcher {i}:\n{log[-3000:]}"
        # slice-major: slice s, worker w is node s x hosts + w = i in the order they were started
        assert f"node {i}/{slices * hosts}, {nproc} processes, rendezvous 127.0.0.1:{port}" in log
    return list(read_metrics(dump).values())


@pytest.mark.slow  # 91 s on a 2-vCPU VM at load ~9 (2026-12-05): four launchers, eight trainer starts
@pytest.mark.multiprocess
def test_two_slices_train_like_one_process(tmp_path):
    """2 slices x 2 hosts x 1 process (HSDP 2 x 2, the replicate axis across the slices) = one
    process = 1 slice x 2 hosts x 2 processes (FSDP 4), fp32, 3 steps (bound: module docstring)."""
    two_slices = _launch_hosts(
        tmp_path,
        "two_slices",
        slices=2,
        hosts=2,
        nproc=1,
        extra=["--training.local_batch_size=1", "--parallelism.data_parallel_replicate_degree=2"],
    )
    one_slice = _launch_hosts(
        tmp_path,
        "one_slice",
        slices=1,
        hosts=2,
        nproc=2,
        extra=["--training.local_batch_size=1", "--parallelism.data_parallel_shard_degree=4"],
    )
    single = list(train(tmp_path / "single", 1, {}, *TRAIN).values())  # global batch 4 on 1 process
    assert len(two_slices) == len(one_slice) == len(single) == 3
    for key in ("loss", "grad_norm"):  # the gradient norm: every gradient entered the reduction
        want = [r[key] for r in single]
        rel = [max(abs(a[key] - b) / abs(b) for a, b in zip(run, want)) for run in (two_slices, one_slice)]
        print(
            f"multislice parity {key}: 1 process {want}; 2 slices {[r[key] for r in two_slices]}; "
            f"1 slice {[r[key] for r in one_slice]}; max rel (2 slices, 1 slice) {rel}"
        )
        assert max(rel) < 1e-5, (key, rel)


def test_the_slice_layout_is_checked_per_slice():
    """On several slices the start-up layout check maps the ICI part of the mesh onto one slice."""
    from parallelisms.parallel_dims import tpu_mesh_layout

    dims = ParallelDims(dp_replicate=2, tp=4, num_slices=2, world_size=512)
    layout = tpu_mesh_layout(dims, target="v6e-256x2", env={})
    one = tpu_mesh_layout(ParallelDims(tp=4, world_size=256), target="v6e-256", env={})
    assert layout is not None and layout.summary() == one.summary()
    assert (
        tpu_mesh_layout(ParallelDims(dp_replicate=2, num_slices=2, world_size=64), target="v6e-256x2", env={}) is None
    )
