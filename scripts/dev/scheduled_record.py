"""The scheduled tier's record (.ci/scheduled; docs/testing.md "The scheduled run in parts").

docs/results/scheduled_tier.json holds every scheduled test's last result (outcome, seconds, the
commit, date and CPU it ran on) and a summary line per run. The tier takes longer than one sitting
on a 2-vCPU machine (hours), so it can run whole (`.ci/scheduled`) or in parts (`.ci/scheduled
--missing`: only the scheduled tests without a good record, or with one older than `--since REV`);
the record says how much of the tier has a good result at or after which commit.

    .venv/bin/python scripts/dev/scheduled_record.py record OUTCOMES.json STATUS START_EPOCH OUT.json [--mode M]
    .venv/bin/python scripts/dev/scheduled_record.py todo COLLECTION.json OUT.json [--since REV] [--budget-s S]
    .venv/bin/python scripts/dev/scheduled_record.py status COLLECTION.json OUT.json [--since REV]

OUTCOMES.json is what tests/conftest.py writes under TITAN_RECORD_OUTCOMES ({node id: {outcome,
seconds}}); COLLECTION.json what it writes under TITAN_DUMP_COLLECTION (every collected test and
whether it is scheduled). It needs only the standard library and the project's command-line
module (`trainer.runtime.cli`); .ci/scheduled runs it with the project's venv.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trainer.runtime import cli

GOOD = ("passed", "xfailed")
"""Outcomes that count as the test's result being in hand (an expected failure is the test's
documented result; a skip is not: the test did not run)."""
DURATIONS = Path(__file__).resolve().parents[2] / "tests" / "support" / "durations.json"
UNRECORDED_S = 60.0
"""What `todo --budget-s` charges a test with no recorded duration."""


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], capture_output=True, text=True)


def read_record(path: Path) -> dict:
    """The record file, or an empty record; a file in the old one-run form (before the record kept
    tests) counts as empty."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"runs": [], "tests": {}}
    if not isinstance(data, dict) or "tests" not in data:
        return {"runs": [], "tests": {}}
    data.setdefault("runs", [])
    return data


def merge(record: dict, outcomes: dict, *, commit: str, date: str, cpu: str) -> dict:
    """`record` with each test of `outcomes` replaced by this run's result (tests this run did not
    reach keep their earlier one)."""
    tests = dict(record.get("tests", {}))
    for nodeid, result in outcomes.items():
        tests[nodeid] = {
            "outcome": result["outcome"],
            "seconds": round(float(result.get("seconds", 0.0)), 2),
            "commit": commit,
            "date": date,
            "cpu": cpu,
        }
    return {**record, "tests": dict(sorted(tests.items()))}


def counts(outcomes: dict) -> dict[str, int]:
    out = {"passed": 0, "xfailed": 0, "failed": 0, "skipped": 0}
    for result in outcomes.values():
        out[result["outcome"]] = out.get(result["outcome"], 0) + 1
    return out


def is_since(commit: str, since: str | None) -> bool:
    """Whether `commit` is `since` or comes after it (`since` None: every commit)."""
    if since is None:
        return True
    return _git("merge-base", "--is-ancestor", since, commit).returncode == 0


def scheduled_ids(collection: Path) -> list[str]:
    """The node ids of the collection's scheduled-tier tests (those outside the default tier)."""
    return [t["nodeid"] for t in json.loads(collection.read_text()) if not t["default"]]


