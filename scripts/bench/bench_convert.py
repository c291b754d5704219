"""Peak resident memory of HF <-> DCP conversion and of the per-rank HF load, vs checkpoint size.

    python scripts/bench/bench_convert.py [--layers 16] [--dim 1024] [--repeats 3] [--out bench_convert.csv]

Builds a Llama 3 checkpoint of random weights (a flavor override, ~1 GB in fp32 with the
defaults) in a temporary folder, then measures, each in a fresh process (peak = VmHWM, "added"
= VmHWM minus VmRSS just before the measured call, so the interpreter and torch are not counted):
- from-hf: scripts/convert.py HF -> DCP (streaming);
- to-hf: DCP -> HF (streaming);
- load (sliced / full): `load_initial` of the HF folder into a 2-rank SimpleFSDP model (torchrun,
  gloo), per rank; "sliced" is the adapter with `hf_layout`, "full" the bare `from_hf` (every rank
  reads every tensor). "before" there includes the rank's materialized shard.
Each measurement is repeated `--repeats` times (fresh processes); the table shows the median.
Prints a table, writes CSV; the temporary checkpoints are deleted at the end.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer.runtime import cli

ROOT = Path(__file__).resolve().parents[2]


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _args(layers: int, dim: int):
    import models

    return models.get_model_family("llama3").get_args(
        "debugmodel",
        n_layers=layers,
        dim=dim,
        n_heads=dim // 64,
        n_kv_heads=dim // 64,
        vocab_size=4096,
        hidden_dim=int(dim * 3.5),
        max_seq_len=64,
    )


def _build(folder: Path, layers: int, dim: int) -> None:
    """An HF folder (config.json + safetensors, fp32) of a randomly initialised model."""
    import torch

    import models

    args = _args(layers, dim)
    family = models.get_model_family("llama3")
    torch.manual_seed(0)
    model = family.model_cls(args)
    model.init_weights()
    state = {k: v.contiguous() for k, v in family.hf_adapter.to_hf(model.state_dict(), args).items()}
    del model
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(family.hf_adapter.hf_config(args)))


def _measured(kind: str, hf: Path, dcp_dir: Path, back: Path, layers: int, dim: int) -> dict:
    import models
    from trainer import hf_convert as convert

    before = _status("VmRSS")
    if kind == "from-hf":
        convert.convert_from_hf(hf, dcp_dir)
    else:
        convert.convert_to_hf(dcp_dir, models.get_model_family("llama3"), _args(layers, dim), back)
    return {"before": before, "peak": _status("VmHWM")}


def _load_worker(hf: Path, layers: int, dim: int, mode: str) -> dict:
    import torch
    import torch.distributed as dist

    import models
    from parallelisms import ParallelDims, build_mesh, parallelize_model
    from trainer import checkpoint as ckpt
    from trainer.runtime.device import cpu_backend

    dist.init_process_group(cpu_backend())
    world = dist.get_world_size()
    family = models.get_model_family("llama3")
    args = _args(layers, dim)
    dims = ParallelDims(world_size=world, dp_shard=world)
    mesh = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = family.model_cls(args)
    parallelize_model(
        model, plan=family.plan, parallel_dims=dims, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32
    )
    model.to_empty(device="cpu")
    shard = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    dist.barrier()
    before = _status("VmRSS")
    adapter = family.hf_adapter if mode == "sliced" else family.hf_adapter.from_hf
    ckpt.load_initial(model, path=hf, fmt="hf", hf_adapter=adapter, args=args)
    out = {"rank": dist.get_rank(), "before": before, "peak": _status("VmHWM"), "shard": shard}
    dist.destroy_process_group()
    return out


HEADER = ["what", "rank", "checkpoint_mb", "shard_mb", "before_mb", "peak_mb", "added_mb"]


def _parse_args() -> argparse.Namespace:
    """The command line (`--worker` and `--dir` are the subprocesses' own, hidden)."""
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_convert.csv"))
    parser.add_argument("--worker", choices=["build", "from-hf", "to-hf", "sliced", "full"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def _run_worker(ns: argparse.Namespace) -> int:
    """One subprocess's part: build the checkpoint, or one measurement printed as a JSON line."""
    if ns.worker == "build":
        _build(ns.dir / "hf", ns.layers, ns.dim)
    elif ns.worker in ("from-hf", "to-hf"):
        print(json.dumps(_measured(ns.worker, ns.dir / "hf", ns.dir / "dcp", ns.dir / "back", ns.layers, ns.dim)))
    else:
        print(json.dumps(_load_worker(ns.dir / "hf", ns.layers, ns.dim, ns.worker)), flush=True)
    return 0


def _sample(me: list[str], env: dict, tmp: Path, repeats: int) -> dict[tuple[str, object], list[dict]]:
    """{(what, rank): [measurement, ...]}: per repeat, both conversions then both loads, each in fresh processes."""
    samples: dict[tuple[str, object], list[dict]] = {}
    for _ in range(repeats):
        for kind in ("from-hf", "to-hf"):
            out = (
                subprocess.run(
                    me + ["--worker", kind, "--dir", str(tmp)], check=True, env=env, capture_output=True, text=True
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            samples.setdefault((f"convert {kind}", "-"), []).append(json.loads(out))
            if kind == "to-hf":
                shutil.rmtree(tmp / "back")
        shutil.rmtree(tmp / "dcp")
        for mode in ("sliced", "full"):
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29517"]
                + me[1:]
                + ["--worker", mode, "--dir", str(tmp)],
                check=True,
                env=env,
                capture_output=True,
                text=True,
            )
            for line in proc.stdout.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    samples.setdefault((f"load {mode} (FSDP 2)", r["rank"]), []).append(r)
    return samples


def _rows(samples: dict[tuple[str, object], list[dict]], size: int) -> list[dict]:
    """One row per (what, rank): the medians over the repeats, in MB."""
    rows = []
    for (what, rank), runs in samples.items():
        before = statistics.median(r["before"] for r in runs)
        peak = statistics.median(r["peak"] for r in runs)
        added = statistics.median(r["peak"] - r["before"] for r in runs)
        rows.append(
            {
                "what": what,
                "rank": rank,
                "checkpoint_mb": size / 1e6,
                "shard_mb": runs[0]["shard"] / 1e6 if "shard" in runs[0] else "",
                "before_mb": before / 1e6,
                "peak_mb": peak / 1e6,
                "added_mb": added / 1e6,
            }
        )
    return rows


def _write_table(rows: list[dict], ns: argparse.Namespace) -> None:
    """The table on stdout (CPU and shape first) and as CSV at `--out`."""
    from trainer.runtime.device import cpu_model

    print(f"CPU: {cpu_model()}; Llama 3 override n_layers={ns.layers} dim={ns.dim}, fp32; median of {ns.repeats} runs")
    print(" | ".join(f"{h:>20}" if i == 0 else f"{h:>13}" for i, h in enumerate(HEADER)))
    for row in rows:
        print(
            " | ".join(
                f"{row[h]:>20}" if i == 0 else (f"{row[h]:>13.0f}" if isinstance(row[h], float) else f"{row[h]!s:>13}")
                for i, h in enumerate(HEADER)
            )
        )
    with open(ns.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=HEADER)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {ns.out}")


def main() -> int:
    ns = _parse_args()
    if ns.worker:
        return _run_worker(ns)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    me = [sys.executable, str(Path(__file__).resolve()), "--layers", str(ns.layers), "--dim", str(ns.dim)]
    with tempfile.TemporaryDirectory(prefix="bench_convert_") as tmp:
        tmp = Path(tmp)
        subprocess.run(me + ["--worker", "build", "--dir", str(tmp)], check=True, env=env)
        size = sum(f.stat().st_size for f in (tmp / "hf").glob("*.safetensors"))
        rows = _rows(_sample(me, env, tmp, ns.repeats), size)
    _write_table(rows, ns)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
