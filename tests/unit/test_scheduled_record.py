"""The scheduled tier's record (scripts/dev/scheduled_record.py; docs/testing.md "The scheduled run
in parts"): runs merge per test, `todo` lists what has no good result (at or after a commit), and
`--budget-s` cuts a part by the recorded durations."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

from trainer.runtime import cli

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "dev" / "scheduled_record.py"
_spec = importlib.util.spec_from_file_location("scheduled_record", SCRIPT)
rec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rec)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_runs_merge_per_test_and_todo_lists_what_has_no_good_result(tmp_path, monkeypatch):
    ids = ["t::a", "t::b", "t::c", "t::d"]
    first = {"t::a": {"outcome": "passed", "seconds": 1.0}, "t::b": {"outcome": "failed", "seconds": 2.0}}
    record = rec.merge({"runs": [], "tests": {}}, first, commit="c1", date="d1", cpu="x")
    second = {"t::b": {"outcome": "passed", "seconds": 2.5}, "t::c": {"outcome": "skipped", "seconds": 0.0}}
    record = rec.merge(record, second, commit="c2", date="d2", cpu="x")
    assert record["tests"]["t::a"]["commit"] == "c1"  # a test the second part did not reach keeps its result
    assert record["tests"]["t::b"] == {"outcome": "passed", "seconds": 2.5, "commit": "c2", "date": "d2", "cpu": "x"}
    # a skip is not a result (the test did not run); an expected failure is
    assert rec.todo(ids, record) == ["t::c", "t::d"]
    record = rec.merge(record, {"t::c": {"outcome": "xfailed", "seconds": 0.1}}, commit="c2", date="d2", cpu="x")
    assert rec.todo(ids, record) == ["t::d"]

    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"t::a": 50.0, "t::b": 30.0, "t::c": 20.0, "u::a": 0.0, "u::b": 40.0}))
    monkeypatch.setattr(rec, "DURATIONS", durations)
    fresh = {"runs": [], "tests": {}}
    # in order, skipping what would pass the budget; an unrecorded test counts UNRECORDED_S (60),
    # and t::a, the first of its module, the module's largest record (t::d's 60)
    assert rec.todo(ids, fresh, budget_s=85) == ["t::a", "t::c"]
    assert rec.todo(ids, fresh, budget_s=1) == ["t::a"]  # a part always takes one test
    # the first test taken from a module pays at least the module's largest record (its fixture)
    assert rec.todo(["t::a", "u::a", "u::b"], fresh, budget_s=80) == ["t::a"]
    assert rec.todo(["t::a", "u::a", "u::b"], fresh, budget_s=90) == ["t::a", "u::a"]
    assert "2 of 4 scheduled tests have a good result" in rec.status_line(
        ids, rec.merge(fresh, first | second, commit="c1", date="d", cpu="x")
    )


def test_since_treats_results_of_older_commits_as_missing(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    commits = []
    for i in range(3):
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", str(i))
        commits.append(_git(repo, "rev-parse", "--short", "HEAD"))
    monkeypatch.chdir(repo)
    record = {"runs": [], "tests": {}}
    record = rec.merge(record, {"t::old": {"outcome": "passed"}}, commit=commits[0], date="d", cpu="x")
    record = rec.merge(record, {"t::new": {"outcome": "passed"}}, commit=commits[2], date="d", cpu="x")
    assert rec.todo(["t::old", "t::new"], record, since=commits[1]) == ["t::old"]
    assert rec.todo(["t::old", "t::new"], record) == []
    code = cli.run(rec.main, ["todo", "c.json", "r.json", "--since", "no-such-ref"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "--since no-such-ref" in err, err
    assert len(err.strip().splitlines()) == 1
