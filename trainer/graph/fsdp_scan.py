"""SimpleFSDP inside the layer scan: gather each layer's parameter shards in the scan body.

Placeholder until implemented: the single-process case needs nothing here (SimpleFSDP's
properties only cast to the compute dtype, which works inside the scan body).
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from trainer.errors import ConfigError


def scan_param_fn(stack):
    params = [p for block in stack.values() for p in block.parameters()]
    if any(isinstance(p, DTensor) for p in params):
        raise ConfigError("compile.scan_layers: data/tensor-parallel parameters are not supported with "
                          "layer scan yet; allowed: false")
    return None
