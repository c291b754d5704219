"""Probe (xla venv): the layer scan's host offload (trainer.graph.passes.offload_block_inputs_pass)
lowered by torchax with tools/xla_lowering's rules, on the hand-built forward/backward scan pair of
tests/unit/test_scan_offload.py: the copies the XLA tier uses (`host=False`) and the
`jax.device_put` into pinned host memory and back that the TPU program compile uses (`host=True`;
XLA:CPU takes the memory spaces too). Prints {"host": [max abs error per output], "copy": [...],
"scale": [max abs reference per output]} against the graph run by torch before the pass."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.unit.test_scan_offload import _two_layer_step  # noqa: E402
from tools.xla_lowering import add_lowerings, add_offload_lowerings, load_torchax  # noqa: E402
from trainer.graph.passes import offload_block_inputs_pass  # noqa: E402

env = load_torchax().default_env()
add_lowerings(env)
from torchax import interop  # noqa: E402

gen = torch.Generator().manual_seed(0)
args = (torch.randn(3, 8, generator=gen), torch.randn(2, 8, 8, generator=gen) / 3, torch.randn(3, 8, generator=gen))
want = _two_layer_step()(*args)
gm = _two_layer_step()
assert offload_block_inputs_pass(gm) == 1


def run(*tensors):
    with env:
        return gm(*tensors)


out = {"scale": [float(w.abs().max()) for w in want]}
for name, host in (("copy", False), ("host", True)):
    add_offload_lowerings(env, host=host)
    got = jax.jit(interop.jax_view(run))(*[jax.numpy.asarray(a.numpy()) for a in args])
    out[name] = [float(np.abs(np.asarray(g) - w.numpy()).max()) for g, w in zip(got, want)]
print(json.dumps(out))
