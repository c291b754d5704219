"""Multi-host launch (trainer/launch.py): environment translation and a simulated 2-host slice.

The unit tests feed each platform's variables (GKE/XPK, TPU VM metadata, Slurm) and check the
torchrun plan: node count and rank, processes per host (v7x: 2 devices per chip), the static
rendezvous endpoint (host 0), torch-tpu's launch variables (its global WORLD_SIZE dropped), and
that a missing or bad variable is one `error:` line with exit code 2. The end-to-end test runs
two launchers as two "hosts" of a GKE slice on loopback (one CPU process each, gloo): they meet
through the static rendezvous and train the debug model for 3 steps with the same losses as one
process with the same global batch.
"""

import argparse
import importlib.util
import os
import socket
import subprocess
import sys

import pytest

from models.errors import ConfigError
from tests.support.trainer_runs import ENV, REPO, read_metrics, train
from trainer import launch, platforms


def _args(**kw) -> argparse.Namespace:
    base = dict(
        platform="auto",
        device="auto",
        nnodes=None,
        node_rank=None,
        master_addr=None,
        master_port=None,
        nproc_per_node=None,
    )
    return argparse.Namespace(**{**base, **kw})


def _no_tpu_env(env):
    raise AssertionError("torch-tpu must not be asked for a CPU/GPU launch")


GKE_V6E = {
    "TPU_WORKER_HOSTNAMES": "h0.job,h1.job,h2.job,h3.job",
    "TPU_WORKER_ID": "2",
    "TPU_ACCELERATOR_TYPE": "v6e-16",
    "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
}


def test_gke_v6e_plan_and_torch_tpu_env():
    seen = {}

    def fake_tpu_env(env):
        seen.update(env)
        return launch.torch_tpu_launch_env(
            env,
            run=lambda argv, e: (
                "TORCH_TPU_TOPOLOGY=4x4\nexport TORCH_TPU_SLICEBUILDER_ADDRESSES='h0.job:8471,h1.job:8471'\n"
                "WORLD_SIZE=16\nnot a variable line\n"
            ),
        )

    plan = launch.build_plan(_args(), GKE_V6E, tpu_env=fake_tpu_env)
    assert (plan.platform, plan.nnodes, plan.node_rank, plan.nproc_per_node) == ("gke", 4, 2, 4)
    assert (plan.master_addr, plan.master_port, plan.device) == ("h0.job", launch.DEFAULT_PORT, "tpu")
    # torch-tpu saw the host list and worker id, and what its set_tpu_launch_env reads (it never
    # reads TPU_WORKER_ID); its global WORLD_SIZE is not passed on
    assert seen["TPU_WORKER_HOSTNAMES"] == GKE_V6E["TPU_WORKER_HOSTNAMES"] and seen["TPU_WORKER_ID"] == "2"
    assert (seen["NODE_RANK"], seen["NNODES"], seen["TORCH_TPU_DEVICES_PER_HOST"]) == ("2", "4", "4")
    assert (seen["MASTER_ADDR"], seen["MASTER_PORT"]) == ("h0.job", str(launch.DEFAULT_PORT))
    assert plan.env["TORCH_TPU_TOPOLOGY"] == "4x4"
    assert plan.env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == "h0.job:8471,h1.job:8471"
    assert "WORLD_SIZE" not in plan.env and plan.env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "1"
    argv = plan.torchrun_argv(["--config", "x.toml"])
    assert "--nnodes=4" in argv and "--node_rank=2" in argv and "--nproc_per_node=4" in argv
    assert "--rdzv_backend=static" in argv and f"--rdzv_endpoint=h0.job:{launch.DEFAULT_PORT}" in argv


def test_gke_v7x_runs_two_processes_per_chip_and_job_completion_index():
    env = {
        "TPU_WORKER_HOSTNAMES": "a,b",
        "JOB_COMPLETION_INDEX": "1",
        "TPU_ACCELERATOR_TYPE": "tpu7x-16",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        "MASTER_PORT": "1234",
    }
    plan = launch.build_plan(_args(), env, tpu_env=lambda e: {})
    assert (plan.nnodes, plan.node_rank, plan.nproc_per_node, plan.master_port) == (2, 1, 8, 1234)


