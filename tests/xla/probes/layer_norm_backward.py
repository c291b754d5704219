"""Probe (xla venv): tools/xla_lowering's rule for `aten.native_layer_norm_backward` (torchax 0.0.13's
takes 5-6 of the op's 8 arguments; FLUX's LayerNorms reach it) against ATen's on the CPU, with and
without an affine weight. Prints {"cases": {name: [max abs error, max abs reference] per output}}."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from tools.xla_lowering import add_lowerings, load_torchax  # noqa: E402

torch.manual_seed(0)
x, g = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
w, b = torch.randn(32), torch.randn(32)
op = torch.ops.aten.native_layer_norm_backward.default
env = load_torchax().default_env()
add_lowerings(env)
cases = {}
for name, (weight, bias, mask) in {
    "affine": (w, b, [True, True, True]),
    "plain": (None, None, [True, False, False]),
}.items():
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [32], weight, bias, 1e-6)
    want = op(g, x, [32], mean, rstd, weight, bias, mask)
    with env:
        moved = [None if t is None else t.to("jax") for t in (g, x, mean, rstd, weight, bias)]
        got = [None if t is None else t.to("cpu") for t in op(*moved[:2], [32], *moved[2:], mask)]
    cases[name] = [None if a is None else [float((a - e).abs().max()), float(e.abs().max())] for a, e in zip(got, want)]
print(json.dumps({"cases": cases}))
