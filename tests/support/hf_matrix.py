"""Train many `hf` runs in one process (or one torchrun launch): the architecture x mode matrix.

Each job is a `trainer.train` run with its own argv, executed in this process with the process
group kept between jobs (`trainer.runtime.device.init_distributed` reuses it), so a 2-rank launch pays
for torchrun and the gloo rendezvous once for every architecture instead of once per run.

    [torchrun --nproc_per_node=2 -m] python -m tests.support.hf_matrix JOBS.json RESULTS.json

JOBS.json: `{"name": [argv...]}`. RESULTS.json (rank 0): `{"name": {"losses": [...]} | {"refused":
"<error line>"} | {"failed": "<exception>"}}`. A refusal is a ConfigError (what a user would see as
`error: ...`, exit 2); a failure is anything else (its traceback goes to stderr).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch.distributed as dist


def run_jobs(jobs: dict[str, list[str]]) -> dict[str, dict]:
    from models.errors import ConfigError
    from trainer.config import build_config, split_cli
    from trainer.train import train

    results: dict[str, dict] = {}
    for name, argv in jobs.items():
        try:
            recipe, _, overrides = split_cli(argv)
            cfg = build_config(recipe, overrides)
            train(cfg)
            with open(os.path.join(cfg.job.dump_folder, "metrics.jsonl")) as f:
                records = [json.loads(line) for line in f]
            results[name] = {"losses": [r["loss"] for r in sorted(records, key=lambda r: r["step"])]}
        except ConfigError as e:
            results[name] = {"refused": f"error: {e}"}
        except Exception as e:  # noqa: BLE001 - recorded per job; the matrix goes on
            traceback.print_exc()
            results[name] = {"failed": f"{type(e).__name__}: {e}"[:500]}
        if dist.is_initialized():
            dist.barrier()
    return results


def main(argv: list[str]) -> int:
    jobs_path, results_path = argv
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = run_jobs(jobs)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)
    from trainer.runtime.device import shutdown_distributed

    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
