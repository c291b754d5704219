"""Probe (ttpu venv): trainer.launch's TPU plans against the real torch-tpu 0.2.0 launch module.

For each simulated host (TPU VM metadata or GKE variables; no TPU here) it builds the plan with
`trainer.launch.build_plan`, whose `torch_tpu_launch_env` runs the real
`python -m torch.tpu.distributed` of this venv, and records the plan, the variables handed to
torch-tpu and what it printed back (or the one-line error the launcher makes of its failure).
With `--before` for a case it also runs torch-tpu with what the launcher passed before the
NODE_RANK fix (host list and worker id only): the control. The cases run two at a time.

Prints one JSON line: {"torch_tpu": version, "cases": {name: {...}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version

from models.errors import ConfigError
from trainer import launch

# Variables a launcher or torch-tpu sets; none may leak in from the probe's own environment.
LAUNCH_VARS = (
    "TPU_WORKER_HOSTNAMES",
    "TPU_WORKER_ID",
    "JOB_COMPLETION_INDEX",
    "TPU_ACCELERATOR_TYPE",
    "TPU_CHIPS_PER_HOST_BOUNDS",
    "NODE_RANK",
    "NNODES",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "TORCH_TPU_TOPOLOGY",
    "TORCH_TPU_SLICEBUILDER_ADDRESSES",
    "TORCH_TPU_DEVICES_PER_HOST",
    "TORCH_TPU_BASE_PORT",
    "TORCH_TPU_XPROF_SESSION_ID",
)
BASE = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}


def _endpoints(n: int) -> str:
    return ",".join(f"{i}:8470:10.0.0.{i + 2}" for i in range(n))


# name: (platform, platform variables or TPU VM metadata, run the before-the-fix control)
CASES = {
    "tpu-vm v6e-8, 1 host": (
        "tpu-vm",
        {"agent-worker-number": "0", "accelerator-type": "v6e-8", "worker-network-endpoints": _endpoints(1)},
        False,
    ),
    "tpu-vm v5p-16, 2 hosts, worker 1": (
        "tpu-vm",
        {"agent-worker-number": "1", "accelerator-type": "v5p-16", "worker-network-endpoints": _endpoints(2)},
        True,
    ),
    "tpu-vm v6e-16, 4 hosts, worker 2": (
        "tpu-vm",
        {"agent-worker-number": "2", "accelerator-type": "v6e-16", "worker-network-endpoints": _endpoints(4)},
        True,
    ),
    "gke v6e-16, 4 hosts, JOB_COMPLETION_INDEX 3": (
        "gke",
        {
            "TPU_WORKER_HOSTNAMES": "w0.job,w1.job,w2.job,w3.job",
            "JOB_COMPLETION_INDEX": "3",
            "TPU_ACCELERATOR_TYPE": "v6e-16",
            "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        },
        True,
    ),
    "tpu-vm tpu7x-8, 1 host": (
        "tpu-vm",
        {"agent-worker-number": "0", "accelerator-type": "tpu7x-8", "worker-network-endpoints": _endpoints(1)},
        False,
    ),
}


def _args(platform: str) -> argparse.Namespace:
    return argparse.Namespace(
        platform=platform,
        device="tpu",
        nnodes=None,
        node_rank=None,
        master_addr=None,
        master_port=None,
        nproc_per_node=None,
    )


def after(platform: str, values: dict) -> dict:
    """The launcher as it is: the plan, what torch-tpu was given, and the env the workers get."""
    seen = {}

    def tpu_env(env):
        seen.update({k: env[k] for k in LAUNCH_VARS if k in env})
        return launch.torch_tpu_launch_env(env)

    env = BASE if platform == "tpu-vm" else {**BASE, **values}
    try:
        plan = launch.build_plan(_args(platform), env, metadata=lambda: values, tpu_env=tpu_env)
    except ConfigError as e:
        return {"to_torch_tpu": seen, "error": f"error: {e}"}
    return {
        "to_torch_tpu": seen,
        "nnodes": plan.nnodes,
        "node_rank": plan.node_rank,
        "nproc_per_node": plan.nproc_per_node,
        "master": f"{plan.master_addr}:{plan.master_port}",
        "env": plan.env,
    }


def before(platform: str, values: dict) -> dict:
    """What the launcher handed torch-tpu before the fix: host list and worker id (GKE: plus its
    own JOB_COMPLETION_INDEX), run through today's error path."""
    if platform == "tpu-vm":
        hosts = [e.rsplit(":", 1)[-1] for e in values["worker-network-endpoints"].split(",")]
        given = {"TPU_WORKER_HOSTNAMES": ",".join(hosts), "TPU_WORKER_ID": values["agent-worker-number"]}
    else:
        given = {k: values[k] for k in ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "JOB_COMPLETION_INDEX") if k in values}
    try:
        out = launch.torch_tpu_launch_env({**BASE, **given, "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    except ConfigError as e:
        return {"to_torch_tpu": given, "error": f"error: {e}"}
    return {"to_torch_tpu": given, "env": out}


def main() -> None:
    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, (platform, values, control) in CASES.items():
            jobs[(name, "after")] = pool.submit(after, platform, values)
            if control:
                jobs[(name, "before")] = pool.submit(before, platform, values)
        cases = {}
        for (name, which), job in jobs.items():
            cases.setdefault(name, {})[which] = job.result()
    print(json.dumps({"torch_tpu": version("torch-tpu"), "python": sys.version.split()[0], "cases": cases}))


if __name__ == "__main__":
    main()
