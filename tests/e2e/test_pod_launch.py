"""The first pod launch (issue 50): a pod recipe starts with one override, and a multislice job
starts as torch-tpu expects.

- The TPU install has gcsfs (the `[tpu]` extra carries the `[gcs]` pin; constraints/tpu.txt pins
  it and the fsspec it needs), so a `gs://` checkpoint folder works out of `scripts/env.sh tpu`.
- Pod recipes name their checkpoint folder `gs://YOUR_BUCKET/<recipe>/checkpoints`; the trainer and
  the launcher refuse it with one `error: checkpoint.folder: ...; allowed: ...` line, exit 2, until
  `--checkpoint.folder` is set; the recipe check accepts it (a stand-in bucket) and says so.
- Multislice (trainer/launch.py): a port-less `MEGASCALE_COORDINATOR_ADDRESS` gets
  `:${MEGASCALE_PORT:-8080}`, MEGASCALE_PORT is taken out of the workers' environment, and the
  dry-run prints every process's MegaScale and slice-builder variables, here for each platform
  (GKE/XPK, TPU VM queued resources, Slurm) with `python -m torch.tpu.distributed` stood in for as
  torch-tpu 0.2.0 prints it (/work/shared/reference/torch_tpu.md 3.3). What cannot be checked here
  (which rank indexes torch-tpu's per-slice address list) is said on every multislice start;
  `scripts/tpu_smoke.sh --multislice` prints the 2 x v6e-8 plan that checks it.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from models.errors import ConfigError
from tests.e2e.test_install import normalize, read_pins
from tests.support.trainer_runs import ENV, REPO
from trainer import launch, platforms
from trainer.config import build_config
from trainer.config.placeholders import PLACEHOLDER_PREFIX, check_checkpoint_folder, is_placeholder

POD_RECIPES = sorted(
    p
    for pattern in ("*_v5e*.toml", "*_v5p*.toml", "*_v6e*.toml", "*_v7x*.toml")
    for p in glob.glob(os.path.join(REPO, "configs", pattern))
)
PLACEHOLDER_LINE = re.compile(
    r"^error: checkpoint\.folder: gs://YOUR_BUCKET/\S+ is the recipe's placeholder.*; allowed: "
)


# --- the TPU install writes gs:// ----------------------------------------------------------------


def test_the_tpu_install_has_gcsfs_at_the_locked_version():
    """`source scripts/env.sh tpu` installs `-e .[tpu]` under constraints/tpu.txt
    (tests/e2e/test_install.py): the extra must carry the [gcs] requirement, pinned alike."""
    extras = tomllib.loads(open(os.path.join(REPO, "pyproject.toml")).read())["project"]["optional-dependencies"]
    assert set(extras["gcs"]) <= set(extras["tpu"]), (extras["gcs"], extras["tpu"])
    tpu_pins = read_pins(__import__("pathlib").Path(REPO, "constraints", "tpu.txt"))
    dev_pins = read_pins(__import__("pathlib").Path(REPO, "constraints", "dev.txt"))
    (gcsfs,) = [r for r in extras["gcs"] if normalize(r.split("==")[0]) == "gcsfs"]
    assert tpu_pins["gcsfs"] == gcsfs.split("==")[1] == dev_pins["gcsfs"]
    assert tpu_pins["fsspec"] == dev_pins["fsspec"]  # what gcsfs needs and datasets allows
    assert '-e "$ROOT[$EXTRAS]"' in open(os.path.join(REPO, "scripts", "env.sh")).read()  # env.sh tpu: .[tpu]


# --- the bucket placeholder ----------------------------------------------------------------------


def test_pod_recipes_name_their_bucket_as_a_placeholder():
    assert len(POD_RECIPES) >= 20, POD_RECIPES
    for path in POD_RECIPES:
        cfg = build_config(path)
        name = os.path.basename(path)[:-5]
        assert cfg.job.target and cfg.checkpoint.enable, path
        assert cfg.checkpoint.folder == f"{PLACEHOLDER_PREFIX}{name}/checkpoints", (path, cfg.checkpoint.folder)
        with pytest.raises(ConfigError, match=r"^checkpoint\.folder: .*; allowed: .*--checkpoint\.folder=gs://"):
            check_checkpoint_folder(cfg.checkpoint)
        fixed = build_config(path, [("checkpoint.folder", f"gs://my-bucket/{name}/checkpoints")])
        check_checkpoint_folder(fixed.checkpoint)  # the one override
        check_checkpoint_folder(build_config(path, [("checkpoint.enable", "false")]).checkpoint)
    assert not is_placeholder("gs://your_bucket/x") and not is_placeholder("checkpoints")


def test_the_trainer_refuses_the_placeholder_with_one_line(capsys):
    from trainer.train import main

    assert main(["--config", os.path.join(REPO, "configs", "llama3_8b_v6e.toml")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and PLACEHOLDER_LINE.match(lines[0]), lines
    assert "--checkpoint.folder=gs://my-bucket/llama3_8b_v6e/checkpoints" in lines[0]


def _launch_cli(*train: str, env: dict | None = None) -> subprocess.CompletedProcess:
    manual = ["--platform", "manual", "--device", "cpu", "--dry-run", "--nnodes", "2", "--node-rank", "0"]
    manual += ["--master-addr", "h0", "--nproc-per-node", "1"]
    return subprocess.run(
        [sys.executable, "-m", "trainer.launch", *manual, "--", *train],
        cwd=REPO,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_launcher_refuses_the_placeholder_before_anything_starts():
    recipe = ["--config", "configs/qwen3_30b_a3b_v6e.toml"]
    bad = _launch_cli(*recipe)
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout + bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and PLACEHOLDER_LINE.match(lines[0]), lines
    good = _launch_cli(*recipe, "--checkpoint.folder=gs://my-bucket/qwen3_30b_a3b_v6e/checkpoints")
    assert good.returncode == 0, good.stderr
    assert "--checkpoint.folder=gs://my-bucket/qwen3_30b_a3b_v6e/checkpoints" in good.stdout


def test_the_recipe_check_takes_the_placeholder_and_says_so():
    """It writes no checkpoint: the folder's form is checked with a stand-in bucket (the storage
    check the start-up runs, `check_storage_paths`, refuses the uppercase placeholder itself)."""
    from tools.recipe_check import STAND_IN_BUCKET, check_recipe
    from trainer.runtime.storage import check_storage_paths

    path = os.path.join(REPO, "configs", "llama3_8b_v6e.toml")
    r = check_recipe(path, capture=False)
    assert r.ok, r.error
    (note,) = [n for n in r.notes if n.startswith("checkpoint.folder")]
    assert "placeholder" in note and f"gs://{STAND_IN_BUCKET}/llama3_8b_v6e/checkpoints" in note, note
    with pytest.raises(ConfigError, match="checkpoint.folder"):
        check_storage_paths(build_config(path))
    out = subprocess.run(
        [sys.executable, "scripts/check_recipe.py", "--no-capture", "configs/llama3_8b_v6e.toml"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "note: llama3_8b_v6e.toml: checkpoint.folder gs://YOUR_BUCKET/" in out.stdout, out.stdout


# --- multislice: the coordinator's port, MEGASCALE_PORT, each process's view ---------------------


@pytest.mark.parametrize(
    "coordinator, port, want",
    [
        ("wl-slice-job-0-0.wl", "", "wl-slice-job-0-0.wl:8080"),
        ("wl-slice-job-0-0.wl", "8081", "wl-slice-job-0-0.wl:8081"),
        ("10.0.0.2:8080", "9999", "10.0.0.2:8080"),
        ("[fd00::2]:8080", "", "[fd00::2]:8080"),
        ("fd00::2", "", "[fd00::2]:8080"),
    ],
)
def test_the_coordinator_address_gets_a_port(coordinator, port, want):
    assert platforms.coordinator_address(coordinator, port) == want
    ms = platforms.Multislice(2, 1, coordinator, "environment", port)
    assert platforms.multislice_env(ms)["MEGASCALE_COORDINATOR_ADDRESS"] == want
    assert "MEGASCALE_PORT" not in platforms.multislice_env(ms)


def fake_torch_tpu_distributed(argv: list[str], env: dict) -> str:
    """`python -m torch.tpu.distributed` as torch-tpu 0.2.0 prints it (reference torch_tpu.md 3.3):
    multi-host (2+ hosts): one address per device of every host of TPU_WORKER_HOSTNAMES at
    8070 + i (TORCH_TPU_BASE_PORT), TORCH_TPU_DEVICES_PER_HOST of them; one host: localhost ports;
    NODE_RANK, NNODES, MASTER_* kept as set; WORLD_SIZE the slice's address count."""
    assert argv[1:] == ["-m", "torch.tpu.distributed"]
    hosts = env["TPU_WORKER_HOSTNAMES"].split(",")
    per = int(env["TORCH_TPU_DEVICES_PER_HOST"])
    if len(hosts) > 1:
        addresses = [f"{h}:{8070 + i}" for h in hosts for i in range(per)]
    else:
        addresses = [f"localhost:{9100 + i}" for i in range(per)]
    return (
        f'TORCH_TPU_TOPOLOGY="{env.get("TORCH_TPU_TOPOLOGY") or _chip_grid(env)}"\n'
        f'TORCH_TPU_SLICEBUILDER_ADDRESSES="{",".join(addresses)}"\nTORCH_TPU_XPROF_SESSION_ID=""\n'
        f'WORLD_SIZE={len(addresses)}\nNODE_RANK="{env["NODE_RANK"]}"\nNNODES="{env["NNODES"]}"\n'
        f'MASTER_ADDR="{env["MASTER_ADDR"]}"\nMASTER_PORT="{env["MASTER_PORT"]}"\n'
    )


