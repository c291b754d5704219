"""Measure the training loader's data work per rank against the data-parallel world size.

For each world size D, builds the loader of every dp rank (in this one process, one after the
other: on a real job they run in parallel on their own hosts, so the per-rank time is what
counts) and times `next_batch` over `--steps` calls, tokenization and file reading included
(the loader's construction, which reads nothing, is not timed). Two modes:

- `sharded`: the loader as the trainer builds it (`training.dataset_shards` = auto: 64
  shards; each rank reads and tokenizes only its 64/D shards);
- `whole-stream`: the same global window stream read as before data sharding: one shard that
  every rank reads in full, keeping its slice (a TokenLoader with num_shards=1).

The per-rank time per step should stay flat with D when sharded, and grow ~D-fold for the
whole stream. Each number is the median over `--repeats` runs. Prints a table, writes CSV.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/bench_data.py --worlds 1,2,4 --out data.csv

Default shape: the debug recipe's (configs/llama3_debug.toml: bundled corpus, seq_len 512,
local batch 8, 200 steps).
"""

import csv
import os
import statistics
import sys
import time

from trainer.data import TokenLoader, build_dataloader, resolve_dataset
from trainer.data.tokenizer import build_tokenizer
from trainer.runtime import cli
from trainer.runtime.device import cpu_model


def _loader(mode: str, *, tok, dataset: str, seq_len: int, batch: int, rank: int, world: int):
    if mode == "sharded":
        return build_dataloader(
            dataset=dataset,
            tokenizer=tok,
            seq_len=seq_len,
            local_batch_size=batch,
            dp_rank=rank,
            dp_degree=world,
            seed=42,
        )
    return TokenLoader(
        source=resolve_dataset(dataset),
        tokenizer=tok,
        seq_len=seq_len,
        local_batch_size=batch,
        dp_rank=rank,
        dp_degree=world,
        seed=42,
        num_shards=1,
    )


def _time_rank(mode: str, steps: int, **kw) -> tuple[float, int]:
    """(seconds per next_batch over `steps` calls, documents tokenized) of one rank's loader."""
    loader = _loader(mode, **kw)
    start = time.perf_counter()
    for _ in range(steps):
        loader.next_batch()
    return (time.perf_counter() - start) / steps, loader.docs_tokenized


def main(argv=None) -> int:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1,2,4", help="data-parallel world sizes, comma separated")
    parser.add_argument("--dataset", default="bundled")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="local batch per rank")
    parser.add_argument("--steps", type=int, default=200, help="next_batch calls per rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="sharded,whole-stream")
    parser.add_argument("--out", default="bench_data.csv")
    args = parser.parse_args(argv)
    tok = build_tokenizer("bundled")
    _time_rank(
        "sharded", 1, tok=tok, dataset=args.dataset, seq_len=args.seq_len, batch=args.batch, rank=0, world=1
    )  # warm-up: imports `datasets`, fills the page cache

    rows = []
    for mode in args.modes.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            per_rank: list[list[float]] = [[] for _ in range(world)]
            docs = [0] * world
            for _ in range(args.repeats):
                for rank in range(world):
                    seconds, docs[rank] = _time_rank(
                        mode,
                        args.steps,
                        tok=tok,
                        dataset=args.dataset,
                        seq_len=args.seq_len,
                        batch=args.batch,
                        rank=rank,
                        world=world,
                    )
                    per_rank[rank].append(seconds)
            medians = [statistics.median(times) for times in per_rank]
            tokens = args.batch * (args.seq_len + 1)
            rows.append(
                {
                    "mode": mode,
                    "world": world,
                    "steps": args.steps,
                    "ms_per_step_mean_rank": round(1e3 * statistics.mean(medians), 3),
                    "ms_per_step_max_rank": round(1e3 * max(medians), 3),
                    "tokens_per_s_per_rank": round(tokens / statistics.mean(medians)),
                    "docs_tokenized_per_rank": round(statistics.mean(docs), 1),
                }
            )
            print(rows[-1], flush=True)

    print(
        f"\nCPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f}; dataset {args.dataset}, seq_len "
        f"{args.seq_len}, local batch {args.batch}, {args.steps} steps per rank, median of {args.repeats}"
    )
    header = (
        f"{'mode':<13} {'world':>5} {'ms/step (rank mean)':>20} {'ms/step (max rank)':>19} "
        f"{'tokens/s/rank':>14} {'docs tokenized/rank':>20}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['mode']:<13} {r['world']:>5} {r['ms_per_step_mean_rank']:>20.2f} {r['ms_per_step_max_rank']:>19.2f} "
            f"{r['tokens_per_s_per_rank']:>14,} {r['docs_tokenized_per_rank']:>20,.1f}"
        )
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
