"""Measure what the checkpoint checksums cost: the manifest on save, the verification on load.

For each size, builds a model plus AdamW state (fp32 weights and two moments: 12 bytes per
parameter), then repeats: a blocking `CheckpointManager.save` (DCP write, fsync'd rename, and
`write_manifest`, timed separately) and a `CheckpointManager.load` (`verify_checkpoint`, timed
separately, then the DCP read). Files are read back from the page cache right after the write,
which is the case on save and usually on a resume on the same machine; a cold read from disk
adds the same disk time to both the hash and the DCP load. Prints a table and writes CSV. Times
are the minimum over the repeats: on a shared machine other processes only ever add time (the
load average is printed with the results).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/bench_checkpoint.py --sizes debug,2.5 --out ckpt.csv

Sizes: `debug` (the Llama 3 debug model of configs/llama3_debug.toml) or a number of GB of
checkpoint (a stack of square fp32 Linear layers).
"""

import csv
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from trainer import checkpoint as ckpt
from trainer.runtime import cli
from trainer.runtime.device import cpu_model


def _model(size: str) -> nn.Module:
    if size == "debug":
        from trainer.config import model_args

        family, args = model_args("llama3", "debugmodel")
        model = family.model_cls(args)
        model.init_weights()
        return model
    gigabytes = float(size)
    dim = 4096
    n_layers = max(1, round(gigabytes * 1e9 / 12 / (dim * dim)))  # 12 bytes per parameter
    return nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(n_layers)))


def _states(model: nn.Module) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():  # moments that are not all zeros
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"model": ckpt.ModelState(model), "optimizer": ckpt.OptimizerState(model, optimizer)}


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def measure(size: str, root: Path, repeats: int) -> dict:
    model = _model(size)
    states = _states(model)
    n_params = sum(p.numel() for p in model.parameters())
    rows = {"save_s": [], "manifest_s": [], "load_s": [], "verify_s": []}
    original = ckpt.write_manifest
    for i in range(repeats):
        folder = root / f"{size}-{i}"
        manager = ckpt.CheckpointManager(folder=folder, interval=1, keep_latest_k=0, async_mode="disabled", enable=True)
        spent = []

        def timed_manifest(path, _spent=spent):
            t0 = time.perf_counter()
            result = original(path)
            _spent.append(time.perf_counter() - t0)
            return result

        ckpt.write_manifest = timed_manifest
        try:
            t0 = time.perf_counter()
            manager.save(1, states)
            rows["save_s"].append(time.perf_counter() - t0)
        finally:
            ckpt.write_manifest = original
        rows["manifest_s"].append(spent[0])
        t0 = time.perf_counter()
        assert ckpt.verify_checkpoint(manager.step_path(1))
        rows["verify_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        manager.load(states)  # verifies again inside; subtract the separately timed verification
        rows["load_s"].append(time.perf_counter() - t0 - rows["verify_s"][-1])
        nbytes = _bytes(manager.step_path(1))
        shutil.rmtree(folder)
    med = {k: min(v) for k, v in rows.items()}
    return {
        "size": size,
        "params_M": round(n_params / 1e6, 1),
        "checkpoint_GB": round(nbytes / 1e9, 3),
        "save_s": round(med["save_s"], 3),
        "manifest_s": round(med["manifest_s"], 3),
        "save_overhead_pct": round(100 * med["manifest_s"] / (med["save_s"] - med["manifest_s"]), 1),
        "load_s": round(med["load_s"], 3),
        "verify_s": round(med["verify_s"], 3),
        "load_overhead_pct": round(100 * med["verify_s"] / med["load_s"], 1),
        "hash_GB_per_s": round(nbytes / 1e9 / med["verify_s"], 2),
        "repeats": repeats,
    }


def main() -> None:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="debug,2.5", help="comma list: debug and/or GB of checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="CSV file")
    args = parser.parse_args()
    print(
        f"CPU: {cpu_model()} ({os.cpu_count()} cores visible), torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, hash threads {ckpt.hash_threads()}"
    )
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for size in args.sizes.split(","):
            results.append(measure(size, Path(tmp), args.repeats))
            print(f"  done: {size}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    keys = list(results[0])
    widths = {k: max(len(k), *(len(str(r[k])) for r in results)) for k in keys}
    print("  ".join(k.rjust(widths[k]) for k in keys))
    for r in results:
        print("  ".join(str(r[k]).rjust(widths[k]) for k in keys))
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["cpu", *keys])
            writer.writeheader()
            for r in results:
                writer.writerow({"cpu": cpu_model(), **r})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
