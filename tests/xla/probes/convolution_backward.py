"""Probe (xla venv): tools/xla_lowering's rule for `aten.convolution_backward` (torchax 0.0.13 has
none; Qwen 3.5's depthwise causal conv1d reaches it) against ATen's on the CPU: the depthwise conv1d
of a Gated DeltaNet block (groups = channels, kernel 4, padding 3) and a plain grouped conv2d with a
stride and a dilation. Prints {"cases": {name: [max abs error, max abs reference] per output}}."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from tools.xla_lowering import add_lowerings, load_torchax  # noqa: E402

torch.manual_seed(0)
op = torch.ops.aten.convolution_backward.default
env = load_torchax().default_env()
add_lowerings(env)
cases = {}
for name, (x, w, stride, padding, dilation, groups) in {
    "depthwise_conv1d": (torch.randn(2, 16, 40), torch.randn(16, 1, 4), [1], [3], [1], 16),
    "grouped_conv2d": (torch.randn(2, 8, 11, 9), torch.randn(6, 4, 3, 3), [2, 1], [1, 2], [1, 2], 2),
}.items():
    out = torch.nn.functional.conv2d if x.ndim == 4 else torch.nn.functional.conv1d
    g = torch.randn_like(out(x, w, None, stride, padding, dilation, groups))
    args = ([w.shape[0]], stride, padding, dilation, False, [0] * len(stride), groups, [True, True, True])
    want = op(g, x, w, *args)
    with env:
        got = [t.to("cpu") for t in op(g.to("jax"), x.to("jax"), w.to("jax"), *args)]
    cases[name] = [[float((a - e).abs().max()), float(e.abs().max())] for a, e in zip(got, want)]
print(json.dumps({"cases": cases}))
