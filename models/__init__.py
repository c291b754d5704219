"""Model families by name: `get_model_family("llama3" | "qwen3") -> ModelFamily`.

`models/` imports only torch: no torch.distributed, no config objects, no environment reads.
Unknown names and flavors raise `ValueError` listing the allowed values (the trainer turns it
into a ConfigError). Parallel plans are loaded lazily by the parallelism code from
`ModelFamily.plan_module_name` (`models.<family>.plan`).
"""

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn

from models import llama3, qwen3
from models.llama3 import hf as llama3_hf
from models.qwen3 import hf as qwen3_hf


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """Family name used in recipes (`[model] name`)."""
    args_cls: type
    """The args dataclass (`Llama3Args`, `Qwen3Args`)."""
    flavors: dict[str, Any]
    """Flavor name -> args instance; copy with `get_args` before changing anything."""
    model_cls: type[nn.Module]
    """`Transformer(args)`: `forward(tokens) -> logits`, `init_weights(buffer_device=None)`."""
    hf_adapter: ModuleType
    """Module with `from_hf`, `to_hf`, `hf_config`, `args_from_hf_config`."""
    plan_module_name: str
    """Import path of the family's parallel plan (owned by the parallelism code)."""

    def get_args(self, flavor: str, **overrides: Any) -> Any:
        """A fresh copy of `flavors[flavor]` with `overrides` applied (ValueError on unknown names).

        For Python callers that pass typed values: the values are used as given. Values typed
        by a user (recipes, `--model.FIELD=VALUE` of the trainer and the scripts) are checked by
        the project's one type check, `trainer.config.model_args`, instead.
        """
        if flavor not in self.flavors:
            raise ValueError(f"model.flavor: unknown flavor {flavor!r} for {self.name}; allowed: {list(self.flavors)}")
        fields = {f.name for f in dataclasses.fields(self.args_cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"model.{unknown[0]}: not a field of {self.args_cls.__name__}; allowed: {sorted(fields)}")
        return dataclasses.replace(self.flavors[flavor], **overrides)


_FAMILIES = {
    "llama3": ModelFamily(
        name="llama3",
        args_cls=llama3.Llama3Args,
        flavors=llama3.FLAVORS,
        model_cls=llama3.Transformer,
        hf_adapter=llama3_hf,
        plan_module_name="models.llama3.plan",
    ),
    "qwen3": ModelFamily(
        name="qwen3",
        args_cls=qwen3.Qwen3Args,
        flavors=qwen3.FLAVORS,
        model_cls=qwen3.Transformer,
        hf_adapter=qwen3_hf,
        plan_module_name="models.qwen3.plan",
    ),
}

# Hugging Face `model_type` -> our family name (used by HF -> DCP conversion).
HF_MODEL_TYPES = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3"}


def model_names() -> list[str]:
    return list(_FAMILIES)


def get_model_family(name: str) -> ModelFamily:
    """The `ModelFamily` registered under `name`; ValueError listing the allowed names otherwise."""
    if name not in _FAMILIES:
        raise ValueError(f"model.name: unknown model {name!r}; allowed: {list(_FAMILIES)}")
    return _FAMILIES[name]
