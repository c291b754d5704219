"""Probe (xla venv): the Qwen 3 MoE model lowers through torchax to one XLA program.

    python moe_torchax.py

A reduced qwen3 debugmodel_moe (2 layers, 4 experts, top-2) is extracted with
`torchax.extract_jax`; `jax.jit(jax.value_and_grad(loss))` of it is lowered and compiled for
XLA:CPU. Under `jax.jit` any host read of a device value (`.tolist()` of the expert counts, as
the old eager expert fallback did) fails the trace, so lowering at all proves the routing,
dispatch and grouped matmul are on the device. Loss and gradients are compared with torch eager.
Prints one JSON line: {"loss", "loss_torch", "max_grad_diff", "grad_scale", "num_grads",
"host_callbacks"}.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from models.qwen3 import FLAVORS, Transformer
from tools.xla_lowering import load_torchax  # torchax on torch 2.13 (its import shim)


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
            }
        )
    )


if __name__ == "__main__":
    main()
