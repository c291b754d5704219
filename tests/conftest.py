"""Shared test set-up: every test starts with the torch reference behind each model op, and
the platform and device markers skip what this host cannot run.

`trainer.train` (run in-process by some tests) registers kernels for the rest of its process
(`titan_kernels.select`); without this reset a later test would silently run on whatever an earlier
test selected, and its result would depend on the CPU's instruction set.

Markers (pyproject.toml): `linux` (reads /proc; `linux_only` below marks and skips off Linux),
`cuda` (skipped unless `torch.cuda.is_available()`), `tpu` (skipped unless torch-tpu found a
TPU in this process: `trainer.runtime.device.tpu_present`, which never imports torch-tpu itself;
on a TPU VM run pytest with `TORCH_DEVICE_BACKEND_AUTOLOAD=1`). `exhaustive`: one more point of
a matrix whose mechanism another test of the default run already proves (another mesh of the
same parallelism, another wire of the same pass); it and every other test of the scheduled tier
(tests/support/tiers.py: each names the default-tier test that covers its mechanism) run only
with `scripts/test.sh --all` (`TITAN_TEST_TIER=all`, `.ci/scheduled`, docs/testing.md).
"""

import functools
import os
import random
import sys
from pathlib import Path

import pytest
import torch

from models.common import ops
from tests.support import tiers
from trainer.runtime.device import cpu_model, tpu_present

ON_LINUX = sys.platform.startswith("linux")
# The seed of the device orders multi-process runs take (tests/support/trainer_runs.py), drawn once
# here so that every pytest-xdist worker, which inherits the environment, draws the same orders.
os.environ.setdefault("TITAN_TEST_ORDER_SEED", str(random.SystemRandom().randrange(10**6)))


def linux_only(test):
    """Mark `test` (a function or class) `linux` and skip it off Linux: it reads /proc."""
    return pytest.mark.linux(pytest.mark.skipif(not ON_LINUX, reason="Linux only: reads /proc")(test))


@functools.cache
def _devices() -> dict[str, bool]:
    return {"cuda": torch.cuda.is_available(), "tpu": tpu_present()}


_NO_DEVICE = {
    "cuda": "needs a CUDA GPU (torch.cuda.is_available() is False)",
    "tpu": "needs a TPU (torch-tpu found none; on a TPU VM set TORCH_DEVICE_BACKEND_AUTOLOAD=1)",
}


def pytest_report_header(config):
    seed = os.environ["TITAN_TEST_ORDER_SEED"]
    return f"device orders of multi-process runs: TITAN_TEST_ORDER_SEED={seed} (tests/support/trainer_runs.py)"


def pytest_runtest_setup(item):
    for device, reason in _NO_DEVICE.items():
        if item.get_closest_marker(device) is not None and not _devices()[device]:
            pytest.skip(reason)


