"""Probe (xla venv): the Qwen 3 MoE model lowers through torchax to one XLA program.

    python moe_torchax.py

A reduced qwen3 debugmodel_moe (2 layers, 4 experts, top-2) is extracted with
`torchax.extract_jax`; `jax.jit(jax.value_and_grad(loss))` of it is lowered and compiled for
XLA:CPU. Under `jax.jit` any host read of a device value (`.tolist()` of the expert counts, as
the old eager expert fallback did) fails the trace, so lowering at all proves the routing,
dispatch and grouped matmul are on the device. Loss and gradients are compared with torch eager.
Prints one JSON line: {"loss", "loss_torch", "max_grad_diff", "grad_scale", "num_grads",
"host_callbacks", "random_routing"}.

Random routing (`random_routing`, in the same process): jax runs without 64-bit types, so the
router's int64 `routing_key` buffer, the token indices and every intermediate of the draw's hash
are int32 on XLA, int64 on CPU torch. For each (E, k) of `SHAPES`, a router with
`use_routing("random")` is extracted with `torchax.extract_jax`, `jax.jit`-compiled once for
XLA:CPU and called with the buffer `set_routing_key` wrote for 3 cases (keys in [2^30, 2^31),
first tokens up to 2^31 - N); the selected experts are compared with torch eager's (int64) on the
same buffer.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from models.common.moe import TokenChoiceTopKRouter, routing_key, set_routing_key, use_routing
from models.qwen3 import FLAVORS, Transformer
from tools.xla_lowering import load_torchax  # torchax on torch 2.13 (its import shim)

SHAPES = ((8, 2), (128, 8), (256, 8), (384, 8))  # debug; Qwen3-235B; DeepSeek-V3; Kimi K2
N = 1024  # tokens per call


def random_routing() -> dict:
    """The random-routing check (module docstring): its dict."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    torchax = load_torchax()
    mismatched = rows = cases = callbacks = 0
    distinct_ok = True
    max_key = max_token = 0
    key_dtype = index_dtype = ""
    for e, k in SHAPES:
        torch.manual_seed(0)
        router = TokenChoiceTopKRouter(dim=16, num_experts=e, top_k=k, norm_topk_prob=True)
        use_routing(router, "random")
        x = torch.randn(N, 16)
        states, jfn = torchax.extract_jax(router)
        step = jax.jit(lambda s, t: jfn(s, (t,))[1])
        jx = jnp.asarray(x.numpy())
        lowered = step.lower(states, jx)
        callbacks += lowered.as_text().count("callback")
        compiled = lowered.compile()
        for case in range(3):
            # Seeds searched for keys near 2^31 (the top bit of int32 set would be negative).
            seed = next(s for s in range(case * 10_000, 10**7) if routing_key(seed=s, step=7, layer=0) >= 2**30)
            first = [0, 2**31 - N, 123_456_789][case]
            set_routing_key(router, seed=seed, step=7, first_token=first)
            want = router(x)[1]
            buf = states["routing_key"] = jnp.asarray(router.routing_key.numpy())
            key_dtype = str(buf.dtype)
            got = np.asarray(compiled(states, jx))
            index_dtype = str(got.dtype)
            mismatched += int((got.astype(np.int64) != want.numpy()).any(axis=1).sum())
            rows += N
            cases += 1
            distinct_ok &= all(len(set(r)) == k for r in got.tolist()) and bool(((got >= 0) & (got < e)).all())
            max_key = max(max_key, int(router.routing_key[0]))
            max_token = max(max_token, first + N - 1)
    return {
        "cases": cases,
        "rows": rows,
        "mismatched_rows": mismatched,
        "key_dtype": key_dtype,
        "index_dtype": index_dtype,
        "max_key": max_key,
        "max_token": max_token,
        "host_callbacks": callbacks,
        "distinct_ok": distinct_ok,
    }


def main() -> None:
    args = dataclasses.replace(
        FLAVORS["debugmodel_moe"],
        n_layers=2,
        dim=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=512,
        max_seq_len=32,
        moe_hidden_dim=32,
    )
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    ref = model(tokens).float().logsumexp(-1).mean()
    ref.backward()

    import jax
    import jax.numpy as jnp
    import numpy as np

    torchax = load_torchax()

    weights, jfn = torchax.extract_jax(model)

    def loss(w, t):
        return jax.nn.logsumexp(jfn(w, (t,)).astype(jnp.float32), axis=-1).mean()

    jt = jnp.asarray(tokens.numpy())
    lowered = jax.jit(jax.value_and_grad(loss)).lower(weights, jt)
    value, grads = lowered.compile()(weights, jt)
    torch_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    diffs = [float(np.abs(np.asarray(grads[n]) - g).max()) for n, g in torch_grads.items() if n in grads]
    print(
        json.dumps(
            {
                "loss": float(value),
                "loss_torch": float(ref.detach()),
                "max_grad_diff": max(diffs),
                "grad_scale": max(float(np.abs(g).max()) for g in torch_grads.values()),
                "num_grads": len(diffs),
                "num_params": len(torch_grads),
                "host_callbacks": lowered.as_text().count("callback"),
                "random_routing": random_routing(),
            }
        )
    )


if __name__ == "__main__":
    main()
