"""The `hf` family: any `transformers` causal LM, built from a local config.json.

`[model] name = "hf"` with `hf_config = "path/to/dir_or_config.json"` (docs/hf_backend.md).
The plan's tensor-parallel styles are translated from the config's own `base_model_tp_plan`
(`models/hf/plan.py`), so the family is specialised per config by `family_for(args)`.
"""

from models.hf.args import HFArgs
from models.hf.model import HFCausalLM

__all__ = ["HFArgs", "HFCausalLM", "FLAVORS"]

FLAVORS = {"config": HFArgs()}
"""One flavor: the sizes come from `hf_config`."""
