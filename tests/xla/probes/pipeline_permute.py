"""Probe (xla venv): graph-mode pipeline parallelism's permute (trainer/graph/pipeline.py
`StagePermute`: an all_to_all_single with one nonzero split over the pp group) under
tools/tpu_compile.py's torchax rules, in a shard_map over 2 (then 4) XLA:CPU devices as the pod
compile lowers a program: the forward (r -> r + 1) and the backward (r -> r - 1) each lower to one
`collective_permute` (no all-to-all) and move the values as the gloo run does. Prints
{"cases": {p: {"permutes": n, "all_to_all": n, "forward": ok, "backward": ok}}}."""

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np  # noqa: E402

from titan_kernels.tpu import capture  # noqa: E402
from tools.xla_lowering import add_lowerings, load_torchax  # noqa: E402

torchax = load_torchax()
import jax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402
from torchax import interop  # noqa: E402

from tools.tpu_compile import _define_program_ops, _lowerings  # noqa: E402
from trainer.graph.pipeline import _shift  # noqa: E402

_define_program_ops()
capture._define()
env = torchax.default_env()
add_lowerings(env)
cases = {}
for p in (2, 4):
    # one group "pp" over every device (the program is rank 0's: its splits name the shift)
    _lowerings(env, axis_names=["a0"], groups={"pp": list(range(p))}, radices=[p], generation="v6e")
    mesh = Mesh(np.asarray(jax.devices()[:p]), ("a0",))
    spec = PartitionSpec("a0")
    x = np.arange(p * 3 * 4, dtype=np.float32).reshape(p, 3, 4)

    def per_device(a, shift):
        def torch_fn(t):
            return _shift(t, shift, ("pp", p, 0))

        with env:
            return interop.call_torch(torch_fn, a[0])[None]

    out = {}
    for name, shift in (("forward", 1), ("backward", -1)):
        fn = jax.jit(jax.shard_map(lambda a, s=shift: per_device(a, s), mesh=mesh, in_specs=spec, out_specs=spec))
        text = fn.lower(x).as_text()
        got = np.asarray(fn(x))
        want = np.roll(x, shift, axis=0)  # rank r holds what rank r - shift sent
        out[name] = bool(np.array_equal(got, want))
        out[f"{name}_permutes"] = text.count("collective_permute")
        out[f"{name}_all_to_all"] = text.count("all_to_all")
    cases[p] = out
print(json.dumps({"cases": cases}))
