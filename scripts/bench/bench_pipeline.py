"""The measured pipeline bubble and per-rank memory of eager PP on the CPU, against the planner.

Runs the real trainer (`python -m trainer.train`, torchrun + gloo for PP) on a debug Llama 3 made
deep enough that the stages are equal (8 layers, `pipeline_first/last_stage_less_layers = 0`), for
one process (the same global batch: the work without a pipeline) and for PP `--pp` with every
`--schedules` x `--microbatches`, interleaved (repeat 0 of every variant, then repeat 1, ...).

Per run: the step time is the median over the steps after `--warmup` of the differences of the
trainer's `elapsed_s` (metrics.jsonl, every step logged); per rank, the peak resident set size
(`ru_maxrss`, written by the `--rank-child` wrapper the ranks run under, since metrics.jsonl has
rank 0's only). Per variant, medians over the repeats, then

- measured bubble = (T_pp - T_1 / p) / T_pp, with T_1 the one-process step time: the share of a
  pp rank's step not spent on its 1/p of the one-process work (idle, the stages' imbalance from
  the embedding / head, the point-to-point sends, the schedule's bookkeeping);
- the bubble at the same micro-batch: the same with T_1(m), one process running the global batch
  as m accumulation micro-batches of batch / m sequences (variants `pp1-acc<m>`), the very
  chunks each pipeline stage runs. A small chunk costs more per token than the whole batch (the
  CPU's kernels at fewer rows, the per-call overhead), and T_1 would count that as bubble; T_1(m)
  holds the same chunks, so what is left is the pipeline's own: idle stages, the sends, the
  schedule's bookkeeping;
- the planner's bubble `bubble_fraction(schedule, p, m, v)` (parallelisms/pipeline_parallel.py);
- peak RSS per rank against the planner's per-rank bytes (planner/pipeline.py
  `PipelineCost.rank_totals`): both as a difference from the one-process run's, so that the
  runtime's own resident memory (the interpreter, torch, the data loader), the same in every
  process, cancels.

    .venv/bin/python scripts/bench/bench_pipeline.py --repeats 3            # the table + CSV
    .venv/bin/python scripts/bench/bench_pipeline.py --dry-run              # the commands only

`--modes eager,compile` runs every variant again in compile mode (per-block compiled stages,
Inductor on the CPU; names suffixed `-compile`, no accumulation baselines): each mode's bubble is
read against its own one-process run, and a second table gives every variant's tokens/s (the
global batch's tokens over the median step time), eager and compile side by side.

    .venv/bin/python scripts/bench/bench_pipeline.py --modes eager,compile --schedules 1F1B --microbatches 4

`--side-by-side` instead runs TorchTitan 0.3.0's own trainer (scripts/bench/reference_torchtitan.py,
the peer venv of scripts/bench/peer_env.sh) against ours at its debugmodel shape
(configs/llama3_debug_ttshape.toml: 6 layers, no GQA, vocab 2048; bf16, no AC on both sides), at
`--seq-len` and global batch `--batch`: one process each, then PP 2 for every `--schedules` with
`--microbatches` (its first value) micro-batches (TorchTitan's `pipeline_parallel_microbatch_size`
= batch / m), all interleaved; both sides' tokens/s per device divide by the pp degree
(TorchTitan's `non_data_parallel_size`, ours `ParallelDims.non_data_parallel_size`).

    .venv/bin/python scripts/bench/bench_pipeline.py --side-by-side --schedules GPipe,1F1B --microbatches 4 \
        --seq-len 512 --repeats 3 --steps 10 --warmup 3

The CSV goes to docs/results/pp_bubble_<date>_<commit>.csv (`--out` to change; the side by side:
pp_vs_torchtitan_<date>_<commit>.csv). The numbers are
only as good as the machine is quiet: the table header states the CPU and the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from tools.benchmark import write_csv
from tools.maxtext_runs import git_commit
from trainer.runtime import cli

REPO = Path(__file__).resolve().parents[2]

RSS_FILE = "rss_rank{rank}.json"
ONE = "pp1"
"""The one-process variant's name."""


