"""Golden text of the captured graph step: guards against silent changes to what is captured.

The graph of the reduced Llama 3 debug flavor (2 layers, layer scan, backend aot_eager, SDPA
attention so that the text does not depend on the CPU's vector ISA) is
rendered by `normalized_graph_text` (shapes, strides and ops; no source locations or object
addresses) and compared line by line with tests/golden/graph_step_llama3_scan.txt. After an
intended change (a pass, the model, the step, a torch upgrade) regenerate it with

    TITAN_UPDATE_GOLDEN=1 OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_graph_golden.py

and review the diff of the golden file like any other code change.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from tests.test_graph_common import PLAN, batches, build_model, build_opt, run
from trainer.graph import build_graph_step
from trainer.graph.passes import normalized_graph_text

GOLDEN = Path(__file__).parent / "golden" / "graph_step_llama3_scan.txt"


def test_golden_graph_text():
    model = build_model(2, attn_backend="sdpa")
    opt = build_opt(model)
    step = build_graph_step(model=model, optimizer=opt, max_norm=1.0, backend="aot_eager", scan_layers=True,
                            plan=PLAN)
    run(step, opt, batches(1))
    text = normalized_graph_text(step.graph_module)
    if os.environ.get("TITAN_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    expected = GOLDEN.read_text()
    if text != expected:
        diff = "".join(list(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                                 "golden", "captured"))[:80])
        raise AssertionError(f"captured graph differs from {GOLDEN.name} (TITAN_UPDATE_GOLDEN=1 to "
                             f"regenerate after an intended change):\n{diff}")
