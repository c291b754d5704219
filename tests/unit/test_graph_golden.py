"""Golden text of the captured graph step: guards against silent changes to what is captured.

The graph of the reduced Llama 3 debug flavor (2 layers, layer scan, backend aot_eager, SDPA
attention so that the text does not depend on the CPU's vector ISA) is
rendered by `normalized_graph_text` (shapes, strides and ops; no source locations or object
addresses) and compared line by line with tests/support/golden/graph_step_llama3_scan.txt. After an
intended change (a pass, the model, the step, a torch upgrade) regenerate it with

    TITAN_UPDATE_GOLDEN=1 OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/unit/test_graph_golden.py

and review the diff of the golden file like any other code change.

The text is exact for one torch release: its first line records the torch version it was
captured with, and under any other version (pyproject allows a range) the test skips and says
which version to regenerate it with, instead of failing on decomposition changes of torch.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
import torch

from tests.support.graph_common import PLAN, batches, build_model, build_opt, run
from trainer.graph import build_graph_step
from trainer.graph.passes import normalized_graph_text

GOLDEN = Path(__file__).parents[1] / "support" / "golden" / "graph_step_llama3_scan.txt"


def _torch_release() -> str:
    return torch.__version__.split("+")[0]


def test_golden_graph_text():
    header = f"# torch {_torch_release()}\n"
    if os.environ.get("TITAN_UPDATE_GOLDEN") != "1":
        recorded = GOLDEN.read_text().splitlines(True)[0]
        if recorded != header:
            pytest.skip(
                f"{GOLDEN.name} was captured with {recorded.strip()[2:]}; this is torch "
                f"{_torch_release()}: regenerate it (TITAN_UPDATE_GOLDEN=1) to guard this version"
            )
    model = build_model(2)  # SDPA attention (tests/conftest.py), whatever the CPU
    opt = build_opt(model)
    step = build_graph_step(model=model, optimizer=opt, max_norm=1.0, backend="aot_eager", scan_layers=True, plan=PLAN)
    run(step, opt, batches(1))
    text = header + normalized_graph_text(step.graph_module)
    if os.environ.get("TITAN_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    expected = GOLDEN.read_text()
    if text != expected:
        diff = "".join(
            list(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "golden", "captured"))[:80]
        )
        raise AssertionError(
            f"captured graph differs from {GOLDEN.name} (TITAN_UPDATE_GOLDEN=1 to "
            f"regenerate after an intended change):\n{diff}"
        )
