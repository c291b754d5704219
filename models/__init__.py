"""Model families by name: `get_model_family("llama3" | "qwen3" | "package.module:NAME") -> ModelFamily`.

Model code imports torch only: no torch.distributed, no config objects, no environment reads. Two
families also load Hugging Face objects, lazily and at their edges: `models/hf` builds a
transformers model from a local config.json, and `models/flux/conditioning.py` loads (or builds)
the text encoders and VAE with transformers/diffusers (docs/models.md).
A family declares what the rest of the product may use of it (`models/contract.py`): its plan
object, args with `shape()` and parameter counts, and a model with `pop_aux_loss()`. A family
defined outside this package is named by its import path, `package.module:NAME` (NAME a
`ModelFamily`), so a new model needs no edit to `trainer/` or `parallelisms/`. Unknown names
and flavors raise `ValueError` listing the allowed values (the trainer turns it into a
ConfigError).
"""

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn

from models import deepseek_v3, deepseek_v4, flux, gpt_oss, hf, llama3, qwen3, qwen3_5
from models.common.plan import ModelPlan
from models.deepseek_v3 import hf_adapter as deepseek_v3_adapter
from models.deepseek_v3.plan import PLAN as DEEPSEEK_V3_PLAN
from models.deepseek_v4 import hf_adapter as deepseek_v4_adapter
from models.deepseek_v4.plan import PLAN as DEEPSEEK_V4_PLAN
from models.flux import hf_adapter as flux_adapter
from models.flux.plan import PLAN as FLUX_PLAN
from models.gpt_oss import hf_adapter as gpt_oss_adapter
from models.gpt_oss.plan import PLAN as GPT_OSS_PLAN
from models.hf import hf_adapter as hf_family_adapter
from models.hf.plan import PLAN as HF_PLAN
from models.hf.plan import plan_for as hf_plan_for
from models.llama3 import hf_adapter as llama3_adapter
from models.llama3.plan import PLAN as LLAMA3_PLAN
from models.qwen3 import hf_adapter as qwen3_adapter
from models.qwen3.plan import PLAN as QWEN3_PLAN
from models.qwen3_5 import hf_adapter as qwen3_5_adapter
from models.qwen3_5.plan import PLAN as QWEN3_5_PLAN


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """Family name used in recipes (`[model] name`)."""
    args_cls: type
    """The args dataclass (`Llama3Args`, `Qwen3Args`)."""
    flavors: dict[str, Any]
    """Flavor name -> args instance; copy with `get_args` before changing anything."""
    model_cls: type[nn.Module]
    """`model_cls(args)`: a `models.contract.LanguageModel`."""
    plan: ModelPlan
    """Where the repeated blocks are and how `parallelisms/` shards the model."""
    hf_adapter: ModuleType | None = None
    """Module with `from_hf`, `to_hf`, `hf_config`, `args_from_hf_config`; None: no HF interop."""
    task: str = "lm"
    """What the model is trained on: "lm" (`model_cls` is a `models.contract.LanguageModel`:
    next-token cross entropy on token windows) or "flow" (a `models.contract.FlowModel`:
    rectified flow on image latents and text embeddings). The trainer picks its data, loss and
    throughput unit by it (`trainer/tasks/`)."""
    plan_for: Callable[[Any], ModelPlan] | None = None
    """For a family whose plan depends on its args (`hf`: TP styles from the config): args -> plan.
    `for_args` applies it; None: `plan` serves every flavor."""
    document_mask: bool = False
    """The model takes packed-document inputs: `forward(tokens, segment_ids, positions)` and the
    same for `hidden` (`models.contract.LanguageModel`); `[training] document_mask` needs it."""

    def for_args(self, args: Any) -> "ModelFamily":
        """This family with the plan of `args` (itself unless `plan_for` is set)."""
        return self if self.plan_for is None else dataclasses.replace(self, plan=self.plan_for(args))

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