# ------------------------------------------------------------------------------ pure helpers


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    pp: int
    schedule: str = ""
    microbatches: int = 0
    accum: int = 1
    """One process only: the global batch as `accum` accumulation micro-batches (T_1(m))."""
    mode: str = "eager"
    """`[compile] mode` ("eager" or "compile": the blocks compiled per block, Inductor on the CPU)."""

    def overrides(self, batch: int) -> list[str]:
        if self.pp == 1:
            if self.accum == 1:
                return []
            return [
                f"--training.local_batch_size={batch // self.accum}",
                f"--training.gradient_accumulation_steps={self.accum}",
            ]
        return [
            f"--parallelism.pipeline_parallel_degree={self.pp}",
            "--parallelism.data_parallel_shard_degree=1",
            f"--parallelism.pipeline_schedule={self.schedule}",
            f"--parallelism.pipeline_microbatches={self.microbatches}",
            "--parallelism.pipeline_first_stage_less_layers=0",
            "--parallelism.pipeline_last_stage_less_layers=0",
        ]


def one_name(mode: str) -> str:
    """The one-process variant's name in step mode `mode`."""
    return ONE if mode == "eager" else f"{ONE}-{mode}"


def variants(pp: int, schedules: list[str], microbatches: list[int], modes=("eager",)) -> list[Variant]:
    """The one-process run, the one process at each micro-batch count (accumulation), then PP `pp` for
    every schedule x micro-batch count; for each other step mode of `modes` (`--modes`, e.g.
    "compile") the one process and every PP variant again in that mode (names suffixed `-<mode>`;
    no accumulation baselines)."""
    out = []
    for mode in modes:
        tail = "" if mode == "eager" else f"-{mode}"
        out.append(Variant(one_name(mode), 1, mode=mode))
        if mode == "eager":
            out += [Variant(f"{ONE}-acc{m}", 1, microbatches=m, accum=m) for m in microbatches if m > 1]
        out += [Variant(f"pp{pp}-{s}-m{m}{tail}", pp, s, m, mode=mode) for s in schedules for m in microbatches]
    return out


def step_times(records: list[dict], warmup: int) -> list[float]:
    """Per-step seconds from consecutive `elapsed_s` (every step logged), the steps after `warmup` only."""
    by_step = {int(r["step"]): float(r["elapsed_s"]) for r in records if r.get("elapsed_s") is not None}
    return [by_step[s] - by_step[s - 1] for s in sorted(by_step) if s > warmup and s - 1 in by_step]


def measured_bubble(t_pp: float, t_one: float, pp: int) -> float:
    """(T_pp - T_1 / p) / T_pp: the share of a pp rank's step beyond its 1/p of the one-process step."""
    return (t_pp - t_one / pp) / t_pp


