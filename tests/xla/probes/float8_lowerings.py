"""Probe (xla venv): tools/xla_lowering's rules for the ops the float8 recipes add to a pod
program (tools/tpu_compile.py lowered none of them before): `aten.ldexp.Tensor` (the grid spacing
of models/common/quantize.round_to_float8) and `aten.view_copy.dtype` (the float8 all-gather's
bitcast to uint8 and back; torchax 0.0.13 reads the dtype as a shape). Each against ATen on the
CPU, bit for bit. Prints {"cases": {name: [equal, shape equal]}}."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from models.common.quantize import round_to_float8  # noqa: E402
from tools.xla_lowering import add_lowerings, load_torchax  # noqa: E402

torch.manual_seed(0)
v = torch.randn(64, 96) * 100
env = load_torchax().default_env()
add_lowerings(env)
bits = v.to(torch.float8_e4m3fn)
cases = {
    "ldexp": (torch.ops.aten.ldexp.Tensor, (v, torch.randint(-20, 20, v.shape))),
    "round_to_float8": (lambda x: round_to_float8(x, torch.float8_e4m3fn), (v,)),
    "float8_as_uint8": (lambda x: torch.ops.aten.view_copy.dtype(x, torch.uint8), (bits,)),
    "uint8_as_float8": (lambda x: torch.ops.aten.view_copy.dtype(x, torch.float8_e4m3fn), (bits.view(torch.uint8),)),
    "bf16_as_uint8": (lambda x: torch.ops.aten.view_copy.dtype(x, torch.uint8), (v.bfloat16(),)),
    "uint8_as_bf16": (lambda x: torch.ops.aten.view_copy.dtype(x, torch.bfloat16), (v.bfloat16().view(torch.uint8),)),
}
out = {}
for name, (fn, args) in cases.items():
    want = fn(*args)
    with env:
        got = fn(*[a.to("jax") for a in args])
        dtype = got.dtype
        got = np.asarray(got.jax())  # torchax cannot move a float8 array to the CPU: compare bytes
    same_shape = tuple(got.shape) == tuple(want.shape) and dtype == want.dtype
    equal = same_shape and got.view(np.uint8).tobytes() == want.contiguous().view(torch.uint8).numpy().tobytes()
    out[name] = [equal, same_shape]
print(json.dumps({"cases": out}))