def test_tpu_vm_metadata_plan():
    meta = {
        "agent-worker-number": "1",
        "accelerator-type": "v5p-64",
        "worker-network-endpoints": "w0:0:10.0.0.2,w1:0:10.0.0.3,w2:0:10.0.0.4,w3:0:10.0.0.5,"
        "w4:0:10.0.0.6,w5:0:10.0.0.7,w6:0:10.0.0.8,w7:0:10.0.0.9",
    }
    plan = launch.build_plan(_args(platform="tpu-vm"), {}, metadata=lambda: meta, tpu_env=lambda e: {})
    assert (plan.nnodes, plan.node_rank, plan.nproc_per_node, plan.master_addr) == (8, 1, 4, "10.0.0.2")
    single = {"agent-worker-number": "0", "accelerator-type": "v6e-8", "worker-network-endpoints": "w:0:10.1.1.1"}
    plan = launch.build_plan(_args(platform="tpu-vm"), {}, metadata=lambda: single, tpu_env=lambda e: {})
    assert (plan.nnodes, plan.nproc_per_node) == (1, 8)


def test_tpu_vm_single_host_v7x_counts_two_devices_per_chip():
    """`tpu7x-8` (4 chips, 8 TensorCores): was "chips per host unknown; pass --nproc-per-node"."""
    seen = {}
    meta = {"agent-worker-number": "0", "accelerator-type": "tpu7x-8", "worker-network-endpoints": "w:0:10.1.1.1"}
    plan = launch.build_plan(
        _args(platform="tpu-vm"), {}, metadata=lambda: meta, tpu_env=lambda e: seen.update(e) or {}
    )
    assert (plan.nnodes, plan.node_rank, plan.nproc_per_node) == (1, 0, 8)
    assert (seen["NODE_RANK"], seen["NNODES"], seen["TORCH_TPU_DEVICES_PER_HOST"]) == ("0", "1", "8")
    for accelerator, nproc in (("tpu7x-2", 2), ("v5p-8", 4), ("v5litepod-4", 4), ("v4-8", 4)):
        meta["accelerator-type"] = accelerator
        plan = launch.build_plan(_args(platform="tpu-vm"), {}, metadata=lambda: meta, tpu_env=lambda e: {})
        assert plan.nproc_per_node == nproc, accelerator


# The end of torch-tpu 0.2.0's stderr for a 2-host slice without NODE_RANK (tests/xla/test_launch_ttpu.py
# runs the real thing): warnings first, then the traceback, then absl lines may follow.
TORCH_TPU_STDERR = """\
/venv/lib/python3.11/site-packages/torch_tpu/__init__.py:37: UserWarning: <TorchTpu/Performance/TcMalloc/> tcmalloc is not loaded
  _tcmalloc_check.check_tcmalloc()
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796305328.019082   15212 pjrt_api.cc:119] GetPjrtApi was found for TPU at /venv/libtpu.so
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch_tpu/_internal/distributed/distributed.py", line 230, in _calculate_topological_node_rank
    raise ValueError(
ValueError: set_tpu_launch_env(): expected either TPU device coordinates together with environment variable TORCH_TPU_TOPOLOGY, or environment variable JOB_COMPLETION_INDEX to be a 0-based index of this host (Kubernetes Indexed Jobs set this automatically), to determine NODE_RANK, got neither
I0000 00:00:1796305329.1 15212 tpu_runtime.cc:1] shutting down
"""