def median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict], pp: int) -> list[dict]:
    """Medians over the repeats per variant; the bubble and the RSS differences against the one-process row."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run["variant"], []).append(run)
    rows = []
    for name, group in groups.items():
        ok = [r for r in group if r["rc"] == 0 and r["step_s"] is not None]
        row = {k: group[0][k] for k in ("variant", "pp", "schedule", "microbatches", "planned_bubble")}
        row["mode"] = group[0].get("mode", "eager")
        row.update(
            {
                k: group[0][k]
                for k in ("planned_imbalance", "planned_bubble_imbalance", "planned_bubble_flops")
                if k in group[0]
            }
        )
        row.update(runs=len(group), ok=len(ok), step_s=median_or_none([r["step_s"] for r in ok]))
        spread = [r["step_s"] for r in ok]
        row["step_s_min"], row["step_s_max"] = (min(spread), max(spread)) if spread else (None, None)
        for rank in range(row["pp"]):
            row[f"rss_mib_r{rank}"] = median_or_none([r.get(f"rss_mib_r{rank}") for r in ok])
            row[f"plan_mib_r{rank}"] = group[0].get(f"plan_mib_r{rank}")
        row["load_avg"] = median_or_none([r.get("load_avg") for r in ok])
        tokens = group[0].get("tokens_per_step")
        if tokens and row["step_s"]:
            row["tokens_per_s"] = tokens / row["step_s"]
        rows.append(row)
    ones = {r["mode"]: r for r in rows if r["variant"] == one_name(r["mode"])}
    at_m = {r["microbatches"]: r for r in rows if r["pp"] == 1 and r["variant"] not in (ONE, one_name(r["mode"]))}
    for row in rows:
        one = ones.get(row["mode"])  # T_1 in the row's own step mode
        if one is None or one["step_s"] is None or row["step_s"] is None:
            row["measured_bubble"] = None
            continue
        row["ideal_step_s"] = one["step_s"] / row["pp"]
        row["measured_bubble"] = measured_bubble(row["step_s"], one["step_s"], row["pp"])
        same = at_m.get(row["microbatches"]) if row["pp"] > 1 and row["mode"] == "eager" else None
        if same is not None and same["step_s"] is not None:
            row["ideal_step_s_at_m"] = same["step_s"] / row["pp"]
            row["measured_bubble_at_m"] = measured_bubble(row["step_s"], same["step_s"], row["pp"])
        for rank in range(row["pp"]):
            rss, plan = row.get(f"rss_mib_r{rank}"), row.get(f"plan_mib_r{rank}")
            if rss is not None and one.get("rss_mib_r0") is not None:
                row[f"rss_delta_mib_r{rank}"] = rss - one["rss_mib_r0"]
            if plan is not None and one.get("plan_mib_r0") is not None:
                row[f"plan_delta_mib_r{rank}"] = plan - one["plan_mib_r0"]
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict], pp: int) -> str:
    ranks = range(pp)
    head = (
        "| variant | step s (min..max) | T_1 / p s | bubble vs T_1 | T_1(m) / p s | bubble vs T_1(m) | bubble planned | "
        "planned with the head's imbalance | " + " | ".join(f"RSS - 1 proc MiB r{r} (planned)" for r in ranks) + " |"
    )
    lines = [head, "|" + "---|" * (8 + pp)]
    for row in rows:
        piped = row["pp"] > 1
        cells = [
            row["variant"],
            f"{_fmt(row['step_s'], '.3f')} ({_fmt(row['step_s_min'], '.3f')}..{_fmt(row['step_s_max'], '.3f')})",
            _fmt(row.get("ideal_step_s"), ".3f") if piped else "-",
            _fmt(row.get("measured_bubble"), ".1%") if piped else "-",
            _fmt(row.get("ideal_step_s_at_m"), ".3f") if piped else "-",
            _fmt(row.get("measured_bubble_at_m"), ".1%") if piped else "-",
            _fmt(row.get("planned_bubble"), ".1%") if piped else "-",
            _fmt(row.get("planned_bubble_imbalance"), ".1%") if piped else "-",
        ]
        for r in ranks:
            if row["variant"] != ONE and not piped:  # an accumulation baseline: its time only
                cells.append("-")
            elif row["pp"] == 1:  # absolute figures, in the first rank column
                one = f"{_fmt(row.get('rss_mib_r0'), '.0f')} abs ({_fmt(row.get('plan_mib_r0'), '.0f')} abs)"
                cells.append("-" if r else one)
            else:
                delta = (
                    f"{_fmt(row.get(f'rss_delta_mib_r{r}'), '+.0f')} ({_fmt(row.get(f'plan_delta_mib_r{r}'), '+.0f')})"
                )
                cells.append(delta)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the planner's figures


def planned(variant: Variant, *, n_layers: int, seq_len: int, batch: int) -> dict:
    """The planner's bubble and per-rank MiB (planner/pipeline.py) for this run's shape, eager, no AC."""
    import planner as P
    from models import get_model_family
    from parallelisms.pipeline_parallel import bubble_fraction, virtual_stages
    from trainer.step import StepRequest

    family = get_model_family("llama3")
    args = dataclasses.replace(family.flavors["debugmodel"], n_layers=n_layers)
    step = StepRequest(
        mode="eager",
        device_type="cpu",
        model_has_experts=False,
        pp_degree=variant.pp,
        pp_schedule=variant.schedule or "1F1B",
        pp_microbatches=variant.microbatches if variant.pp > 1 else 0,
        pp_first_less=0,
        pp_last_less=0,
    )
    inputs = P.PlanInputs(
        family=family,
        args=args,
        model_name="llama3",
        seq_len=seq_len,
        local_batch_size=batch // variant.accum,
        step=step,
    )
    est = P.plan_estimate(inputs, P.parse_target(f"h100-{variant.pp}"), pp=variant.pp, dp_shard=1)
    if variant.pp == 1:
        return {"planned_bubble": 0.0, "plan_mib_r0": est.total / 2**20}
    v = virtual_stages(variant.schedule, 0)
    bubble = bubble_fraction(variant.schedule, variant.pp, variant.microbatches, v)
    # the planner's: the zero-bubble schedules' B and W passes at their FLOPs (planner/pipeline.py
    # `zero_bubble_costs`), the others' the same as `bubble_fraction`'s
    planned_bubble = est.pipeline.bubble
    out = {
        "planned_bubble": bubble,
        "planned_imbalance": est.pipeline.imbalance,
        "planned_bubble_flops": planned_bubble,
    }
    # the planner's step over the balanced share, t = t_1 / p x imbalance / (1 - bubble), as the
    # measured bubble is read: (t - t_1 / p) / t
    out["planned_bubble_imbalance"] = 1 - (1 - planned_bubble) / est.pipeline.imbalance
    out.update({f"plan_mib_r{r}": t / 2**20 for r, t in enumerate(est.pipeline.rank_totals)})
    return out


# ------------------------------------------------------------------------------ running


def command(
    variant: Variant, *, folder: Path, steps: int, common: list[str], batch: int, python: str = sys.executable
) -> list[str]:
    """The trainer under the `--rank-child` wrapper (torchrun for pp > 1)."""
    from tools.benchmark import RUN_OVERRIDES

    me = str(Path(__file__).resolve())
    launcher = [python, me] if variant.pp == 1 else [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={variant.pp}", me,
    ]  # fmt: skip
    return [
        *launcher,
        "--rank-child",
        "--config",
        "configs/llama3_debug.toml",
        *RUN_OVERRIDES,
        f"--training.steps={steps}",
        f"--job.dump_folder={folder}",
        *common,
        f"--compile.mode={variant.mode}",
        *variant.overrides(batch),
    ]


def rank_child(argv: list[str]) -> None:
    """Run the trainer in this process, then write this rank's peak RSS next to its metrics."""
    from trainer.train import main

    code = main(argv)
    folder = next((a.split("=", 1)[1] for a in argv if a.startswith("--job.dump_folder=")), ".")
    rank = int(os.environ.get("RANK", "0"))
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Path(folder, RSS_FILE.format(rank=rank)).write_text(json.dumps({"rank": rank, "maxrss_mib": rss_kib / 1024}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as trainer/train.py's __main__: no interpreter teardown after the process groups


def run_all(vs: list[Variant], args, root: Path, plans: dict[str, dict]) -> list[dict]:
    from tools.benchmark import read_records

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    jobs = [(rep, v) for rep in range(args.repeats) for v in vs]
    runs = []
    for i, (rep, v) in enumerate(jobs):
        folder = root / f"{v.name}-r{rep}"
        folder.mkdir(parents=True, exist_ok=True)
        cmd = command(v, folder=folder, steps=args.steps, common=args.common, batch=args.batch)
        print(
            f"[{i + 1}/{len(jobs)}] {v.name} repeat {rep} (load {os.getloadavg()[0]:.2f}) ...",
            file=sys.stderr,
            flush=True,
        )
        with open(folder / "stdout.log", "w") as log:
            try:
                rc = subprocess.run(
                    cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        times = step_times(read_records(folder / "metrics.jsonl"), args.warmup)
        run = {
            "variant": v.name, "pp": v.pp, "schedule": v.schedule or "-", "microbatches": v.microbatches,
            "mode": v.mode, "repeat": rep, "rc": rc, "step_s": median_or_none(times), "steady_steps": len(times),
            "tokens_per_step": args.batch * args.seq_len,
            "load_avg": os.getloadavg()[0], **plans[v.name],
        }  # fmt: skip
        for rank in range(v.pp):
            f = folder / RSS_FILE.format(rank=rank)
            run[f"rss_mib_r{rank}"] = json.loads(f.read_text())["maxrss_mib"] if f.is_file() else None
        if rc != 0:
            print(f"  failed (exit {rc}); see {folder / 'stdout.log'}", file=sys.stderr)
        runs.append(run)
    return runs


PEER_FIXED = ["--training.disable-cuda-graphs"]
"""TorchTitan 0.3.0 refuses PP unless CUDA graphs are off (a config check, also on the CPU)."""


def side_by_side_jobs(args, root: Path) -> list[dict]:
    """Ours and TorchTitan's trainer, one process then PP 2 per schedule, interleaved over the repeats."""
    from tools.benchmark import build_command, build_peer_command

    m = int(args.microbatches.split(",")[0])
    ours_common = [f"--training.seq_len={args.seq_len}", f"--training.local_batch_size={args.batch}"]
    ours_common += ["--compile.mode=eager", "--activation_checkpoint.mode=none"]
    pairs = [("1proc", 1, [], [])]
    for sched in args.schedules.split(","):
        ours = [
            "--parallelism.pipeline_parallel_degree=2",
            "--parallelism.data_parallel_shard_degree=1",
            f"--parallelism.pipeline_schedule={sched}",
            f"--parallelism.pipeline_microbatches={m}",
        ]
        theirs = [
            "--parallelism.pipeline-parallel-degree", "2",
            "--parallelism.pipeline-parallel-schedule", sched,
            "--parallelism.pipeline-parallel-microbatch-size", str(args.batch // m),
            *PEER_FIXED,
        ]  # fmt: skip
        pairs.append((f"pp2_{sched}_m{m}", 2, ours, theirs))
    jobs = []
    for rep in range(args.repeats):
        for name, nproc, ours, theirs in pairs:
            for side in ("ours", "torchtitan"):
                folder = root / f"{side}_{name}-r{rep}"
                job = {"variant": f"{side}_{name}", "nproc": nproc, "repeat": rep, "folder": folder}
                if side == "ours":
                    job["cmd"] = build_command(
                        recipe="configs/llama3_debug_ttshape.toml",
                        overrides=ours,
                        nproc=nproc,
                        dump_folder=str(folder),
                        steps=args.steps,
                        extra=ours_common,
                    )
                else:
                    job["cmd"] = build_peer_command(
                        peer="torchtitan",
                        python=args.peer_python,
                        nproc=nproc,
                        dump_folder=str(folder),
                        steps=args.steps,
                        warmup=args.warmup,
                        seq_len=args.seq_len,
                        batch=args.batch,
                        extra=[*theirs, "activation-checkpoint:none"],
                    )
                    job["log"] = "harness.log"
                jobs.append(job)
    return jobs


def side_by_side_ratios(rows: list[dict]) -> list[dict]:
    """`vs_torchtitan` on each of our rows: our tokens/s per device over TorchTitan's for the same setting."""
    theirs = {
        r["variant"].removeprefix("torchtitan_"): r.get("tokens_per_sec")
        for r in rows
        if r["variant"].startswith("torchtitan_")
    }
    for row in rows:
        key = row["variant"].removeprefix("ours_")
        ours, base = row.get("tokens_per_sec"), theirs.get(key)
        row["vs_peer"] = ours / base if row["variant"].startswith("ours_") and ours and base else None
    return rows


def side_by_side(args) -> int:
    from tools.benchmark import execute, format_table, machine_fields, summarize

    if not Path(args.peer_python).is_file():
        cli.error_line(
            f"--peer-python: {args.peer_python} is missing; allowed: a python with torchtitan 0.3.0 "
            "(bash scripts/bench/peer_env.sh builds .venv-peer)"
        )
        return 2
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    root = Path(args.root or REPO / "outputs" / "bench_pipeline" / f"sbs_{stamp}")
    jobs = side_by_side_jobs(args, root)
    if args.dry_run:
        for job in jobs[: len(jobs) // args.repeats]:
            print(" ".join(map(str, job["cmd"])))
        return 0
    machine = machine_fields(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    runs = execute(jobs, env=env, warmup=args.warmup, timeout=args.timeout, max_busy=1.0, max_wait=0.0)
    for run in runs:  # execute records each run's busy_before; the load average is the header's
        run.update(machine)
    rows = side_by_side_ratios(summarize(runs))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = Path(args.out or REPO / "docs" / "results" / f"pp_vs_torchtitan_{date}_{git_commit()}.csv")
    print(
        f"\nours vs TorchTitan 0.3.0 at its debugmodel shape, seq {args.seq_len}, global batch {args.batch}, bf16, "
        f"eager, no AC; {args.steps} steps, first {args.warmup} dropped, median of {args.repeats} interleaved repeats; "
        f"CPU {machine['cpu_model']}, {os.cpu_count()} CPUs, {args.threads} thread(s) per process, "
        f"load average now {os.getloadavg()[0]:.2f}"
    )
    print(format_table(rows))
    write_csv(out, rows)
    write_csv(
        out.with_name(out.stem + "_runs" + out.suffix),
        runs,
    )
    print(f"\nwrote {out} and its _runs companion")
    return 0 if all(r["ok"] == r["runs"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-child"]:
        rank_child(argv[1:])
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--schedules", default="GPipe,1F1B,Interleaved1F1B,ZBVZeroBubble")
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument(
        "--modes",
        default="eager",
        help="step modes, e.g. eager,compile (compile: every variant again, per-block compiled)",
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch (= the local batch: no data parallelism)")
    parser.add_argument("--dtype", default="bfloat16", help="training.mixed_precision_param")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--root", default=None, help="run folders (default outputs/bench_pipeline/<time>)")
    parser.add_argument("--out", default=None, help="summary CSV (default docs/results/pp_bubble_<date>_<commit>.csv)")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--side-by-side", action="store_true", help="ours vs TorchTitan's own PP (see the docstring)")
    parser.add_argument("--peer-python", default=str(REPO / ".venv-peer" / "bin" / "python"))
    args = parser.parse_args(argv)
    if args.side_by_side:
        return side_by_side(args)
    args.common = [
        f"--model.n_layers={args.layers}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.batch}",
        f"--training.mixed_precision_param={args.dtype}",
        "--activation_checkpoint.mode=none",
    ]
    modes = tuple(args.modes.split(","))
    vs = variants(args.pp, args.schedules.split(","), [int(m) for m in args.microbatches.split(",")], modes)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    root = Path(args.root or REPO / "outputs" / "bench_pipeline" / stamp)
    if args.dry_run:
        for v in vs:
            print(" ".join(command(v, folder=root / v.name, steps=args.steps, common=args.common, batch=args.batch)))
        return 0
    plans = {v.name: planned(v, n_layers=args.layers, seq_len=args.seq_len, batch=args.batch) for v in vs}
    from tools.benchmark import machine_fields

    machine = machine_fields(args.threads)
    runs = run_all(vs, args, root, plans)
    rows = summarize(runs, args.pp)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = Path(args.out or REPO / "docs" / "results" / f"pp_bubble_{date}_{git_commit()}.csv")
    print(
        f"\nllama3 debugmodel, {args.layers} layers, seq {args.seq_len}, global batch {args.batch}, {args.dtype}, "
        f"{'/'.join(modes)}, no AC; {args.steps} steps, first {args.warmup} dropped, median of {args.repeats} interleaved "
        f"repeats; CPU {machine['cpu_model']}, {os.cpu_count()} CPUs, {args.threads} thread(s) per process, "
        f"load average now {os.getloadavg()[0]:.2f}"
    )
    print(format_table(rows, args.pp))
    if len(modes) > 1:  # the step modes side by side: tokens/s (the global batch's tokens per step time)
        print("\n| variant | mode | tokens/s |\n|---|---|---|")
        for row in rows:
            print(f"| {row['variant']} | {row['mode']} | {_fmt(row.get('tokens_per_s'), '.0f')} |")
    write_csv(out, rows)
    write_csv(out.with_name(out.stem + "_runs" + out.suffix), runs)
    print(f"\nwrote {out} and its _runs companion")
    return 0 if all(r["ok"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