def todo(ids: list[str], record: dict, *, since: str | None = None, budget_s: float | None = None) -> list[str]:
    """The scheduled tests without a good result at or after `since`, in collection order; with
    `budget_s`, the first of them whose recorded durations (tests/support/durations.json, the
    slowest machine's) sum to at most `budget_s` (always at least one). A module's shared fixture
    is recorded on the test that ran first, so the first test picked from a module is charged at
    least the module's largest recorded duration (a part of zero-duration tests still pays for
    the probe they read)."""
    tests = record.get("tests", {})
    ancestry: dict[str, bool] = {}
    left = []
    for nodeid in ids:
        entry = tests.get(nodeid)
        if entry and entry["outcome"] in GOOD:
            commit = entry["commit"]
            if commit not in ancestry:
                ancestry[commit] = is_since(commit, since)
            if ancestry[commit]:
                continue
        left.append(nodeid)
    if budget_s is None:
        return left
    durations = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    module_cost: dict[str, float] = {}
    for nodeid in ids:
        module = nodeid.split("::")[0]
        module_cost[module] = max(module_cost.get(module, 0.0), durations.get(nodeid, UNRECORDED_S))
    picked, total, charged = [], 0.0, set()
    for nodeid in left:
        module = nodeid.split("::")[0]
        cost = durations.get(nodeid, UNRECORDED_S)
        if module not in charged:
            cost = max(cost, module_cost[module])
        if picked and total + cost > budget_s:
            continue
        picked.append(nodeid)
        charged.add(module)
        total += cost
    return picked


def status_line(ids: list[str], record: dict, *, since: str | None = None) -> str:
    """'scheduled tier: G of N scheduled tests have a good result [since REV] (...)'."""
    tests = record.get("tests", {})
    missing = todo(ids, record, since=since)
    failed = [n for n in ids if tests.get(n, {}).get("outcome") == "failed"]
    commits = sorted({tests[n]["commit"] for n in ids if n in tests and n not in missing})
    durations = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    hours = sum(durations.get(n, UNRECORDED_S) for n in missing) / 3600
    where = f" at or after {since}" if since else ""
    line = (
        f"scheduled tier: {len(ids) - len(missing)} of {len(ids)} scheduled tests have a good result{where} "
        f"(commits {', '.join(commits) or 'none'}); {len(missing)} left, about {hours:.1f} h on the slowest "
        f"machine's recorded durations"
    )
    if failed:
        line += f"; last failed: {', '.join(failed)}"
    return line


def _record(args: argparse.Namespace) -> int:
    outcomes = json.loads(Path(args.outcomes).read_text()) if Path(args.outcomes).is_file() else {}
    commit = _git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    from trainer.runtime.device import cpu_model  # torch: only where a run is recorded

    cpu = cpu_model()
    out = Path(args.out)
    record = merge(read_record(out), outcomes, commit=commit, date=date, cpu=cpu)
    run = {
        "date": date,
        "commit": commit,
        "mode": args.mode,
        "exit_status": args.status,
        "wall_s": round(time.time() - args.start),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_1min_at_end": round(os.getloadavg()[0], 1),
        **counts(outcomes),
        "failures": sorted(n for n, r in outcomes.items() if r["outcome"] == "failed"),
    }
    if not outcomes:
        run["failures"] = ["no outcomes file: pytest did not finish"]
    record["runs"] = [*record.get("runs", []), run]
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, out)
    c = counts(outcomes)
    print(
        f"scheduled tier ({args.mode}): {c['passed']} passed, {c['xfailed']} xfailed, {c['failed']} failed, "
        f"{c['skipped']} skipped in {run['wall_s']} s -> {out}"
    )
    return 0


def main(argv: list[str]) -> int:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="merge one run's outcomes into the record")
    rec.add_argument("outcomes")
    rec.add_argument("status", type=int)
    rec.add_argument("start", type=float)
    rec.add_argument("out")
    rec.add_argument("--mode", default="whole", choices=("whole", "missing"))
    for name, text in (("todo", "print the scheduled tests still to run"), ("status", "one line: how much is done")):
        p = sub.add_parser(name, help=text)
        p.add_argument("collection")
        p.add_argument("out")
        p.add_argument("--since", default=None, help="results recorded before this commit count as missing")
        if name == "todo":
            p.add_argument("--budget-s", type=float, default=None, help="at most this many recorded seconds")
    args = parser.parse_args(argv)
    if args.command == "record":
        return _record(args)
    if args.since is not None and _git("rev-parse", "--verify", "--quiet", args.since).returncode != 0:
        parser.error(f"--since {args.since}: not a commit of this repository (allowed: a commit or ref)")
    ids = scheduled_ids(Path(args.collection))
    record = read_record(Path(args.out))
    if args.command == "todo":
        print("\n".join(todo(ids, record, since=args.since, budget_s=args.budget_s)))
    else:
        print(status_line(ids, record, since=args.since))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
