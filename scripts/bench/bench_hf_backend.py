"""Throughput of the `hf` Llama path vs the native Llama 3 family, same shape, side by side.

    OMP_NUM_THREADS=1 python scripts/bench/bench_hf_backend.py [--steps 8] [--repeats 3] [--out DIR]

The shape is the debug recipe's (configs/llama3_debug.toml: Llama 3 debugmodel, seq 512, batch 8,
bf16 parameters) unless overridden. The `hf` run trains `transformers`' LlamaForCausalLM built
from the config.json that the native family's HF adapter writes for the same args, so both
runs train the same architecture and the same parameter count. Each (family, mode) run trains
`--steps` steps in this process; its throughput is the median `tokens_per_sec` over the steps
after the first two (compile and warm-up); the table reports the median over `--repeats` runs,
interleaved so that a noisy neighbour hits every column alike. Prints a table and writes
bench_hf_backend.csv in `--out`.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys

from trainer.runtime import cli
from trainer.runtime.device import cpu_model


def write_llama_config(folder: str, **overrides) -> str:
    from models import get_model_family

    family = get_model_family("llama3")
    args = family.get_args("debugmodel", **overrides)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(family.hf_adapter.hf_config(args), f, indent=1)
    return folder


def run(argv: list[str], folder: str) -> float:
    from trainer.config import build_config, split_cli
    from trainer.train import train

    recipe, _, overrides = split_cli([*argv, f"--job.dump_folder={folder}"])
    train(build_config(recipe, overrides))
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return statistics.median(r["tokens_per_sec"] for r in records if r["step"] > 2)


def main() -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--backend", default="inductor", help="graph-mode compiler (inductor | aot_eager)")
    p.add_argument("--out", default="outputs/bench_hf_backend")
    a = p.parse_args()
    config_dir = write_llama_config(os.path.join(a.out, "llama_config"), max_seq_len=a.seq_len)
    common = [
        "--config",
        "configs/llama3_debug.toml",
        f"--training.steps={a.steps}",
        f"--training.seq_len={a.seq_len}",
        f"--training.local_batch_size={a.batch}",
        "--metrics.log_freq=1",
        "--checkpoint.enable=false",
        "--validation.enable=false",
        "--metrics.enable_tensorboard=false",
    ]
    families = {
        "native llama3": ["--model.name=llama3", "--model.flavor=debugmodel"],
        "hf LlamaForCausalLM": ["--model.name=hf", "--model.flavor=config", f"--model.hf_config={config_dir}"],
    }
    modes = {"eager": ["--compile.mode=eager"], "graph": ["--compile.mode=graph", f"--compile.backend={a.backend}"]}
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(a.repeats):
        for mode, mode_args in modes.items():
            for fam, fam_args in families.items():
                folder = os.path.join(a.out, f"{fam.split()[0]}_{mode}_{r}")
                results.setdefault((fam, mode), []).append(run([*common, *fam_args, *mode_args], folder))
    cpu = cpu_model()
    print(
        f"\ntokens/s (median of {a.repeats} runs, each the median of steps 3..{a.steps}); "
        f"seq {a.seq_len} x batch {a.batch}, bf16; CPU: {cpu}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )
    print(f"| family | {' | '.join(modes)} |\n|---|{'---|' * len(modes)}")
    rows = []
    for fam in families:
        meds = [statistics.median(results[(fam, m)]) for m in modes]
        print(f"| {fam} | {' | '.join(f'{x:,.0f}' for x in meds)} |")
        rows += [
            {
                "family": fam,
                "mode": m,
                "tokens_per_sec_median": statistics.median(results[(fam, m)]),
                "runs": results[(fam, m)],
                "cpu": cpu,
            }
            for m in modes
        ]
    with open(os.path.join(a.out, "bench_hf_backend.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    from trainer.runtime.device import shutdown_distributed

    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
