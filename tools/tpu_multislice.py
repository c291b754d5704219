"""`scripts/tpu_smoke.sh --multislice` (`python -m tools.tpu_smoke multislice`): the plan of a first
run on two small slices, printed for the owner of the slices; nothing is run here.
"""

from __future__ import annotations

import argparse

from trainer.runtime import cli


class _Fail(Exception):
    """Bad input: one `error:` line, exit 2."""


MULTISLICE_RUNTIME = {"v6e": "v2-alpha-tpuv6e", "v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5"}
"""TPU VM software versions by generation (Cloud TPU's documented runtime images)."""


def multislice_plan(args: argparse.Namespace, *, recipe: str, common: list[str]) -> str:
    """The commands, in order, for the owner of two small slices to check a multislice start
    (docs/launch.md, "Several slices"): what a CPU cannot tell is which rank torch-tpu indexes its
    per-slice slice-builder address list with, and whether libtpu's MegaScale client forms with the
    coordinator the launcher exports. Printed, never run here. `recipe` and `common`: the smoke's
    Llama 3 debug recipe and the flags of its every run (tools/tpu_smoke.py LLAMA, COMMON)."""
    name, zone, acc, n = args.name, args.zone, args.accelerator, args.slices
    project = f" --project {args.project}" if args.project else ""
    runtime = args.runtime_version or MULTISLICE_RUNTIME.get(acc.split("-")[0], "RUNTIME_VERSION")
    where = f"{name} --zone {zone}{project}"
    ssh = f"gcloud compute tpus queued-resources ssh {where} --node=all --worker=all"
    train = (
        f"--config {recipe} --training.steps={args.steps} "
        f"--parallelism.data_parallel_replicate_degree={n} --parallelism.data_parallel_shard_degree=-1 "
        f"{' '.join(common)} --job.dump_folder=outputs/multislice_smoke"
    )
    repo = args.repo
    return "\n".join(
        [
            f"plan only (nothing was run here): a first multislice run on {n} x {acc} "
            f"(queued resource {name}, zone {zone}), for the owner of the slices to run step by step.",
            "It answers what no CPU test can: which rank torch-tpu indexes its per-slice slice-builder address "
            "list with, and whether libtpu's MegaScale client forms with the coordinator the launcher exports.",
            "",
            f"1. Create {n} slices as one queued resource (each node a slice):",
            f"   gcloud compute tpus queued-resources create {where} --node-count {n} --node-prefix {name} "
            f"--accelerator-type {acc} --runtime-version {runtime}",
            f"   gcloud compute tpus queued-resources describe {where}   # until ACTIVE",
            "2. The same checkout at the same path on every host, and the TPU venv (Python 3.11, torch-tpu, gcsfs):",
            f"   {ssh} --command 'git clone REPO_URL {repo} && cd {repo} && source scripts/env.sh tpu'",
            f"3. One slice at a time first (optional, single host): {ssh} --command "
            f"'cd {repo} && scripts/tpu_smoke.sh --runs cpu,eager'",
            "4. Every process's view, without training: each host prints its plan, its MegaScale variables (the "
            "coordinator with a port, MEGASCALE_PORT unset) and one '# process' line per device with its RANK "
            "and slice_builder[i] entry:",
            f"   {ssh} --command 'cd {repo} && bash scripts/launch_pod.sh host tpu --platform tpu-vm --dry-run -- "
            f"{train}'",
            f"5. The run ({args.steps} steps, HSDP: one replica per slice, FSDP inside each; no checkpoints):",
            f"   cd {repo} && scripts/launch_pod.sh qr {name} {zone}{' ' + args.project if args.project else ''} -- "
            f"{train}",
            "   Look for: every host's 'launch: tpu-vm: node R/N, ... slice S/" + str(n) + "' line; step lines "
            "from rank 0. On a failure: 'invalid world_size configuration' or a hang before step 1 (possibly torch-tpu "
            "indexing its slice-builder list by the global RANK rather than the place in the slice), or a MegaScale "
            "error naming the coordinator. Send back every host's output.",
            "6. Delete the slices:",
            f"   gcloud compute tpus queued-resources delete {where} --force --async",
        ]
    )


def parse_multislice(argv: list[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(
        prog="scripts/tpu_smoke.sh --multislice",
        description="Print the plan of a first multislice run (2 x v6e-8 by default) for the owner of the "
        "slices; nothing is run here.",
    )
    p.add_argument("--name", default="titan-multislice", help="the queued resource's name (default %(default)s)")
    p.add_argument("--zone", default="ZONE", help="its zone, e.g. us-east5-b")
    p.add_argument("--project", default="", help="the Google Cloud project (default: gcloud's)")
    p.add_argument("--accelerator", default="v6e-8", help="each slice's type (default %(default)s: one host)")
    p.add_argument("--slices", type=int, default=2, help="how many slices (default %(default)s)")
    p.add_argument("--runtime-version", default="", help="the TPU VM image (default: by generation)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default %(default)s)")
    p.add_argument("--repo", default="titan-tpu", help="the checkout's path on every host (default %(default)s)")
    args = p.parse_args(argv)
    if args.slices < 2:
        raise _Fail(f"--slices: {args.slices}; allowed: 2 or more (a multislice run)")
    if args.steps < 1:
        raise _Fail(f"--steps: {args.steps}; allowed: >= 1")
    return args


def main(argv: list[str], *, recipe: str, common: list[str]) -> int:
    """Print the plan for `argv` (the flags after `multislice`); 2 on bad input."""
    try:
        print(multislice_plan(parse_multislice(argv), recipe=recipe, common=common))
    except _Fail as e:
        cli.error_line(str(e))
        return 2
    return 0
