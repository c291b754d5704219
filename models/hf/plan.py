"""The `hf` family's `ModelPlan`, with tensor-parallel styles translated from the config's own
`base_model_tp_plan` (the plan `transformers` declares for its `tp_plan="auto"`).

Translation (HF style -> ours, docs/hf_backend.md):
- `colwise` -> `colwise`, `rowwise` -> `rowwise`: the HF projections, inside each block;
- `replicated_with_grad_allreduce` -> `head_norm` (per-head q/k norms: Qwen 3, Gemma 3);
- `embedding_rowwise` -> `embedding`.
Added around them, as our sequence-parallel layout needs: every module that holds a `colwise`
projection gets `block_input` (it all-gathers the sequence-sharded residual stream); every other
module with parameters in a block (the norms) gets `sequence_parallel`; the input embedding
`embedding`, the final norm `sequence_parallel`, the LM head `output`.
Any other HF style (`colwise_gather_output`, `rowwise_split_input`, `packed_colwise`,
`moe_tp_experts`, ...) has no equivalent here, so tensor parallelism is refused for that
architecture with an `error:` line naming it and the style, as it is for a config without a plan.
"""

from __future__ import annotations

import functools

import torch

from models.common.plan import ModelPlan
from models.hf.args import HFArgs, _config_key

_DIRECT = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "head_norm"}
_TOP = {"embedding_rowwise": "embedding"}

PLAN = ModelPlan(block="layers")
"""The plan before a config is known (no tensor parallelism): blocks only."""


def plan_for(args: HFArgs) -> ModelPlan:
    """The plan of the model `args` describes (TP styles empty where TP is refused)."""
    return _plan(_config_key(args.config()))


def tp_refusal(args: HFArgs) -> str | None:
    """Why tensor parallelism cannot apply to this architecture, or None."""
    return _translate(_config_key(args.config()))[1]


@functools.lru_cache(maxsize=16)
def _plan(config_json: str) -> ModelPlan:
    styles, refusal = _translate(config_json)
    if refusal is not None:
        return PLAN
    tp, tp_block = styles
    return ModelPlan(block="layers", tp=tp, tp_block=tp_block)


@functools.lru_cache(maxsize=16)
def _translate(config_json: str):
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config_json)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    arch = (config.architectures or [type(config).__name__])[0]
    hf_plan = getattr(config.get_text_config(), "base_model_tp_plan", None)
    from models.hf.model import _non_uniform_reason

    reason = _non_uniform_reason(config)
    if reason is not None:  # HFCausalLM passes one whole-sequence mask under TP
        return None, f"{arch}: {reason}, and the TP path builds one attention mask for all layers"
    if not hf_plan:
        return None, f"{arch} declares no base_model_tp_plan in its transformers config"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base, prefix = model.base_model, model.base_model_prefix
    block = base.layers[0]
    tp: dict[str, str] = {}
    tp_block: dict[str, str] = {}
    for path, style in hf_plan.items():
        if path.startswith("layers.*."):
            if style not in _DIRECT:
                return (
                    None,
                    f"{arch}'s base_model_tp_plan uses style {style!r} for {path}, which has no equivalent here",
                )
            tp_block[path[len("layers.*.") :]] = _DIRECT[style]
        elif style in _TOP:
            tp[f"{prefix}.{path}"] = _TOP[style]
        else:
            return None, f"{arch}'s base_model_tp_plan uses style {style!r} for {path}, which has no equivalent here"
    # Modules holding colwise projections gather the sequence-sharded stream first.
    for path, style in list(tp_block.items()):
        if style == "colwise" and "." in path:
            tp_block.setdefault(path.rsplit(".", 1)[0], "block_input")
    # The other modules with parameters in a block act on the sequence-sharded stream (norms).
    for name, module in block.named_modules():
        if name and list(module.parameters(recurse=False)) and name not in tp_block:
            if any(name.startswith(p + ".") for p in tp_block):
                return None, f"{arch}: block module {name} sits inside a sharded module but has no style"
            tp_block[name] = "sequence_parallel"
    embed = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    tp.setdefault(embed, "embedding")
    head = model.get_output_embeddings()
    if head is None:
        return None, f"{arch} has no output projection module"
    for name, module in base.named_children():
        if name != "layers" and list(module.parameters(recurse=False)) and f"{prefix}.{name}" not in tp:
            tp[f"{prefix}.{name}"] = "sequence_parallel"  # the final norm
    tp[next(n for n, m in model.named_modules() if m is head)] = "output"
    return (tp, tp_block), None
