"""Multi-host launcher: `python -m trainer.launch [options] -- --config RECIPE.toml [overrides]`.

Run the same command on every host of a job; it works out this host's place in the job from the
platform's environment and starts `torchrun` with a **static rendezvous** (no etcd, no c10d
rendezvous round: node 0's address and the node rank are known up front, which is what TPU
slices and GKE JobSets give you):

    torchrun --nnodes N --node_rank R --nproc_per_node P \\
             --rdzv_backend static --rdzv_endpoint HOST0:PORT -m trainer.train ...

Platforms (`--platform`, default `auto` = the first whose variables are present):

| platform | where the job's shape comes from |
|---|---|
| `gke`    | GKE TPU node pools / XPK: `TPU_WORKER_HOSTNAMES` (host 0 first), `TPU_WORKER_ID` or `JOB_COMPLETION_INDEX`, `TPU_ACCELERATOR_TYPE`, `TPU_CHIPS_PER_HOST_BOUNDS` |
| `tpu-vm` | a TPU VM slice (`gcloud compute tpus tpu-vm ssh --worker=all`): the VM metadata server's `agent-worker-number`, `worker-network-endpoints`, `accelerator-type` |
| `slurm`  | GPU clusters under Slurm: `SLURM_NNODES`, `SLURM_NODEID`, `SLURM_JOB_NODELIST`; one process per visible GPU |
| `manual` | `--nnodes/--node-rank/--master-addr/--nproc-per-node` (any other cluster) |

**Several slices (multislice, DCN).** The MegaScale variables say which slice this host is on:
`MEGASCALE_NUM_SLICES`, `MEGASCALE_SLICE_ID`, `MEGASCALE_COORDINATOR_ADDRESS` (`host[:port]`, the
first host of slice 0) and `MEGASCALE_PORT`. XPK / GKE JobSets put them in each pod's environment;
a TPU VM of a multislice queued resource has them in its `tpu-env` metadata attribute
(`MEGASCALE_NUM_SLICES: '2'` lines; the process environment wins where both are set, as in
jax's `cloud_tpu_cluster.get_tpu_env_value`). The host list and worker id are then the slice's, and
the job's are derived (`Multislice`): node rank = slice id x hosts per slice + worker id, nodes =
slices x hosts per slice, rendezvous at the coordinator's host. torch-tpu's launch variables stay the
slice's own (its slice builder is per slice); libtpu joins the slices through the MegaScale
variables: the slice count and id as given, the coordinator with a port (`host` becomes
`host:${MEGASCALE_PORT:-8080}`: libtpu would append each process's own port to a port-less one,
and torch-tpu runs several processes per host), and no MEGASCALE_PORT (one value for every
process of a host would be wrong; torch-tpu owns the per-process ports). Which rank torch-tpu
uses to index its per-slice address list cannot be checked without two slices: the launcher says
so on every multislice start. A slice count < 1, a slice id outside the slices or a missing
coordinator is one `error:` line, exit 2.

Processes per host: one per TPU *device*, i.e. the product of `TPU_CHIPS_PER_HOST_BOUNDS`
times 2 on v7x (two TensorCores per chip, each its own device), times 1 elsewhere; one per GPU.
On TPU the torch-tpu launch variables (`TORCH_TPU_TOPOLOGY`, `TORCH_TPU_SLICEBUILDER_ADDRESSES`,
...) come from `python -m torch.tpu.distributed` (torch-tpu 0.2.0's `set_tpu_launch_env`), run
here with everything it reads already set from the plan: `TPU_WORKER_HOSTNAMES`, `NODE_RANK`
(the worker id: torch-tpu itself finds it only in `JOB_COMPLETION_INDEX` or from device
coordinates plus a slice topology), `NNODES`, `MASTER_ADDR`/`MASTER_PORT` (the rendezvous) and
`TORCH_TPU_DEVICES_PER_HOST` (its slice-builder address list has that many ports per host; it
would guess 8 on a host without a visible TPU). Its output is exported to torchrun's workers; its
`WORLD_SIZE` is the global size and is *not* used for `--nproc_per_node`, and the empty values it
prints for what it could not detect are not exported. `--dry-run` prints the plan and the command
instead of running it, then one `# process` line per local process with its ranks, MegaScale and
slice-builder variables (`process_lines`).

The recipe is loaded once here before anything starts (`check_train_args`): a bad key, or a pod
recipe whose checkpoint folder is still the `gs://YOUR_BUCKET/...` placeholder, is one `error:`
line, exit 2.

Bad or missing launch variables give one `error:` line naming the variable and exit code 2; so
does a failure of `python -m torch.tpu.distributed` (the line carries its error message) and a
TPU launch from a Python without torch-tpu.

Exit codes an orchestrator can act on (`run_torchrun`): torchrun runs as a child in its own
session, and the launcher exits with 0 on success, **75 when every worker of this node exited 75**
(preempted: each wrote its checkpoint; read from the codes the workers record,
trainer/runtime/exit_status.py, since torchrun itself exits 1 either way), 2 when the workers that
recorded a code all said 2 (bad input), 130 after a Ctrl-C, else torchrun's code (never 75). SIGTERM
or SIGINT sent to the launcher is passed to torchrun once, which passes it to the workers: on
SIGTERM they finish the step, save, exit 75; on SIGINT (Ctrl-C) each stops at once with one
`interrupted` line (no traceback) and exit 130. If the launcher is killed (SIGKILL), the kernel
sends torchrun SIGTERM (`parent_death_signal`), so the workers stop and release the run folder:
a relaunch starts. torchrun's failure report is one line, not a traceback. Options and bad options go through trainer/runtime/cli.py (`--help`; one `error:` line).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping

from models.errors import ConfigError
from trainer.platforms import (
    DEFAULT_PORT,
    LaunchPlan,
    detect_platform,
    plan_gke,
    plan_slurm,
    plan_tpu_vm,
    read_multislice,
    read_tpu_vm_metadata,
)
from trainer.runtime import cli
from trainer.runtime.exit_status import EXIT_STATUS_ENV, PREEMPTED_EXIT_CODE, launcher_exit_code, read_exit_statuses

TORCH_TPU_ENV_TIMEOUT_S = 300  # torch-tpu's own device-coordinate query may take 60 s
INSTALL_HINT = "source scripts/env.sh tpu (Python 3.11, constraints/tpu.txt; docs/tpu.md)"


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b:?")


def failure_summary(stderr: str, *, max_chars: int = 600) -> str:
    """The meaningful end of a failed Python child's stderr, as one line.

    The last exception line of its traceback (`ValueError: set_tpu_launch_env(): ...`), else the
    last non-empty line that is not a log or warning line; torch-tpu prints libtpu and tcmalloc
    warnings before (and absl log lines after) the error itself.
    """
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    pick = next((ln for ln in reversed(lines) if _EXCEPTION_LINE.match(ln)), None)
    if pick is None:
        noise = re.compile(r"^(?:[IW]\d{4} |WARNING|INFO|\[|.*Warning:)")
        pick = next((ln for ln in reversed(lines) if not noise.match(ln)), lines[-1] if lines else "")
    pick = " ".join(pick.split())
    return pick if len(pick) <= max_chars else pick[: max_chars - 3] + "..."


def _run_torch_tpu_distributed(argv: list[str], child_env: dict) -> str:
    if importlib.util.find_spec("torch_tpu") is None:
        raise ConfigError(
            f"launch: device tpu needs torch-tpu, which is not installed for {sys.executable}; "
            f"allowed: install it with `{INSTALL_HINT}`, or --device cpu|cuda"
        )
    try:
        out = subprocess.run(argv, env=child_env, capture_output=True, text=True, timeout=TORCH_TPU_ENV_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"launch: {shlex.join(argv[1:])} did not finish within {TORCH_TPU_ENV_TIMEOUT_S} s; "
            "allowed: a TPU host whose devices are free (no other process holding them)"
        ) from None
    if out.returncode != 0:
        raise ConfigError(
            f"launch: python -m torch.tpu.distributed failed (exit {out.returncode}): "
            f"{failure_summary(out.stderr) or 'no message'}; allowed: a TPU host where torch.tpu.distributed runs"
        )
    return out.stdout


def torch_tpu_launch_env(env: Mapping[str, str], run: Callable[[list[str], dict], str] | None = None) -> dict[str, str]:
    """torch-tpu's per-slice launch variables (`python -m torch.tpu.distributed`, KEY=VALUE lines).

    Its `WORLD_SIZE` is the global size; torchrun sets each worker's own, so it is dropped here,
    and so is every empty value (it prints `TORCH_TPU_TOPOLOGY=""` where it detected no TPU; an
    exported empty variable is not the same as an unset one). A failure of the command is a
    ConfigError carrying its error message (`failure_summary`).
    """
    out = (run or _run_torch_tpu_distributed)([sys.executable, "-m", "torch.tpu.distributed"], dict(env))
    values = {}
    for line in out.splitlines():
        key, sep, value = line.strip().removeprefix("export ").partition("=")
        value = value.strip().strip("'\"")
        if sep and value and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key):
            values[key] = value
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        values.pop(key, None)
    if "NODE_RANK" in env and values.get("NODE_RANK", env["NODE_RANK"]) != env["NODE_RANK"]:
        raise ConfigError(
            f"launch: python -m torch.tpu.distributed printed NODE_RANK={values['NODE_RANK']} for "
            f"NODE_RANK={env['NODE_RANK']}; allowed: the same (torch-tpu keeps a set value)"
        )
    return values


def build_plan(
    args: argparse.Namespace,
    env: Mapping[str, str],
    *,
    metadata: Callable[[], Mapping[str, str]] | None = None,
    tpu_env: Callable[[Mapping[str, str]], dict[str, str]] | None = None,
) -> LaunchPlan:
    """This host's plan from `args` and the environment `env`; `metadata` (the TPU VM's,
    default `read_tpu_vm_metadata`) and `tpu_env` (torch-tpu's launch variables, default
    `torch_tpu_launch_env`) are looked up when called."""
    metadata = metadata or read_tpu_vm_metadata
    tpu_env = tpu_env or torch_tpu_launch_env
    platform = detect_platform(env) if args.platform == "auto" else args.platform
    if args.master_port is not None:
        port, where = args.master_port, "--master-port"
    else:
        port, where = env.get("MASTER_PORT", str(DEFAULT_PORT)), "environment variable MASTER_PORT"
    if not str(port).strip().isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"launch: {where} is {port!r}; allowed: a TCP port, 1..65535")
    port = int(port)
    default_device = {"gke": "tpu", "tpu-vm": "tpu", "slurm": "cuda"}.get(platform, "auto")
    device = default_device if args.device == "auto" else args.device
    if platform == "gke":
        plan = plan_gke(env, port=port, nproc_override=args.nproc_per_node, device=device)
    elif platform == "tpu-vm":
        plan = plan_tpu_vm(metadata(), port=port, nproc_override=args.nproc_per_node, device=device, env=env)
    elif platform == "slurm":
        plan = plan_slurm(env, port=port, nproc_override=args.nproc_per_node, device=device)
    else:
        missing = [
            f"--{n}"
            for n in ("nnodes", "node-rank", "master-addr", "nproc-per-node")
            if getattr(args, n.replace("-", "_")) is None
        ]
        if missing:
            raise ConfigError(
                f"launch: platform manual needs {', '.join(missing)}; allowed platforms: "
                "gke, tpu-vm, slurm (detected from the environment) or manual"
            )
        plan = LaunchPlan(
            "manual",
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            nproc_per_node=args.nproc_per_node,
            master_addr=args.master_addr,
            master_port=port,
            device=device,
        )
    if plan.multislice is None and platform in ("slurm", "manual") and read_multislice(env) is not None:
        raise ConfigError(
            f"launch: MEGASCALE_NUM_SLICES={env['MEGASCALE_NUM_SLICES']} with platform {platform}; allowed: "
            "gke (XPK) or tpu-vm (queued resources) for several slices, or unset MEGASCALE_NUM_SLICES"
        )
    if not 0 <= plan.node_rank < plan.nnodes or plan.nproc_per_node < 1:
        raise ConfigError(
            f"launch: node rank {plan.node_rank} of {plan.nnodes} nodes with {plan.nproc_per_node} "
            "processes per node; allowed: 0 <= node rank < nodes, processes >= 1"
        )
    if plan.device == "tpu":
        plan.env.update(tpu_env({**env, **plan.env}))
    return plan


def torchrun_child() -> int:
    """torchrun (`torch.distributed.run`, arguments in sys.argv) as the launcher's child: its two
    ways of failing are one stderr line each instead of a traceback. The exit code is 1 for both;
    the launcher decides its own from the workers' recorded codes (`run_torchrun`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(sys.argv[1:])
    except ChildFailedError as e:
        failed = ", ".join(
            f"rank {rank} exit {f.exitcode}" + (f" ({f.signal_name()})" if f.exitcode < 0 else "")
            for rank, f in sorted(e.failures.items())
        )
        print(f"launch: torchrun: workers failed: {failed}", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        print(f"launch: torchrun got {e.sigval.name} and stopped its workers", file=sys.stderr, flush=True)
        return 1
    return 0


_CHILD = "import sys; from trainer.launch import torchrun_child; sys.exit(torchrun_child())"


def _shutdown_timeout_s(env: Mapping[str, str]) -> float:
    """How long torchrun gives its workers after a signal before SIGKILL (its default: 30 s)."""
    try:
        return float(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    except ValueError:
        return 30.0


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_signal(sig: int) -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel send `sig` to the child when the launcher dies, however
    it dies (Linux `prctl(PR_SET_PDEATHSIG)`); None where there is no prctl.

    torchrun runs in its own session (a signal to the launcher's process group reaches it once,
    from `run_torchrun`), so without this a SIGKILL to the launcher (an orchestrator's hard kill,
    `kill -9`) left torchrun and its workers training, orphaned, holding the run folder's lock: a
    relaunch was refused. With SIGTERM torchrun stops its workers as on a preemption (they exit
    within its shutdown timeout, `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, releasing the lock). If the
    launcher died between the fork and the prctl, the child signals itself.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def set_parent_death_signal() -> None:
        if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != launcher:  # the launcher is already gone
            os.kill(os.getpid(), sig)

    return set_parent_death_signal


def run_torchrun(cmd: list[str], env: Mapping[str, str], nproc: int) -> int:
    """Run the torchrun command `cmd` (`LaunchPlan.torchrun_argv`) to its end; the launcher's exit code.

    The workers record their exit codes in a fresh folder (`TITAN_EXIT_STATUS_DIR`). torchrun runs
    in its own session, so a signal to the launcher's process group reaches it once, from here:
    the first SIGTERM or SIGINT is passed on (torchrun passes it to the workers and gives them its
    shutdown timeout to save), later ones are not (a second one would cut torchrun's shutdown
    short). If torchrun ends before every worker recorded a code (it was signalled directly
    too), the launcher waits for them up to that timeout. If the launcher itself dies, even by
    SIGKILL, torchrun gets SIGTERM from the kernel (`parent_death_signal`) and stops its workers.
    """
    status_dir = tempfile.mkdtemp(prefix="titan-exit-")
    proc: subprocess.Popen | None = None
    signals: list[int] = []

    def on_signal(signum, frame) -> None:
        if not signals and proc is not None and proc.poll() is None:
            proc.send_signal(signum)
        if signals:
            print(
                f"launch: {signal.Signals(signum).name} again: already stopping (the workers are saving); "
                f"kill -9 {os.getpid()} to abort",
                file=sys.stderr,
                flush=True,
            )
        signals.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, *cmd[3:]],
            env={**env, EXIT_STATUS_ENV: status_dir},
            start_new_session=True,
            preexec_fn=parent_death_signal(signal.SIGTERM),
        )
        if signals:  # arrived while starting it
            proc.send_signal(signals[0])
        torchrun_code = proc.wait()
        codes = read_exit_statuses(status_dir)
        deadline = time.monotonic() + _shutdown_timeout_s(env)
        while signals and len(codes) < nproc and time.monotonic() < deadline:
            time.sleep(0.2)
            codes = read_exit_statuses(status_dir)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(status_dir, ignore_errors=True)
    code = launcher_exit_code(torchrun_code, codes, nproc)
    if code != 0 and signals and signals[0] == signal.SIGINT:  # Ctrl-C: each worker wrote one line
        shown = ", ".join(f"local rank {r}: {c}" for r, c in sorted(codes.items())) or "none recorded"
        cli.stderr_line(
            f"launch: interrupted (Ctrl-C): torchrun stopped the workers (exit codes {shown}); "
            f"exit {cli.INTERRUPTED_EXIT_CODE}"
        )
        return cli.INTERRUPTED_EXIT_CODE
    if code == PREEMPTED_EXIT_CODE:
        print(
            f"launch: preempted: all {nproc} workers of this node exited {PREEMPTED_EXIT_CODE} (checkpoint "
            f"written); exit {PREEMPTED_EXIT_CODE}: relaunch the same command to resume",
            file=sys.stderr,
            flush=True,
        )
    elif code != 0:
        shown = ", ".join(f"local rank {r}: {c}" for r, c in sorted(codes.items())) or "none recorded"
        print(
            f"launch: failed: worker exit codes {shown} (of {nproc}); torchrun exit {torchrun_code}; exit {code}",
            file=sys.stderr,
            flush=True,
        )
    return code


def _parser() -> argparse.ArgumentParser:
    # a bad option is one `error:` line and exit code 2, like every other bad input
    p = cli.ArgumentParser(
        prog="python -m trainer.launch",
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [options] -- --config RECIPE.toml [--section.key=value ...]",
        epilog="Everything after -- goes to python -m trainer.train (its options: python -m "
        "trainer.train --help). Exit codes: 0 done, 2 bad input, 75 every worker "
        "preempted (relaunch to resume), 130 interrupted (Ctrl-C), else a failure.",
        name="launch",
        hint="python -m trainer.launch [options] -- --config RECIPE.toml (options: python -m trainer.launch --help)",
    )
    p.add_argument("--platform", default="auto", choices=["auto", "gke", "tpu-vm", "slurm", "manual"])
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "tpu", "cuda", "cpu"],
        help="what workers train on (default: tpu for gke/tpu-vm, cuda for slurm, the recipe's otherwise)",
    )
    p.add_argument("--nnodes", type=int)
    p.add_argument("--node-rank", type=int)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--nproc-per-node", type=int)
    p.add_argument("--dry-run", action="store_true", help="print the plan and the torchrun command, run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        i = argv.index("--")
        ours, train_args = argv[:i], argv[i + 1 :]
    else:
        ours, train_args = argv, []
    args = _parser().parse_args(ours)
    if not train_args:
        raise ConfigError(
            "launch: nothing to train; allowed: python -m trainer.launch [options] -- "
            "--config RECIPE.toml [--section.key=value ...]"
        )
    check_train_args(train_args)
    plan = build_plan(args, os.environ)
    if plan.device in ("tpu", "cuda", "cpu") and not any(a.startswith("--device.type") for a in train_args):
        train_args = train_args + [f"--device.type={plan.device}"]
    cmd = plan.torchrun_argv(train_args)
    ms = plan.multislice
    slices = (
        f", slice {ms.slice_id}/{ms.num_slices} ({ms.source}, coordinator {ms.coordinator})" if ms is not None else ""
    )
    print(
        f"launch: {plan.platform}: node {plan.node_rank}/{plan.nnodes}, {plan.nproc_per_node} processes, "
        f"rendezvous {plan.master_addr}:{plan.master_port} (static), device {plan.device}{slices}",
        flush=True,
    )
    if ms is not None:
        print(unverified_multislice_line(plan), flush=True)
    if args.dry_run:
        for key in plan.unset:
            print(f"unset {key}")
        for key, value in sorted(plan.env.items()):
            print(f"export {key}={shlex.quote(value)}")
        print(shlex.join(cmd))
        for line in process_lines(plan):
            print(line)
        return 0
    return run_torchrun(cmd, plan.child_env(os.environ), plan.nproc_per_node)


def check_train_args(train_args: list[str]) -> None:
    """The recipe the workers will train, before anything starts: a bad key or a pod recipe's
    checkpoint placeholder (`gs://YOUR_BUCKET/...`, trainer/config/placeholders.py) is one
    `error:` line here, once, instead of one per worker after the start-up. A recipe path that is
    not here is left to the workers (the launcher may run where the recipe is not)."""
    from trainer.config import build_config, split_cli
    from trainer.config.placeholders import check_checkpoint_folder

    recipe, print_config, overrides = split_cli(train_args)
    if recipe is None or print_config or not os.path.isfile(recipe):
        return
    check_checkpoint_folder(build_config(recipe, overrides).checkpoint)


PROCESS_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_PORT",
    "NODE_RANK",
    "NNODES",
    "TORCH_TPU_DEVICES_PER_HOST",
    "TORCH_TPU_TOPOLOGY",
    "TORCH_TPU_SLICEBUILDER_ADDRESSES",
)
"""What `--dry-run` prints per process: torchrun's ranks, the MegaScale and slice-builder variables."""


def process_lines(plan: LaunchPlan) -> list[str]:
    """`--dry-run`: one `# process` line per local process with its launch variables (those of
    `PROCESS_KEYS` it gets; `<unset>` for one the plan takes out) and, on TPU, the entry of the
    slice-builder address list at this process's place in its slice."""
    lines = []
    for env in plan.process_envs():
        shown = [f"{k}={'<unset>' if k in plan.unset else env[k]}" for k in PROCESS_KEYS if k in env or k in plan.unset]
        addresses = [a for a in env.get("TORCH_TPU_SLICEBUILDER_ADDRESSES", "").split(",") if a]
        if addresses:
            place = int(env.get("NODE_RANK", "0")) * plan.nproc_per_node + int(env["LOCAL_RANK"])
            entry = addresses[place] if place < len(addresses) else "none"
            shown.append(f"slice_builder[{place}]={entry}")
        lines.append(f"# process {env['RANK']}: " + " ".join(shown))
    return lines


def unverified_multislice_line(plan: LaunchPlan) -> str:
    """What a multislice launch cannot check without hardware (docs/launch.md, "Several slices")."""
    ms = plan.multislice
    hosts = plan.nnodes // ms.num_slices
    world = plan.nnodes * plan.nproc_per_node
    return (
        f"launch: not checkable without hardware: torch-tpu's slice builder gets this slice's view "
        f"(NODE_RANK = worker, NNODES = {hosts} hosts, {hosts * plan.nproc_per_node} addresses) while torchrun's "
        f"RANK/WORLD_SIZE are the job's (0..{world - 1}); which of them indexes torch-tpu's per-slice address list "
        "is inside its binary. Run a 2-slice job first: scripts/tpu_smoke.sh --multislice (docs/launch.md)"
    )


if __name__ == "__main__":
    sys.exit(cli.run(main, interrupted="launch: nothing was started"))
