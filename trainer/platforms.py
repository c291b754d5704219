"""Where this host is in a job, per platform: the launch plan `trainer.launch` runs torchrun from.

`plan_gke` (GKE / XPK: `TPU_WORKER_HOSTNAMES`, `TPU_WORKER_ID`, ...), `plan_tpu_vm` (the TPU VM
metadata server), `plan_slurm` (GPU clusters) and the manual flags each give a `LaunchPlan`: nodes,
this node's rank, processes per node, the rendezvous address, the device, and the environment the
workers get. Several slices (`Multislice`, from the MegaScale variables of the environment or the
TPU VM's `tpu-env` metadata) make the job's node rank and count from the slice's, with the
coordinator given a port as libtpu expects (`coordinator_address`, `multislice_env`).
trainer/launch.py's docstring has the platform table and the multislice contract. Bad or missing
variables: `ConfigError` naming the variable (one `error:` line, exit 2, at the launcher).
"""

from __future__ import annotations

import math
import os
import re
import sys
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

from models.errors import ConfigError

DEFAULT_PORT = 29501
_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"


@dataclass
class LaunchPlan:
    platform: str
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    device: str  # tpu | cuda | cpu: what the workers train on
    env: dict[str, str] = field(default_factory=dict)  # exported to torchrun and its workers
    multislice: Multislice | None = None
    unset: tuple[str, ...] = ()  # removed from the environment torchrun and its workers inherit

    def child_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The environment torchrun runs in: `environ` less `unset`, plus `env`."""
        return {**{k: v for k, v in environ.items() if k not in self.unset}, **self.env}

    def process_envs(self) -> list[dict[str, str]]:
        """Each local process's launch variables as its worker sees them (torchrun's own per worker:
        RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT; plus this plan's `env`),
        for `--dry-run`: the MegaScale and slice-builder view of every process of this host."""
        world = self.nnodes * self.nproc_per_node
        out = []
        for local in range(self.nproc_per_node):
            worker = {
                "RANK": str(self.node_rank * self.nproc_per_node + local),
                "LOCAL_RANK": str(local),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
                "GROUP_RANK": str(self.node_rank),
            }
            # torchrun gives every worker the rendezvous as MASTER_ADDR/PORT, over the launcher's
            out.append({**self.env, **worker, "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)})
        return out

    def torchrun_argv(self, train_args: list[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.nnodes}",
            f"--node_rank={self.node_rank}",
            f"--nproc_per_node={self.nproc_per_node}",
            "--rdzv_backend=static",
            f"--rdzv_endpoint={self.master_addr}:{self.master_port}",
            f"--master_addr={self.master_addr}",
            f"--master_port={self.master_port}",
            "-m",
            "trainer.train",
            *train_args,
        ]


def _int(env: Mapping[str, str], name: str, *, allowed: str) -> int:
    value = env.get(name)
    if value is None or not value.strip().lstrip("-").isdigit():
        raise ConfigError(f"launch: environment variable {name} is {value!r}; allowed: {allowed}")
    return int(value)


def _bounds_product(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    parts = value.split(",")
    if not value or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(
            f"launch: environment variable {name} is {value!r}; allowed: comma-separated "
            "positive chip counts such as 2,2,1 (or pass --nproc-per-node)"
        )
    return math.prod(int(p) for p in parts)


MEGASCALE_KEYS = ("MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_PORT")


@dataclass(frozen=True)
class Multislice:
    """This host's slice in a multislice job (MegaScale variables); `None` from `read_multislice`
    when the job is one slice."""

    num_slices: int
    slice_id: int
    coordinator: str
    """`MEGASCALE_COORDINATOR_ADDRESS` as given (`host` or `host:port`)."""
    source: str
    """Where the variables came from: `environment` or `metadata tpu-env`."""
    port: str = ""
    """`MEGASCALE_PORT` ("" when not given: libtpu's default)."""

    @property
    def coordinator_host(self) -> str:
        host = self.coordinator.strip()
        if host.startswith("["):  # [ipv6]:port
            return host[1 : host.index("]")] if "]" in host else host
        return host.rsplit(":", 1)[0] if host.count(":") == 1 else host

    def job(self, hosts_per_slice: int, worker: int) -> tuple[int, int]:
        """(global node rank, nodes): slices are numbered slice-major, as jax numbers processes."""
        return self.slice_id * hosts_per_slice + worker, self.num_slices * hosts_per_slice


def parse_tpu_env(text: str) -> dict[str, str]:
    """The `tpu-env` metadata attribute of a TPU VM: `KEY: 'value'` lines."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key.strip()):
            out[key.strip()] = value.strip().strip("'\"")
    return out


def read_multislice(env: Mapping[str, str], *, tpu_env: Mapping[str, str] | None = None) -> Multislice | None:
    """The multislice place of this host from the MegaScale variables (`env` first, then the TPU
    VM's `tpu-env` metadata), or None for a single slice. ConfigError naming the variable when they
    are inconsistent: a slice count that is not >= 1, a slice id outside 0..slices-1, no coordinator."""
    tpu_env = tpu_env or {}
    values = {k: env[k] for k in MEGASCALE_KEYS if env.get(k, "").strip()}
    source = "environment"
    if "MEGASCALE_NUM_SLICES" not in values and tpu_env.get("MEGASCALE_NUM_SLICES", "").strip():
        values = {k: tpu_env[k] for k in MEGASCALE_KEYS if tpu_env.get(k, "").strip()}
        source = "metadata tpu-env"
    if "MEGASCALE_NUM_SLICES" not in values:
        return None
    where = f"({source})"
    num = values["MEGASCALE_NUM_SLICES"].strip()
    if not num.isdigit() or int(num) < 1:
        raise ConfigError(
            f"launch: MEGASCALE_NUM_SLICES is {num!r} {where}; allowed: the number of slices, >= 1 "
            "(XPK --num-slices, or the queued resource's node count)"
        )
    if int(num) == 1:
        return None
    slice_id = values.get("MEGASCALE_SLICE_ID", "").strip()
    if not slice_id.isdigit() or int(slice_id) >= int(num):
        raise ConfigError(
            f"launch: MEGASCALE_SLICE_ID is {slice_id or 'not set'} {where} with MEGASCALE_NUM_SLICES={num}; "
            f"allowed: this host's slice, 0..{int(num) - 1}"
        )
    coordinator = values.get("MEGASCALE_COORDINATOR_ADDRESS", "").strip()
    if not coordinator:
        raise ConfigError(
            f"launch: MEGASCALE_COORDINATOR_ADDRESS is not set {where} with MEGASCALE_NUM_SLICES={num}; "
            "allowed: host[:port] of the first host of slice 0 (XPK and queued resources set it)"
        )
    return Multislice(int(num), int(slice_id), coordinator, source, values.get("MEGASCALE_PORT", "").strip())


def devices_per_chip(accelerator_type: str) -> int:
    """2 on TPU v7x (Ironwood: two TensorCores per chip, each a torch-tpu device), else 1."""
    kind = accelerator_type.lower()
    return 2 if kind.startswith(("tpu7x", "v7x", "tpu7", "v7")) else 1


def _tpu_plan(
    platform: str,
    *,
    hosts: list[str],
    worker: int,
    accelerator: str,
    chips_per_host: int | None,
    port: int,
    nproc_override: int | None,
    device: str,
    where: str,
    multislice: Multislice | None = None,
) -> LaunchPlan:
    if not hosts or any(not h for h in hosts):
        raise ConfigError(f"launch: {where} gives no host list; allowed: comma-separated hostnames, host 0 first")
    if not 0 <= worker < len(hosts):
        raise ConfigError(
            f"launch: worker id {worker} is outside the {len(hosts)} hosts of {where}; allowed: 0..{len(hosts) - 1}"
        )
    if nproc_override is not None:
        nproc = nproc_override
    elif chips_per_host is None:
        raise ConfigError(f"launch: chips per host unknown ({where}); allowed: pass --nproc-per-node")
    else:
        nproc = chips_per_host * devices_per_chip(accelerator)
    env = {"TPU_WORKER_HOSTNAMES": ",".join(hosts), "TPU_WORKER_ID": str(worker)}
    if device == "tpu":
        # What torch-tpu's set_tpu_launch_env reads and cannot work out itself on a TPU VM
        # slice (it never reads TPU_WORKER_ID); it keeps every value that is already set.
        env.update(
            TORCH_DEVICE_BACKEND_AUTOLOAD="1",
            NODE_RANK=str(worker),
            NNODES=str(len(hosts)),
            MASTER_ADDR=hosts[0],
            MASTER_PORT=str(port),
            TORCH_TPU_DEVICES_PER_HOST=str(nproc),
        )
    node_rank, nnodes, master = worker, len(hosts), hosts[0]
    if multislice is not None:
        # torch-tpu's variables above stay the slice's; torchrun's world is every slice's hosts
        node_rank, nnodes = multislice.job(len(hosts), worker)
        master = multislice.coordinator_host
        env.update(multislice_env(multislice))
    return LaunchPlan(
        platform,
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        master_addr=master,
        master_port=port,
        device=device,
        env=env,
        multislice=multislice,
        unset=MULTISLICE_UNSET if multislice is not None else (),
    )


MEGASCALE_DEFAULT_PORT = "8080"
"""libtpu's MegaScale port when MEGASCALE_PORT is not set (torch-tpu's own example: <MASTER_ADDR>:8080)."""


def coordinator_address(coordinator: str, port: str = "") -> str:
    """`MEGASCALE_COORDINATOR_ADDRESS` with a port: `host` -> `host:${MEGASCALE_PORT:-8080}`, an
    address that has one kept (`host:port`, `[v6]:port`; a bare IPv6 address is bracketed).

    torch-tpu runs several processes per host, and libtpu appends each *process's own*
    MEGASCALE_PORT to a port-less coordinator, so the processes would disagree on where the
    coordinator is; torch-tpu's own error text asks for an address with a port."""
    address = coordinator.strip()
    port = port.strip() or MEGASCALE_DEFAULT_PORT
    if address.startswith("["):
        return address if "]:" in address else f"{address}:{port}"
    if address.count(":") == 1:
        return address
    if address.count(":") > 1:  # a bare IPv6 address
        return f"[{address}]:{port}"
    return f"{address}:{port}"


def multislice_env(multislice: Multislice) -> dict[str, str]:
    """The MegaScale variables every worker (libtpu, the trainer's slice check) reads: the slice
    count, this slice's id, and the coordinator with a port (`coordinator_address`). Never one
    MEGASCALE_PORT for every process of a host: the plan unsets it (`MULTISLICE_UNSET`), torch-tpu
    owns the per-process ports."""
    return {
        "MEGASCALE_NUM_SLICES": str(multislice.num_slices),
        "MEGASCALE_SLICE_ID": str(multislice.slice_id),
        "MEGASCALE_COORDINATOR_ADDRESS": coordinator_address(multislice.coordinator, multislice.port),
    }


MULTISLICE_UNSET = ("MEGASCALE_PORT",)
"""Taken out of the workers' environment on a multislice host: XPK sets one MEGASCALE_PORT per pod,
which would be every process's; its value went into the coordinator address."""


def plan_gke(
    env: Mapping[str, str], *, port: int, nproc_override: int | None = None, device: str = "tpu"
) -> LaunchPlan:
    """GKE TPU pods (also XPK workloads): one pod per TPU VM host."""
    hosts = [h.strip() for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if not hosts:
        raise ConfigError(
            "launch: environment variable TPU_WORKER_HOSTNAMES is not set; allowed: the "
            "comma-separated TPU hosts of the slice (GKE sets it), host 0 first"
        )
    name = "TPU_WORKER_ID" if "TPU_WORKER_ID" in env else "JOB_COMPLETION_INDEX"
    worker = _int(
        env, name, allowed="this host's index in TPU_WORKER_HOSTNAMES (TPU_WORKER_ID or JOB_COMPLETION_INDEX)"
    )
    chips = _bounds_product(env, "TPU_CHIPS_PER_HOST_BOUNDS") if nproc_override is None else None
    return _tpu_plan(
        "gke",
        hosts=hosts,
        worker=worker,
        accelerator=env.get("TPU_ACCELERATOR_TYPE", ""),
        chips_per_host=chips,
        port=port,
        nproc_override=nproc_override,
        device=device,
        where="TPU_WORKER_HOSTNAMES",
        multislice=read_multislice(env),
    )


def read_tpu_vm_metadata(
    keys=("agent-worker-number", "worker-network-endpoints", "accelerator-type"),
    optional=("tpu-env",),
) -> dict[str, str]:
    """The TPU VM's own attributes from the GCE metadata server (only reachable on a TPU VM);
    `optional` ones (`tpu-env`: the MegaScale variables of a multislice queued resource) may be absent."""
    out = {}
    for key in optional:
        req = urllib.request.Request(_METADATA_URL + key, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                out[key] = r.read().decode()
        except OSError:
            pass
    for key in keys:
        req = urllib.request.Request(_METADATA_URL + key, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                out[key] = r.read().decode().strip()
        except OSError as e:
            raise ConfigError(
                f"launch: TPU VM metadata {key} unreadable ({e}); allowed: --platform tpu-vm "
                "only on a TPU VM (elsewhere use gke, slurm or manual)"
            ) from None
    return out


def _tpu_vm_chips_per_host(accelerator: str, n_hosts: int) -> int | None:
    """Chips per host of a TPU VM slice (its metadata has no per-host bound).

    Multi-host slices of v4, v5e, v5p, v6e and v7x have 4 chips per host. A single host has the
    whole slice: the size suffix counts chips on v5e (`v5litepod-8`) and v6e, TensorCores (2 per
    chip) on v4, v5p and v7x (`tpu7x-8`: 4 chips, 8 devices; Google's v5p convention, not seen on
    a machine here); for other names None (pass --nproc-per-node).
    """
    if n_hosts > 1:
        return 4
    m = re.match(r"^((?:v|tpu)\d+\w*)-(\d+)$", accelerator.lower())
    if not m:
        return None
    kind, count = m.group(1), int(m.group(2))
    if kind in ("v4", "v5p", "tpu7x", "v7x", "tpu7"):
        return max(count // 2, 1)
    if kind in ("v5litepod", "v5e", "v6e"):
        return count
    return None


def plan_tpu_vm(
    metadata: Mapping[str, str],
    *,
    port: int,
    nproc_override: int | None = None,
    device: str = "tpu",
    env: Mapping[str, str] | None = None,
) -> LaunchPlan:
    # worker-network-endpoints: "id:?:ip,id:?:ip,..." in worker order; the address is the last field.
    endpoints = [e.strip() for e in metadata.get("worker-network-endpoints", "").split(",") if e.strip()]
    hosts = [e.rsplit(":", 1)[-1] for e in endpoints]
    worker = _int(metadata, "agent-worker-number", allowed="the TPU VM worker number")
    accelerator = metadata.get("accelerator-type", "")
    return _tpu_plan(
        "tpu-vm",
        hosts=hosts,
        worker=worker,
        accelerator=accelerator,
        chips_per_host=_tpu_vm_chips_per_host(accelerator, max(len(hosts), 1)),
        port=port,
        nproc_override=nproc_override,
        device=device,
        where="metadata worker-network-endpoints",
        multislice=read_multislice(env or {}, tpu_env=parse_tpu_env(metadata.get("tpu-env", ""))),
    )


def first_slurm_host(nodelist: str) -> str:
    """Host 0 of a Slurm node list: `gpu[003-010,12],cpu1` -> `gpu003`."""
    m = re.match(r"^([^\[,]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m or not m.group(1):
        raise ConfigError(
            f"launch: SLURM_JOB_NODELIST {nodelist!r} is not a Slurm node list; allowed: e.g. gpu[003-010,12],cpu1"
        )
    prefix, ranges = m.group(1), m.group(2)
    return prefix if not ranges else prefix + ranges.split(",")[0].split("-")[0]


def plan_slurm(
    env: Mapping[str, str], *, port: int, nproc_override: int | None = None, device: str = "cuda"
) -> LaunchPlan:
    nnodes = _int(env, "SLURM_NNODES", allowed="the job's node count (Slurm sets it)")
    rank = _int(env, "SLURM_NODEID", allowed="this node's index (Slurm sets it)")
    if nnodes < 1:
        raise ConfigError(
            f"launch: environment variable SLURM_NNODES is {nnodes}; allowed: the job's node "
            "count, >= 1 (Slurm sets it)"
        )
    if not 0 <= rank < nnodes:
        raise ConfigError(
            f"launch: environment variable SLURM_NODEID is {rank}; allowed: this node's index, "
            f"0 .. SLURM_NNODES - 1 = {nnodes - 1} (Slurm sets it)"
        )
    if "SLURM_JOB_NODELIST" not in env:
        raise ConfigError("launch: environment variable SLURM_JOB_NODELIST is not set; allowed: the job's node list")
    nproc = nproc_override if nproc_override is not None else _local_gpus()
    return LaunchPlan(
        "slurm",
        nnodes=nnodes,
        node_rank=rank,
        nproc_per_node=nproc,
        master_addr=first_slurm_host(env["SLURM_JOB_NODELIST"]),
        master_port=port,
        device=device,
    )


def _local_gpus() -> int:
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise ConfigError("launch: no CUDA device on this host; allowed: pass --nproc-per-node for a CPU run")
    return n


def detect_platform(env: Mapping[str, str]) -> str:
    if "TPU_WORKER_HOSTNAMES" in env:
        return "gke"
    if "SLURM_JOB_NODELIST" in env and "SLURM_NNODES" in env:
        return "slurm"
    if os.path.exists("/dev/vfio") or os.path.exists("/dev/accel0"):
        return "tpu-vm"
    return "manual"