def _chip_grid(env: dict) -> str:
    """The slice's chip grid as torch-tpu reads it off the TPU (x,y,z), from the accelerator type
    the host environment names; a single host's 2x4 when it names none."""
    import planner
    from parallelisms.tpu_topology import topology_of

    accelerator = env.get("TPU_ACCELERATOR_TYPE")
    if not accelerator:
        return "2,4,1"
    return ",".join(str(d) for d in topology_of(planner.parse_target(accelerator)).chips)


def _dry_run(monkeypatch, capsys, options: list[str], env: dict, metadata: dict | None = None) -> tuple[str, list]:
    """`python -m trainer.launch OPTIONS --dry-run -- --config llama3_debug` in this process with `env`
    as the host's environment: (stdout, one dict per `# process` line)."""
    for key in list(os.environ):
        if key.startswith(("TPU_", "MEGASCALE_", "SLURM_", "MASTER_", "JOB_COMPLETION")):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch, "_run_torch_tpu_distributed", fake_torch_tpu_distributed)
    monkeypatch.setattr(launch, "read_tpu_vm_metadata", lambda: metadata)
    assert launch.main([*options, "--dry-run", "--", "--config", "configs/llama3_debug.toml"]) == 0
    out = capsys.readouterr().out
    processes = []
    for line in out.splitlines():
        if line.startswith("# process "):
            processes.append(dict(item.split("=", 1) for item in line.split(": ", 1)[1].split()))
    return out, processes


