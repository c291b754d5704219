"""Third-party warnings a user cannot act on, filtered where they arise (one filter each, by message).

- torch's DeviceMesh logs "It seems like pickling/unpickling of the DeviceMesh occurred before the
  PGs were created" each time it unpickles a mesh whose process groups no longer exist
  (`DeviceMesh.__setstate__`). A process that builds many jobs one after the other (the recipe
  check: a fake process group per recipe; the planner's search) unpickles earlier jobs' meshes from
  torch.compile's caches: `scripts/check_recipe.py --all` printed 54 of these lines between its
  result lines. The meshes concerned belong to jobs that are over.
- torch's autograd fallback warns "an autograd kernel was not registered to the Autograd key(s)"
  for ops traced on the meta device in a capture-only step (the recipe check, the estimate
  scripts): nothing runs there, so nothing can be silently wrong.

`quiet_device_mesh_pickling()` installs the first filter (the trainer's `build_job`, every job);
`quiet_capture()` both (the tools that only capture). Both are idempotent.
"""

from __future__ import annotations

import logging
import warnings

DEVICE_MESH_LOGGER = "torch.distributed.device_mesh"
DEVICE_MESH_PICKLING = "It seems like pickling/unpickling of the DeviceMesh"
AUTOGRAD_FALLBACK = r"aten::\w+: an autograd kernel was not registered to the Autograd key"


class _DropMessage(logging.Filter):
    """Drops the records whose message starts with `prefix`."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_device_mesh_pickling() -> None:
    """Drop DeviceMesh's unpickling warning (module docstring) from its own logger."""
    logger = logging.getLogger(DEVICE_MESH_LOGGER)
    if not any(isinstance(f, _DropMessage) and f.prefix == DEVICE_MESH_PICKLING for f in logger.filters):
        logger.addFilter(_DropMessage(DEVICE_MESH_PICKLING))


def quiet_capture() -> None:
    """Both filters (module docstring): for processes that capture steps on the meta device only."""
    quiet_device_mesh_pickling()
    warnings.filterwarnings("ignore", message=AUTOGRAD_FALLBACK, category=UserWarning)
