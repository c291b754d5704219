"""Shared test set-up: every test starts with the torch reference behind each model op.

`trainer.train` (run in-process by some tests) registers kernels for the rest of its process
(`kernels.select`); without this reset a later test would silently run on whatever an earlier
test selected, and its result would depend on the CPU's instruction set.
"""

import pytest

from models.common import ops


def _reset() -> None:
    for op in ops.OPS:
        ops.register(op, None)


@pytest.fixture(autouse=True)
def _reference_ops():
    _reset()
    yield
    _reset()