def test_dry_run_xpk_two_slices_prints_every_process(monkeypatch, capsys):
    """GKE / XPK `--num-slices 2` of v6e-16 (4 hosts x 4 chips per slice): the pod of slice 1, worker 2."""
    hosts = [f"wl-slice-job-1-{i}.wl" for i in range(4)]
    env = {
        "TPU_WORKER_HOSTNAMES": ",".join(hosts),
        "TPU_WORKER_ID": "2",
        "TPU_ACCELERATOR_TYPE": "v6e-16",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": "1",
        "MEGASCALE_COORDINATOR_ADDRESS": "wl-slice-job-0-0.wl",  # as XPK sets it: no port
        "MEGASCALE_PORT": "8080",  # one per pod
    }
    out, procs = _dry_run(monkeypatch, capsys, ["--platform", "gke"], env)
    assert "unset MEGASCALE_PORT" in out.splitlines()
    assert "not checkable without hardware" in out and "scripts/tpu_smoke.sh --multislice" in out
    assert len(procs) == 4
    for local, p in enumerate(procs):
        assert (p["RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"]) == (str(24 + local), str(local), "32")
        assert (p["MASTER_ADDR"], p["MASTER_PORT"]) == ("wl-slice-job-0-0.wl", str(launch.DEFAULT_PORT))
        assert p["MEGASCALE_COORDINATOR_ADDRESS"] == "wl-slice-job-0-0.wl:8080"
        assert (p["MEGASCALE_NUM_SLICES"], p["MEGASCALE_SLICE_ID"], p["MEGASCALE_PORT"]) == ("2", "1", "<unset>")
        # torch-tpu's slice builder: this slice's 4 hosts x 4 devices, NODE_RANK the worker id
        assert (p["NODE_RANK"], p["NNODES"], p["TORCH_TPU_DEVICES_PER_HOST"]) == ("2", "4", "4")
        assert p["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",") == [f"{h}:{8070 + i}" for h in hosts for i in range(4)]
        assert p[f"slice_builder[{8 + local}]"] == f"wl-slice-job-1-2.wl:{8070 + local}"
        assert p["TORCH_TPU_TOPOLOGY"] == "4,4,1", p  # v6e-16's chips, as torch-tpu reads them
    # what the workers inherit: no MEGASCALE_PORT, the coordinator with its port
    plan = launch.build_plan(launch._parser().parse_args(["--platform", "gke"]), dict(os.environ))
    child = plan.child_env(dict(os.environ))
    assert "MEGASCALE_PORT" not in child and child["MEGASCALE_COORDINATOR_ADDRESS"] == "wl-slice-job-0-0.wl:8080"


def test_dry_run_queued_resource_two_v6e_8_slices_prints_every_process(monkeypatch, capsys):
    """TPU VM queued resource, 2 nodes of v6e-8 (one host each, 8 chips): slice 1's host; the
    MegaScale variables come from its tpu-env metadata, without a port or MEGASCALE_PORT."""
    metadata = {
        "agent-worker-number": "0",
        "accelerator-type": "v6e-8",
        "worker-network-endpoints": "w0:0:10.0.1.2",
        "tpu-env": "MEGASCALE_COORDINATOR_ADDRESS: '10.0.0.2'\nMEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'\n",
    }
    out, procs = _dry_run(monkeypatch, capsys, ["--platform", "tpu-vm"], {}, metadata)
    assert out.splitlines()[0].startswith("launch: tpu-vm: node 1/2, 8 processes, rendezvous 10.0.0.2:29501")
    assert "not checkable without hardware" in out
    assert len(procs) == 8
    for local, p in enumerate(procs):
        assert (p["RANK"], p["WORLD_SIZE"], p["MASTER_ADDR"]) == (str(8 + local), "16", "10.0.0.2")
        assert p["MEGASCALE_COORDINATOR_ADDRESS"] == "10.0.0.2:8080" and p["MEGASCALE_PORT"] == "<unset>"
        assert (p["MEGASCALE_NUM_SLICES"], p["MEGASCALE_SLICE_ID"]) == ("2", "1")
        assert (p["NODE_RANK"], p["NNODES"], p["TORCH_TPU_DEVICES_PER_HOST"]) == ("0", "1", "8")
        assert p[f"slice_builder[{local}]"] == f"localhost:{9100 + local}"
        assert len(p["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 8  # the slice's, not the job's 16


def test_dry_run_slurm_prints_every_process_and_refuses_megascale(monkeypatch, capsys):
    """Slurm (GPU clusters): one slice; no MegaScale or torch-tpu variables, and MEGASCALE_* set
    there is refused (several slices are XPK's or queued resources')."""
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[003-004]"}
    out, procs = _dry_run(monkeypatch, capsys, ["--platform", "slurm", "--nproc-per-node", "2"], env)
    assert "not checkable" not in out and "unset " not in out
    assert [(p["RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"], p["MASTER_ADDR"]) for p in procs] == [
        ("2", "0", "4", "gpu003"),
        ("3", "1", "4", "gpu003"),
    ]
    for p in procs:
        assert not [k for k in p if k.startswith(("MEGASCALE_", "TORCH_TPU_", "NODE_RANK", "NNODES"))], p
    for key, value in (
        ("MEGASCALE_NUM_SLICES", "2"),
        ("MEGASCALE_SLICE_ID", "1"),
        ("MEGASCALE_COORDINATOR_ADDRESS", "h"),
    ):
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="MEGASCALE_NUM_SLICES=2 with platform slurm"):
        launch.main(["--platform", "slurm", "--nproc-per-node", "2", "--dry-run", "--", "--config", "x.toml"])


def test_tpu_smoke_multislice_prints_the_two_slice_plan_and_runs_nothing():
    """`scripts/tpu_smoke.sh --multislice` on a host without a TPU: the plan for 2 x v6e-8, said to
    be a plan, with no venv made and nothing started."""
    proc = subprocess.run(
        ["bash", "scripts/tpu_smoke.sh", "--multislice", "--zone", "us-east5-b"],
        cwd=REPO,
        env={**ENV, "PYTHON": sys.executable, "TITAN_VENV": "/nonexistent/venv"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("plan only (nothing was run here)"), out[:300]
    assert "queued-resources create" in out and "--node-count 2" in out and "--accelerator-type v6e-8" in out
    assert "--zone us-east5-b" in out
    assert "scripts/launch_pod.sh qr" in out and "--parallelism.data_parallel_replicate_degree=2" in out
    assert "--dry-run" in out and "slice_builder[" in out  # step: every process's view, on the hosts
    assert "queued-resources delete" in out
    bad = subprocess.run(
        ["bash", "scripts/tpu_smoke.sh", "--multislice", "--slices", "1"],
        cwd=REPO,
        env={**ENV, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: "), bad.stderr