def test_torch_tpu_failure_is_one_config_error_line():
    summary = launch.failure_summary(TORCH_TPU_STDERR)
    assert summary.startswith("ValueError: set_tpu_launch_env(): expected either TPU device coordinates")
    assert summary.endswith("got neither")
    assert launch.failure_summary(
        "Error while finding module specification for 'torch.tpu.distributed' "
        "(ModuleNotFoundError: No module named 'torch.tpu')\n"
    ).startswith("Error while")
    assert len(launch.failure_summary("x" * 5000)) == 600

    def failing(argv, env):  # what _run_torch_tpu_distributed raises for a non-zero exit
        raise ConfigError(
            f"launch: python -m torch.tpu.distributed failed (exit 1): {launch.failure_summary(TORCH_TPU_STDERR)}"
        )

    env = {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "1", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"}
    with pytest.raises(ConfigError, match="failed \\(exit 1\\): ValueError: set_tpu_launch_env"):
        launch.build_plan(_args(), env, tpu_env=lambda e: launch.torch_tpu_launch_env(e, run=failing))


def test_torch_tpu_output_parsing_drops_empty_values_and_checks_node_rank():
    printed = (
        'TORCH_TPU_TOPOLOGY=""\nTORCH_TPU_SLICEBUILDER_ADDRESSES="a:8070,b:8070"\nWORLD_SIZE=2\n'
        'NODE_RANK="1"\nNNODES="2"\n'
    )
    values = launch.torch_tpu_launch_env({"NODE_RANK": "1"}, run=lambda argv, e: printed)
    assert values == {"TORCH_TPU_SLICEBUILDER_ADDRESSES": "a:8070,b:8070", "NODE_RANK": "1", "NNODES": "2"}
    with pytest.raises(ConfigError, match="printed NODE_RANK=1 for NODE_RANK=0"):
        launch.torch_tpu_launch_env({"NODE_RANK": "0"}, run=lambda argv, e: printed)


def test_slurm_plan():
    assert platforms.first_slurm_host("gpu[003-010,12],cpu1") == "gpu003"
    assert platforms.first_slurm_host("node7") == "node7"
    env = {"SLURM_NNODES": "4", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "dgx[12-15]"}
    plan = launch.build_plan(_args(nproc_per_node=8), env, tpu_env=_no_tpu_env)
    assert (plan.platform, plan.nnodes, plan.node_rank, plan.nproc_per_node, plan.master_addr, plan.device) == (
        "slurm",
        4,
        3,
        8,
        "dgx12",
        "cuda",
    )


@pytest.mark.parametrize(
    "env, match",
    [
        ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"}, "JOB_COMPLETION_INDEX"),
        (
            {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "5", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"},
            "outside the 2 hosts",
        ),
        (
            {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0", "TPU_CHIPS_PER_HOST_BOUNDS": "2,x"},
            "TPU_CHIPS_PER_HOST_BOUNDS",
        ),
        ({"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}, "SLURM_NODEID"),
        ({}, "--nnodes"),
    ],
)
def test_bad_launch_environment_is_a_config_error(env, match):
    with pytest.raises(ConfigError, match=match):
        launch.build_plan(_args(), env, tpu_env=lambda e: {})


def test_cli_error_is_one_line_exit_2_and_dry_run_prints_the_command():
    env = {k: v for k, v in ENV.items() if not k.startswith(("TPU_", "SLURM_"))}
    bad = subprocess.run(
        [sys.executable, "-m", "trainer.launch", "--platform", "gke", "--", "--config", "x.toml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: launch: environment variable TPU_WORKER_HOSTNAMES")
    assert len(bad.stderr.strip().splitlines()) == 1
    dry = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.launch",
            "--platform",
            "gke",
            "--device",
            "cpu",
            "--dry-run",
            "--",
            "--config",
            "configs/llama3_debug.toml",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**env, **GKE_V6E},
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    assert "--rdzv_endpoint=h0.job:29501" in dry.stdout and "--device.type=cpu" in dry.stdout
    assert "TORCH_TPU" not in dry.stdout  # a CPU launch never asks torch-tpu
    # a TPU launch (the gke default) from a Python without torch-tpu: one line with the install command
    if importlib.util.find_spec("torch_tpu") is None:
        tpu = subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer.launch",
                "--platform",
                "gke",
                "--dry-run",
                "--",
                "--config",
                "configs/llama3_debug.toml",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**env, **GKE_V6E},
            timeout=120,
        )
        assert tpu.returncode == 2 and len(tpu.stderr.strip().splitlines()) == 1
        assert tpu.stderr.startswith("error: launch: device tpu needs torch-tpu") and "scripts/env.sh tpu" in tpu.stderr


@pytest.mark.parametrize(
    "extra, env, line",
    [
        (["--node-rank", "abc"], {}, "error: launch: argument --node-rank: invalid int value: 'abc'; allowed:"),
        (["--platform", "bogus"], {}, "error: launch: argument --platform: invalid choice: 'bogus'"),
        (["--master-port", "70000"], {}, "error: launch: --master-port is 70000; allowed: a TCP port, 1..65535"),
        ([], {"MASTER_PORT": "abc"}, "error: launch: environment variable MASTER_PORT is 'abc'; allowed: a TCP port"),
    ],
    ids=["wrong-type", "bad-choice", "port-range", "env-port"],
)
def test_bad_option_or_port_is_one_line_exit_2(extra, env, line):
    """Before: argparse's usage block + its own error line (8 lines), a port of 70000 passed on to
    torchrun, and MASTER_PORT=abc a ValueError traceback (exit 1)."""
    base = {k: v for k, v in ENV.items() if not k.startswith(("TPU_", "SLURM_", "MASTER_"))}
    manual = [
        "--platform",
        "manual",
        "--device",
        "cpu",
        "--dry-run",
        "--nnodes",
        "1",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--nproc-per-node",
        "1",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.launch", *manual, *extra, "--", "--config", "x.toml"],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.startswith(line) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.mark.multiprocess
def test_simulated_two_host_slice_trains(tmp_path):
    """Two launchers = two hosts of a GKE slice (host list on loopback), one CPU process each."""
    port = _free_port()
    dump = tmp_path / "two_host"
    base = {k: v for k, v in ENV.items() if not k.startswith(("TPU_", "SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    gke = {
        "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1",
        "TPU_ACCELERATOR_TYPE": "v6e-2",
        "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1",
        "MASTER_PORT": str(port),
    }
    args = [
        *TRAIN,
        f"--job.dump_folder={dump}",
        "--training.local_batch_size=2",
        "--parallelism.data_parallel_shard_degree=2",
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "trainer.launch", "--device", "cpu", "--", *args],
            cwd=REPO,
            env={**base, **gke, "TPU_WORKER_ID": str(worker)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for worker in (0, 1)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for worker, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"host {worker}:\n{log[-3000:]}"
        assert f"launch: gke: node {worker}/2, 1 processes, rendezvous 127.0.0.1:{port} (static)" in log
    assert "on 2 x cpu" in logs[0]  # rank 0 (on host 0) prints the banner: a world of 2
    two_host = [r["loss"] for r in read_metrics(dump).values()]
    single = [r["loss"] for r in train(tmp_path / "single", 1, {}, *TRAIN).values()]
    assert len(two_host) == len(single) == 3
    # Same global batch of 4 on the same init: the fp32 losses agree up to summation order
    # (tests/e2e/test_parallel_e2e.py's bound).
    assert max(abs(a - b) / abs(b) for a, b in zip(two_host, single)) < 1e-5


# --- scripts/launch_pod.sh passes the launchers' exit codes through on every platform ------------

FAKE_PYTHON = """#!/usr/bin/env bash
# `python -m trainer.launch ...` stand-in on simulated host $FAKE_WORKER: exits with FAKE_EXIT_<host>
eval "code=\\${FAKE_EXIT_${FAKE_WORKER:-0}}"
exit "$code"
"""
FAKE_SRUN = """#!/usr/bin/env bash
# srun stand-in: `bash -c CMD` once per node (FAKE_NODES); returns the highest task code, Slurm's rule
while [ "$1" != "bash" ]; do shift; done; shift; shift
max=0; pids=()
for ((i = 0; i < FAKE_NODES; i++)); do FAKE_WORKER=$i bash -c "$1" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p" && c=0 || c=$?; [ "$c" -gt "$max" ] && max=$c; done
exit "$max"
"""
FAKE_GCLOUD = """#!/usr/bin/env bash
# gcloud ... ssh --worker=all --command CMD stand-in: CMD once per worker (FAKE_NODES); 1 if any failed
while [ "$1" != "--command" ]; do shift; done
fail=0; pids=()
for ((i = 0; i < FAKE_NODES; i++)); do FAKE_WORKER=$i bash -c "$2" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
exit "$fail"
"""


@pytest.fixture
def fake_platform(tmp_path):
    """A PATH with stand-ins for srun, gcloud and the hosts' python (the launcher)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("srun", FAKE_SRUN), ("gcloud", FAKE_GCLOUD)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**ENV, "PATH": f"{bin_dir}:{ENV['PATH']}", "LAUNCH_POD_HOST_ENV": "none", "FAKE_NODES": "2"}


@pytest.mark.parametrize("platform", [["slurm"], ["tpu-vm", "NAME", "ZONE"]], ids=["slurm", "tpu-vm"])
@pytest.mark.parametrize(
    "codes, want",
    [
        ((0, 0), 0),
        ((75, 75), 75),  # every host preempted
        ((1, 75), 1),  # a crash on one host while the other was preempted: never 75 (srun alone says 75)
        ((75, 137), 1),  # killed on one host: slurm reports its mapped "failure" code; tpu-vm the first failure
        ((2, 2), 2),  # bad input
        ((75, 2), 2),
    ],
)
def test_launch_pod_passes_exit_codes_through(fake_platform, platform, codes, want):
    env = {**fake_platform, **{f"FAKE_EXIT_{i}": str(c) for i, c in enumerate(codes)}}
    proc = subprocess.run(
        ["bash", "scripts/launch_pod.sh", *platform, "--", "--config", "x.toml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    expect = 137 if (codes, platform[0]) == ((75, 137), "tpu-vm") else want
    assert proc.returncode == expect, proc.stderr
    assert sorted(
        int(line.rsplit(" ", 1)[1]) for line in proc.stderr.splitlines() if "launch_pod.sh: host" in line
    ) == sorted(codes)


@pytest.mark.multiprocess
def test_launch_pod_local_sigterm_exits_75(tmp_path):
    """SIGTERM to launch_pod.sh local (2 simulated hosts, 1 process each): passed to both launchers,
    then to torchrun and the workers; both save the same step and the script exits 75."""
    import signal
    import time

    folder = tmp_path / "run"
    env = {k: v for k, v in ENV.items() if not k.startswith(("TPU_", "SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env = {**env, "MASTER_PORT": str(_free_port()), "PATH": f"{os.path.dirname(sys.executable)}:{env['PATH']}"}
    args = [
        "--config",
        "configs/llama3_debug.toml",
        "--training.steps=10000",
        "--training.seq_len=32",
        "--model.n_layers=1",
        "--model.attn_backend=sdpa",
        "--metrics.log_freq=1",
        "--validation.enable=false",
        "--metrics.enable_tensorboard=false",
        "--training.local_batch_size=1",
        "--parallelism.data_parallel_shard_degree=2",
        "--checkpoint.enable=true",
        "--checkpoint.interval=100000",
        f"--job.dump_folder={folder}",
    ]
    log = open(tmp_path / "log.txt", "w+")
    proc = subprocess.Popen(
        ["bash", "scripts/launch_pod.sh", "local", "2", "1", "--", *args],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    metrics, deadline = folder / "metrics.jsonl", time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the job ended before it could be preempted"
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.seek(0)
        out = log.read()
    assert proc.returncode == 75, out[-3000:]
    assert out.count("launch: preempted: all 1 workers of this node exited 75") == 2, out[-3000:]
    saved = [d for d in os.listdir(folder / "checkpoints") if d.startswith("step-")]
    assert len(saved) == 1, saved


# --- SIGKILL to the launcher: torchrun and its workers do not outlive it ---------------------------


def _children_of(pids: set[int]) -> set[int]:
    """Every live descendant of `pids` (/proc's parent links)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, todo = set(), set(pids)
    while todo:
        kids = {pid for pid, ppid in parents.items() if ppid in todo and pid not in found}
        found |= kids
        todo = kids
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped
    except OSError:
        return False


@pytest.mark.linux
@pytest.mark.multiprocess
def test_sigkill_to_the_launcher_stops_torchrun_and_a_relaunch_starts(tmp_path):
    """`kill -9` of `python -m trainer.launch` (1 CPU worker, the debug model): torchrun gets SIGTERM
    from the kernel (PR_SET_PDEATHSIG), stops its worker, and the run folder's lock goes with them;
    the same command then starts and finishes. Before: torchrun and the worker kept training,
    orphaned, and the relaunch was refused (`error: job.dump_folder: ... in use`, exit 2)."""
    import signal
    import time

    folder = tmp_path / "run"
    env = {k: v for k, v in ENV.items() if not k.startswith(("TPU_", "SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}

    def command(steps: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "trainer.launch",
            "--platform",
            "manual",
            "--device",
            "cpu",
            "--nnodes",
            "1",
            "--node-rank",
            "0",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            "--nproc-per-node",
            "1",
            "--",
            "--config",
            "configs/llama3_debug.toml",
            f"--training.steps={steps}",
            "--training.seq_len=32",
            "--model.n_layers=1",
            "--model.attn_backend=sdpa",
            "--metrics.log_freq=1",
            "--validation.enable=false",
            "--metrics.enable_tensorboard=false",
            "--checkpoint.enable=false",
            "--training.local_batch_size=1",
            f"--job.dump_folder={folder}",
        ]

    log = open(tmp_path / "first.txt", "w+")
    first = subprocess.Popen(command(100000), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    spawned: set[int] = set()
    try:
        metrics, deadline = folder / "metrics.jsonl", time.monotonic() + 240
        while first.poll() is None and time.monotonic() < deadline:
            spawned |= _children_of({first.pid})
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        spawned |= _children_of({first.pid})
        assert first.poll() is None, "the first run ended before it was killed"
        assert spawned, "no torchrun under the launcher"
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        deadline = time.monotonic() + 90  # torchrun's shutdown timeout (30 s) and the start-up's margin
        while any(_alive(p) for p in spawned) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = sorted(p for p in spawned if _alive(p))
        assert not left, f"processes of the killed launcher still running: {left}"
        again = subprocess.run(command(2), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    finally:
        for pid in spawned:  # only what this test started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