# Tiers (tests/support/tiers.py, docs/testing.md): the default tier (scripts/test.sh, CI) leaves
# out the scheduled tier's tests (`deselected` in pytest's summary); `scripts/test.sh --smoke`
# keeps only the fast loop's (`tiers.SMOKE`); `scripts/test.sh --all`
# (TITAN_TEST_TIER=all; .ci/scheduled) runs everything. With TITAN_DUMP_COLLECTION=FILE the
# collection (every test, its tier, its `exhaustive` mark) is written to FILE as JSON, before any
# deselection (tests/unit/test_tiers.py reads it).
def pytest_collection_modifyitems(config, items):
    dump = os.environ.get("TITAN_DUMP_COLLECTION")
    if dump and not hasattr(config, "workerinput"):
        import json

        with open(dump, "w") as f:
            json.dump(
                [
                    {
                        "nodeid": i.nodeid,
                        "scheduled": tiers.scheduled(i.nodeid) is not None,
                        "exhaustive": i.get_closest_marker("exhaustive") is not None,
                        "default": tiers.in_default_tier(
                            i.nodeid, exhaustive=i.get_closest_marker("exhaustive") is not None
                        ),
                    }
                    for i in items
                ],
                f,
            )
    # .ci/scheduled --missing: the tests its record still lacks (scripts/dev/scheduled_record.py todo);
    # taken out of the environment, so that a pytest a test starts (test_readme_commands runs
    # scripts/test.sh) selects its own tests instead of deselecting them all
    only = os.environ.pop("TITAN_ONLY_NODEIDS", None)
    if only:
        wanted = set(Path(only).read_text().splitlines())
        keep = [i for i in items if i.nodeid in wanted]
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in wanted])
        items[:] = keep
    if tiers.TIER == "all":
        return
    keep, drop = [], []
    for item in items:
        exhaustive = item.get_closest_marker("exhaustive") is not None
        selected = tiers.in_default_tier(item.nodeid, exhaustive=exhaustive) and (
            tiers.TIER != "smoke" or tiers.in_smoke_tier(item.nodeid)
        )
        (keep if selected else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# Under pytest-xdist (scripts/test.sh runs `-n 2 --dist loadgroup`) every test is its own work
# unit, handed to whichever worker is free, except these groups, each run whole on one worker:
#  - the XLA tier: its session fixtures (venvs, the lowering and TPU-compile probes) must run once,
#    not once per worker; it is handed out first, so its pip installs and probes overlap the rest;
#  - modules whose module-scoped fixture is a training run that several tests compare against
#    (split across workers, each worker would pay for it).
# (xdist's own `xdist_group` mark does not work with pytest 9.2: xdist 3.8 renames node ids
# through an attribute pytest no longer reads; so the scheduler below groups by path.)
XDIST_GROUPS = {
    "tests/xla/": "xla",
    "tests/e2e/test_hf_backend.py": "hf_backend",
    "tests/e2e/test_parallel_e2e.py": "parallel_e2e",
    "tests/e2e/test_qwen3_e2e.py": "qwen3_e2e",
    "tests/e2e/test_flux_train.py": "flux_train",
    "tests/e2e/test_engine.py": "engine",
    "tests/e2e/test_contract.py": "contract",
    "tests/e2e/test_readme_commands.py": "readme",  # one clone and one kernel build for all blocks
    "tests/unit/test_tiers.py": "tiers",  # one collection for both tests
}


def xdist_group(nodeid: str) -> str | None:
    """The group of a test (node id relative to the repository root), or None."""
    for prefix, group in XDIST_GROUPS.items():
        if nodeid.startswith(prefix):
            return group
    return None


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # no pytest-xdist: tests run in one process
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class GroupScheduling(LoadScopeScheduling):
        """One work unit per test, or per group of `XDIST_GROUPS`; the XLA group first, then the
        other groups (biggest first), then single tests in collection order."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid) or nodeid

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed:
                if not self._check_nodes_have_same_collection():
                    self.log("**Different tests collected, aborting run**")
                    return
                collection = list(next(iter(self.registered_collections.values())))
                units: dict[str, dict[str, bool]] = {}
                for nodeid in collection:
                    units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
                if len(units) >= len(self.nodes):  # else the base class shuts the spare workers down
                    groups = set(XDIST_GROUPS.values())
                    order = sorted(
                        units, key=lambda s: (0, 0) if s == "xla" else (1, -len(units[s])) if s in groups else (2, 0)
                    )
                    self.collection = collection
                    for scope in order:
                        self.workqueue[scope] = units[scope]
                    for node in self.nodes:
                        self._assign_work_unit(node)
            super().schedule()

    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") in ("load", "loadgroup"):
            return GroupScheduling(config, log)
        return None


def _reset() -> None:
    for op in ops.OPS:
        ops.register(op, None)


@pytest.fixture(autouse=True)
def _reference_ops():
    _reset()
    yield
    _reset()


# Recorded durations (docs/testing.md "Tiers"): with TITAN_RECORD_DURATIONS=FILE the controller
# writes each test's setup + call + teardown seconds to FILE as JSON at the end of the run; the
# tier test (tests/unit/test_tiers.py) holds the default tier's sum under its budget.
_DURATIONS: dict[str, float] = {}


# With TITAN_RECORD_OUTCOMES=FILE the controller also writes each test's outcome (the worst of its
# setup, call and teardown: failed > skipped > xfailed > passed) and seconds, for the scheduled
# tier's record (.ci/scheduled, scripts/dev/scheduled_record.py).
_OUTCOMES: dict[str, dict] = {}
_WORST = ("passed", "xfailed", "skipped", "failed")


def pytest_runtest_logreport(report):
    if os.environ.get("TITAN_RECORD_DURATIONS"):
        _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration
    if os.environ.get("TITAN_RECORD_OUTCOMES"):
        outcome = "xfailed" if report.skipped and hasattr(report, "wasxfail") else report.outcome
        entry = _OUTCOMES.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
        entry["seconds"] += report.duration
        if _WORST.index(outcome) > _WORST.index(entry["outcome"]):
            entry["outcome"] = outcome


@pytest.hookimpl(trylast=True)  # after --durations' table: the machine's line is the log's last but one
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # also under -q, which hides the header: the orders a failure happened in can be redrawn
    seed = os.environ["TITAN_TEST_ORDER_SEED"]
    terminalreporter.write_line(f"device orders of multi-process runs drawn from TITAN_TEST_ORDER_SEED={seed}")
    # the machine's line, last, so a CI log's tail names the CPU its time was measured on (the tier
    # budget is for the slowest CPU of this kind: tests/support/tiers.py, docs/testing.md "Tiers")
    terminalreporter.write_line(_machine_line())


def _machine_line() -> str:
    """'machine: <CPU model> (family F model M), <n> CPUs, ISA <avx512+bf16 | avx512 | avx2 | ...>[, amx]' from lscpu
    and /proc/cpuinfo's flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    first = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    flags = set(first.get("flags", "").split())
    isa = next((name for name, need in _ISAS if need <= flags), "other")
    amx = ", amx" if "amx_tile" in flags else ""
    family = f" (family {first.get('cpu family', '?')} model {first.get('model', '?')})"
    return f"machine: {cpu_model()}{family}, {os.cpu_count()} CPUs, ISA {isa}{amx}"


_ISAS = (
    ("avx512+bf16", {"avx512f", "avx512_bf16"}),
    ("avx512", {"avx512f"}),
    ("avx2", {"avx2"}),
)


def pytest_sessionfinish(session, exitstatus):
    outcomes = os.environ.get("TITAN_RECORD_OUTCOMES")
    if outcomes and not hasattr(session.config, "workerinput"):
        import json

        Path(outcomes).write_text(json.dumps(_OUTCOMES, indent=0, sort_keys=True) + "\n")
    out = os.environ.get("TITAN_RECORD_DURATIONS")
    if out and not hasattr(session.config, "workerinput") and _DURATIONS:
        import json

        with open(out, "w") as f:
            json.dump({k: round(v, 2) for k, v in sorted(_DURATIONS.items())}, f, indent=0)
