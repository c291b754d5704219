"""Third-party warnings a user cannot act on are filtered where they arise (trainer/runtime/quiet.py):
torch's DeviceMesh unpickling warning, which the recipe check printed 54 times between its result
lines (a mesh of an earlier job's process group unpickled by a later job), and the autograd
fallback warning of ops captured on the meta device. Each through the real code path, in a fresh
process (a fake process group of its own)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.trainer_runs import ENV, REPO

UNPICKLE_AN_OLD_MESH = """
import logging, pickle, warnings
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from trainer.runtime import quiet
if {quiet}:
    quiet.quiet_capture()
seen = []
handler = logging.Handler()
handler.emit = lambda record: seen.append(record.getMessage())
logging.getLogger(quiet.DEVICE_MESH_LOGGER).addHandler(handler)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
blob = pickle.dumps(init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")))
dist.destroy_process_group()  # the job is over; the next one has its own process group
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
pickle.loads(blob)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if {quiet}:
        quiet.quiet_capture()  # catch_warnings reset the filters: installed again inside
    warnings.warn("aten::broadcast_tensors: an autograd kernel was not registered to the Autograd key(s) but",
                  UserWarning)
    warnings.warn("an unrelated warning", UserWarning)
print(sum(quiet.DEVICE_MESH_PICKLING in m for m in seen), len(caught))
dist.destroy_process_group()
"""


def _run(quiet: bool) -> list[int]:
    proc = subprocess.run(
        [sys.executable, "-c", UNPICKLE_AN_OLD_MESH.format(quiet=quiet)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [int(x) for x in proc.stdout.split()]


def test_device_mesh_unpickling_and_autograd_fallback_warnings_are_filtered():
    assert _run(quiet=False) == [2, 2]  # the mechanism: torch logs one line per mesh dimension
    assert _run(quiet=True) == [0, 1]  # filtered; an unrelated warning still shows


def test_the_recipe_check_and_the_trainer_install_the_filters():
    import logging

    from trainer.runtime import quiet

    for path in ("scripts/check_recipe.py", "scripts/estimate.py", "scripts/estimate_xla.py"):
        assert "quiet_capture()" in (Path(REPO) / path).read_text(), path
    logger = logging.getLogger(quiet.DEVICE_MESH_LOGGER)
    before = list(logger.filters)
    try:
        quiet.quiet_device_mesh_pickling()
        quiet.quiet_device_mesh_pickling()  # idempotent
        assert len(logger.filters) == len(before) + (0 if any(isinstance(f, quiet._DropMessage) for f in before) else 1)
    finally:
        logger.filters[:] = before
    assert "quiet_device_mesh_pickling()" in (Path(REPO) / "trainer" / "job.py").read_text()
