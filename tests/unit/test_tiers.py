"""The tiers hold (tests/support/tiers.py, docs/testing.md): every scheduled test names the
default-tier tests that cover its mechanism, and the default tier fits its budget by the
recorded durations."""

from __future__ import annotations

import fnmatch
import json
import os
import statistics
import subprocess
import sys

import pytest

from tests.conftest import xdist_group
from tests.support import tiers

UNRECORDED_MAX = 60  # tests without a recorded duration before the record must be redone


@pytest.fixture(scope="module")
def collection(tmp_path_factory) -> list[dict]:
    """Every test of the suite (both tiers), as a fresh pytest collects it."""
    out = tmp_path_factory.mktemp("tiers") / "collection.json"
    env = {**os.environ, "TITAN_TEST_TIER": "all", "TITAN_DUMP_COLLECTION": str(out)}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=tiers.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def _matches(prefix: str, nodeid: str) -> bool:
    return nodeid.startswith(prefix) or fnmatch.fnmatchcase(nodeid, prefix)


def test_every_scheduled_entry_names_tests_and_default_tests_that_cover_it(collection):
    ids = [t["nodeid"] for t in collection]
    default = [t["nodeid"] for t in collection if tiers.in_default_tier(t["nodeid"], exhaustive=t["exhaustive"])]
    for entry in tiers.SCHEDULED:
        assert any(fnmatch.fnmatchcase(i, entry.pattern) for i in ids), f"{entry.pattern}: matches no test"
        assert entry.covered_by and entry.why, entry
        for prefix in entry.covered_by:
            assert any(_matches(prefix, i) for i in default), (
                f"{entry.pattern}: covered_by {prefix!r} matches no default-tier test"
            )


def test_every_exhaustive_test_is_in_the_table(collection):
    missing = [t["nodeid"] for t in collection if t["exhaustive"] and not t["scheduled"]]
    assert not missing, (
        "marked `exhaustive` but without a tests/support/tiers.py entry naming the "
        f"default test that covers it: {missing}"
    )


def estimate_wall(durations: dict[str, float], nodeids: list[str], workers: int) -> tuple[float, list[str]]:
    """Estimated wall seconds of `nodeids` on `workers` workers: the larger of the even share and
    the biggest group (tests/conftest.py runs a group whole on one worker); tests without a
    recorded duration count at the 90th percentile of the recorded ones."""
    known = [durations[n] for n in nodeids if n in durations]
    fill = statistics.quantiles(known, n=10)[-1] if len(known) >= 10 else 30.0
    unrecorded = [n for n in nodeids if n not in durations]
    groups: dict[str, float] = {}
    total = 0.0
    for n in nodeids:
        d = durations.get(n, fill)
        total += d
        group = xdist_group(n)
        if group:
            groups[group] = groups.get(group, 0.0) + d
    return max(total / workers, max(groups.values(), default=0.0)), unrecorded


def test_estimate_counts_groups_whole():
    d = {"a": 10.0, "b": 10.0, "tests/xla/x": 50.0, "tests/xla/y": 40.0}
    wall, unrecorded = estimate_wall(d, ["a", "b", "tests/xla/x", "tests/xla/y"], 2)
    assert wall == 90.0 and unrecorded == []
    wall, _ = estimate_wall({**d, "tests/xla/x": 1.0, "tests/xla/y": 1.0}, ["a", "b", "tests/xla/x", "tests/xla/y"], 2)
    assert wall == 11.0


def test_the_default_tier_fits_its_budget(collection):
    assert tiers.DURATIONS.is_file(), f"{tiers.DURATIONS}: record it with scripts/test.sh --all --record"
    durations = json.loads(tiers.DURATIONS.read_text())
    default = [t["nodeid"] for t in collection if tiers.in_default_tier(t["nodeid"], exhaustive=t["exhaustive"])]
    wall, unrecorded = estimate_wall(durations, default, tiers.WORKERS)
    assert len(unrecorded) <= UNRECORDED_MAX, (
        f"{len(unrecorded)} default-tier tests have no recorded duration: rerun scripts/test.sh --all --record"
    )
    assert wall <= tiers.BUDGET_S, (
        f"the default tier's estimated wall time is {wall / 60:.1f} min on {tiers.WORKERS} workers, above its "
        f"{tiers.BUDGET_S / 60:.0f}-minute budget: move matrix points to the scheduled tier (tests/support/tiers.py, "
        f"naming the default test that covers each) or make tests cheaper"
    )


def test_the_smoke_loop_is_default_tier_tests_within_a_minute_and_a_half(collection):
    """`scripts/test.sh --smoke`: every SMOKE prefix names default-tier tests, and their recorded
    durations on one process sum to at most SMOKE_BUDGET_S (tests without a record count 30 s)."""
    durations = json.loads(tiers.DURATIONS.read_text())
    default = [t["nodeid"] for t in collection if tiers.in_default_tier(t["nodeid"], exhaustive=t["exhaustive"])]
    for prefix in tiers.SMOKE:
        assert any(n.startswith(prefix) for n in default), f"SMOKE {prefix!r}: matches no default-tier test"
    smoke = [n for n in default if tiers.in_smoke_tier(n)]
    total = sum(durations.get(n, 30.0) for n in smoke)
    assert total <= tiers.SMOKE_BUDGET_S, f"the smoke loop takes {total:.0f} s by the record: drop a test from SMOKE"
