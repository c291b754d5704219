"""trainer.launch against the real torch-tpu 0.2.0 launch module (ttpu venv, no TPU needed).

The probe (probes/launch_env.py) builds the launcher's plan for simulated hosts of a TPU VM
slice (metadata) and of a GKE JobSet, and lets the real `python -m torch.tpu.distributed` fill in
its variables; this file checks what the workers would get. The control runs torch-tpu with
what the launcher passed before the NODE_RANK fix (host list and worker id): on a TPU VM slice
it fails with torch-tpu's ValueError, which the launcher now reports as one `error:` line.
Without a TPU, torch-tpu's single-host path refuses ("expected TPU devices, got none"): the
single-host cases check the plan and that this refusal comes back as that one line.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.xla.conftest import ROOT, _probe_env, run_probe, xla_python

pytestmark = pytest.mark.xla

NODE_RANK_ERROR = (
    "error: launch: python -m torch.tpu.distributed failed (exit 1): ValueError: set_tpu_launch_env(): "
    "expected either TPU device coordinates together with environment variable TORCH_TPU_TOPOLOGY, or "
    "environment variable JOB_COMPLETION_INDEX"
)
NO_TPU_ERROR = (
    "error: launch: python -m torch.tpu.distributed failed (exit 1): ValueError: set_tpu_launch_env(): "
    "expected TPU devices, got none; allowed: a TPU host where torch.tpu.distributed runs"
)


@pytest.fixture(scope="module")
def launch_env() -> dict:
    return run_probe("ttpu", "launch_env.py", timeout=900)


def _addresses(hosts: list[str], per_host: int) -> str:
    return ",".join(f"{h}:{8070 + i}" for h in hosts for i in range(per_host))


@pytest.mark.parametrize(
    "name, hosts, worker",
    [
        ("tpu-vm v5p-16, 2 hosts, worker 1", ["10.0.0.2", "10.0.0.3"], 1),
        ("tpu-vm v6e-16, 4 hosts, worker 2", ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"], 2),
        ("gke v6e-16, 4 hosts, JOB_COMPLETION_INDEX 3", ["w0.job", "w1.job", "w2.job", "w3.job"], 3),
    ],
)
def test_multi_host_env_from_real_torch_tpu(launch_env, name, hosts, worker):
    after = launch_env["cases"][name]["after"]
    assert "error" not in after, after
    # the plan: one torchrun node per host, 4 devices per host (4 chips, 1 device each), rendezvous at host 0
    assert (after["nnodes"], after["node_rank"], after["nproc_per_node"]) == (len(hosts), worker, 4)
    assert after["master"] == f"{hosts[0]}:29501"
    env = after["env"]
    # what torch-tpu read from us, kept (it never overwrites) and echoed back
    assert (env["NODE_RANK"], env["NNODES"]) == (str(worker), str(len(hosts)))
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (hosts[0], "29501")
    # torch-tpu's own: one slice-builder address per device, hosts in worker order, 4 ports each
    # (without TORCH_TPU_DEVICES_PER_HOST it would give 8 here: no TPU to count)
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == _addresses(hosts, 4)
    assert env["TORCH_TPU_XPROF_SESSION_ID"].isdigit()
    # its global WORLD_SIZE is dropped; its empty TORCH_TPU_TOPOLOGY (no TPU here) is not exported
    assert "WORLD_SIZE" not in env and "TORCH_TPU_TOPOLOGY" not in env
    assert env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "1"


@pytest.mark.parametrize("name", ["tpu-vm v5p-16, 2 hosts, worker 1", "tpu-vm v6e-16, 4 hosts, worker 2"])
def test_control_tpu_vm_without_node_rank_fails_in_torch_tpu(launch_env, name):
    """Before the fix the launcher gave torch-tpu only the host list and worker id."""
    before = launch_env["cases"][name]["before"]
    assert "NODE_RANK" not in before["to_torch_tpu"]
    assert before["error"].startswith(NODE_RANK_ERROR)
    assert "\n" not in before["error"]


def test_control_gke_worked_before_through_job_completion_index(launch_env):
    """GKE escaped the bug: JobSet's JOB_COMPLETION_INDEX gives torch-tpu the node rank. Without a
    TPU to count, it then listed 8 ports per host and its own MASTER_PORT (29500, not the
    rendezvous port); the fix passes both."""
    before = launch_env["cases"]["gke v6e-16, 4 hosts, JOB_COMPLETION_INDEX 3"]["before"]
    assert before["env"]["NODE_RANK"] == "3" and before["env"]["MASTER_PORT"] == "29500"
    assert before["env"]["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == _addresses(["w0.job", "w1.job", "w2.job", "w3.job"], 8)


@pytest.mark.parametrize("name, nproc", [("tpu-vm v6e-8, 1 host", 8), ("tpu-vm tpu7x-8, 1 host", 8)])
def test_single_host_plan_and_torch_tpu_refusal_without_a_tpu(launch_env, name, nproc):
    after = launch_env["cases"][name]["after"]
    given = after["to_torch_tpu"]
    # v6e-8: 8 chips; tpu7x-8: 4 chips x 2 TensorCores (before the fix: "pass --nproc-per-node")
    assert given["TORCH_TPU_DEVICES_PER_HOST"] == str(nproc)
    assert (given["NODE_RANK"], given["NNODES"]) == ("0", "1")
    assert after["error"] == NO_TPU_ERROR


def test_cli_reports_torch_tpu_failure_as_one_error_line():
    """`python -m trainer.launch` in the ttpu venv, one simulated GKE host, no TPU: exit 2 and
    exactly one stderr line carrying torch-tpu's message (was a CalledProcessError traceback)."""
    env = {
        k: v
        for k, v in _probe_env().items()
        if not k.startswith(("TPU_WORKER", "JOB_COMPLETION", "NODE_RANK", "NNODES", "MASTER_", "TORCH_TPU_"))
    }
    env.update(TPU_WORKER_HOSTNAMES="h0", TPU_WORKER_ID="0", TPU_CHIPS_PER_HOST_BOUNDS="2,2,1")
    out = subprocess.run(
        [
            str(xla_python("ttpu")),
            "-m",
            "trainer.launch",
            "--platform",
            "gke",
            "--dry-run",
            "--",
            "--config",
            "configs/llama3_debug.toml",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip() == NO_TPU_ERROR
