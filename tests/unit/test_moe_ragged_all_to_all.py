"""torch-tpu's `ragged_all_to_all` in the static EP dispatch, traced against the real wheel.

The op's CPU kernel needs torch-tpu's TPU process group, so it cannot run here; its Meta kernel
can. This traces `dispatch_combine_static` with `torch.tpu.ops.ragged_all_to_all` as the
transport on a fake 2-rank group and checks the calls: the real signature is used, the receive
buffer is `ep x M` rows and the combine returns `M`, and nothing is read on the host. Runs in a
subprocess of the torch-tpu venv (`scripts/xla_env.sh`; importing torch-tpu changes process
globals), skipped where that venv is missing. The offsets themselves are tested on CPU against
the op's emulation (tests/unit/test_expert_parallel.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TTPU_PYTHON = ROOT / ".venv-ttpu" / "bin" / "python"


def _probe() -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch_tpu  # noqa: F401
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallelisms.expert_parallel import dispatch_combine_static

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    group = (dist.group.WORLD.group_name, 2, 0)
    w = torch.randn(4, 16, 16, dtype=torch.bfloat16)

    def experts(rows, counts):
        return torch._grouped_mm(rows, w, offs=torch.cumsum(counts, 0, dtype=torch.int32))

    def step(x, counts):
        return dispatch_combine_static(x, counts, experts, group, ragged_all_to_all=torch.tpu.ops.ragged_all_to_all)

    x = torch.randn(20, 16, dtype=torch.bfloat16)
    counts = torch.tensor([3, 2, 5, 0, 4, 1, 3, 2])
    graph = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(x, counts)
    nodes = [n for n in graph.graph.nodes if n.op == "call_function"]
    return {
        "ragged_shapes": [list(n.meta["val"].shape) for n in nodes if "ragged_all_to_all" in str(n.target)],
        "host_reads": sum("_local_scalar_dense" in str(n.target) for n in nodes),
    }


def test_static_dispatch_traces_with_torch_tpu_ragged_all_to_all():
    import pytest  # here: the probe half of this file runs in the torch-tpu venv, without pytest

    if not TTPU_PYTHON.exists():
        pytest.skip("no torch-tpu venv (.venv-ttpu; scripts/xla_env.sh)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        JAX_PLATFORMS="cpu",
        PYTHONWARNINGS="ignore:<TorchTpu/Performance/TcMalloc/",
    )
    r = subprocess.run([str(TTPU_PYTHON), __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ragged_shapes"] == [[40, 16], [20, 16]]  # dispatch into ep x M rows, combine to M
    assert got["host_reads"] == 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_probe()))
    sys.stdout.flush()
    os._exit(0)  # skip the fake group's and torch-tpu's teardown