FAMILIES: dict[str, ModelFamily] = {
    "llama3": ModelFamily(
        name="llama3",
        args_cls=llama3.Llama3Args,
        flavors=llama3.FLAVORS,
        model_cls=llama3.Transformer,
        plan=LLAMA3_PLAN,
        hf_adapter=llama3_adapter,
        document_mask=True,
    ),
    "qwen3": ModelFamily(
        name="qwen3",
        args_cls=qwen3.Qwen3Args,
        flavors=qwen3.FLAVORS,
        model_cls=qwen3.Transformer,
        plan=QWEN3_PLAN,
        hf_adapter=qwen3_adapter,
        document_mask=True,
    ),
    # Hybrid Gated DeltaNet / gated full attention: takes segment ids and positions; under CP the
    # Gated DeltaNet's ops pass the delta rule's state and the conv's halo between ranks
    # (parallelisms/context_parallel_linear.py).
    "qwen3_5": ModelFamily(
        name="qwen3_5",
        args_cls=qwen3_5.Qwen3_5Args,
        flavors=qwen3_5.FLAVORS,
        model_cls=qwen3_5.Qwen3_5Transformer,
        plan=QWEN3_5_PLAN,
        hf_adapter=qwen3_5_adapter,
        document_mask=True,
    ),
    "deepseek_v3": ModelFamily(
        name="deepseek_v3",
        args_cls=deepseek_v3.DeepSeekV3Args,
        flavors=deepseek_v3.FLAVORS,
        model_cls=deepseek_v3.DeepSeekV3,
        plan=DEEPSEEK_V3_PLAN,
        hf_adapter=deepseek_v3_adapter,
        document_mask=True,
    ),
    # Its own attention (sinks, window + compressed keys), not the op: no document_mask, so no CP
    # either; no TP plan (the model class's tp_refusal); blocks of several kinds: layer scan runs the
    # hash-routed ones unrolled, then the periodic rest (models/common/stack.py `scan_layout`).
    "deepseek_v4": ModelFamily(
        name="deepseek_v4",
        args_cls=deepseek_v4.DeepSeekV4Args,
        flavors=deepseek_v4.FLAVORS,
        model_cls=deepseek_v4.DeepSeekV4,
        plan=DEEPSEEK_V4_PLAN,
        hf_adapter=deepseek_v4_adapter,
    ),
    # Its own attention (sinks, sliding window), not the op: no document_mask, so no CP either.
    "gpt_oss": ModelFamily(
        name="gpt_oss",
        args_cls=gpt_oss.GptOssArgs,
        flavors=gpt_oss.FLAVORS,
        model_cls=gpt_oss.GptOssTransformer,
        plan=GPT_OSS_PLAN,
        hf_adapter=gpt_oss_adapter,
    ),
    "flux": ModelFamily(
        name="flux",
        args_cls=flux.FluxArgs,
        flavors=flux.FLAVORS,
        model_cls=flux.FluxTransformer,
        plan=FLUX_PLAN,
        hf_adapter=flux_adapter,
        task="flow",
    ),
    # Any transformers causal LM from `[model] hf_config` (docs/hf_backend.md).
    "hf": ModelFamily(
        name="hf",
        args_cls=hf.HFArgs,
        flavors=hf.FLAVORS,
        model_cls=hf.HFCausalLM,
        plan=HF_PLAN,
        hf_adapter=hf_family_adapter,
        plan_for=hf_plan_for,
    ),
}

# Hugging Face `model_type` (transformers) or `_class_name` (diffusers) -> our family name
# (used by HF -> DCP conversion).
HF_MODEL_TYPES = {
    "llama": "llama3",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "deepseek_v4": "deepseek_v4",
    "gpt_oss": "gpt_oss",
    "FluxTransformer2DModel": "flux",
}


def get_model_family(name: str) -> ModelFamily:
    """The family registered under `name`, or the `ModelFamily` at import path `module:NAME`;
    ValueError naming `model.name` and the allowed values otherwise."""
    allowed = f"allowed: {', '.join(FAMILIES)}, or package.module:NAME of a ModelFamily"
    if name in FAMILIES:
        return FAMILIES[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"model.name: unknown model {name!r}; {allowed}")
    try:
        family = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model.name: cannot load {name!r} ({type(e).__name__}: {e}); {allowed}") from None
    if not isinstance(family, ModelFamily):
        raise ValueError(f"model.name: {name!r} is a {type(family).__name__}, not a ModelFamily; {allowed}")
    return family
