"""`HFCausalLM`: a `transformers` causal LM built from its config, under our model contract.

The Hugging Face model is built with `AutoModelForCausalLM.from_config` (on the meta device when
the trainer builds it) and its top-level children are registered on this module under their own
names, so parameter names are exactly the Hugging Face ones (`model.layers.3.self_attn.q_proj.weight`,
`lm_head.weight`): weights load and save as HF safetensors with no renaming. The forward is the HF
model's own forward; only two things change:

- The base model's decoder `layers` (an `nn.ModuleList`) become an `HFBlockStack` (a `BlockStack`,
  keyed "0".."n-1" as before), which activation checkpointing, per-block compile and layer scan act
  on. When every layer receives the same arguments (no per-layer attention type, e.g. Gemma 3's
  sliding / global alternation), the HF loop `for layer in self.layers[:n]` sees a single callable
  that runs the whole stack with positional tensors `(h, attention_mask, position_ids, cos, sin)`:
  that is the fixed block signature a scan needs. Otherwise the HF loop calls each layer itself
  (everything but scan still applies).
- Modules whose forward Hugging Face's `kernels` package wraps for hub-kernel routing (transformers
  >= 5.25) get their plain forward back (`_bypass_hub_kernel_routing`): the wrapper writes a global
  on each call under compile, which layer scan cannot capture; we never kernelize.
- `init_weights` re-runs the HF model's own `_init_weights` on every module of the materialized
  (possibly sharded) model, which also recomputes the rotary `inv_freq` buffers that `to_empty`
  leaves uninitialised (they are non-persistent).

The loss is the trainer's (from the logits); MoE models return HF's router load-balancing loss
(`output_router_logits`) from `pop_aux_loss()`.
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.stack import BlockStack
from models.errors import ConfigError
from models.hf.args import HFArgs


class HFCausalLM(nn.Module):
    """`forward(tokens) -> logits` of the `transformers` model that `args.hf_config` describes."""

    def __init__(self, args: HFArgs):
        super().__init__()
        from transformers import AutoModelForCausalLM

        config = args.config()
        self.args = args
        self.architecture = args.architecture
        try:
            hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        except ValueError as e:
            raise ConfigError(
                f"model.hf_config: transformers cannot build a causal LM for {self.architecture} "
                f"({e}); allowed: configs of decoder-only causal LMs"
            ) from None
        if list(hf.named_parameters(recurse=False)) or list(hf.named_buffers(recurse=False)):
            raise ConfigError(
                f"model.hf_config: {self.architecture} keeps tensors on its root module; "
                "allowed: models whose weights all live in submodules"
            )
        _bypass_hub_kernel_routing(hf)
        base = hf.base_model
        if not isinstance(getattr(base, "layers", None), nn.ModuleList):
            raise ConfigError(
                f"model.hf_config: {self.architecture} has no `layers` list of decoder blocks "
                "in its base model; allowed: decoder-only causal LMs with `base_model.layers`"
            )
        base.layers = HFBlockStack(list(base.layers), non_uniform_reason=_non_uniform_reason(config))
        for name, child in hf.named_children():
            self.add_module(name, child)
        self.__dict__["_hf"] = hf  # not registered: its children are ours, names unchanged
        self._base_prefix = hf.base_model_prefix
        self._aux_loss: torch.Tensor | None = None
        self._router_logits: list[torch.Tensor] = []
        self._aux_fn = _router_aux(hf, self._router_logits) if args.shape().is_moe else None
        if self._aux_fn is not None:
            base.layers.scan_refusal = (
                "the MoE layers hand their router logits out through forward hooks, "
                "a side effect a scan body cannot have"
            )
        # Tied parameters (e.g. lm_head.weight is model.embed_tokens.weight): (alias, owner) names.
        # `to_empty` from meta gives each name its own tensor, so init_weights ties them again.
        first: dict[int, str] = {}
        self._ties: list[tuple[str, str]] = []
        for name, p in self.named_parameters(remove_duplicate=False):
            if id(p) in first:
                self._ties.append((name, first[id(p)]))
            else:
                first[id(p)] = name

    @property
    def layers(self) -> "HFBlockStack":
        """The decoder blocks (`<base model>.layers`); the plan's block container."""
        return getattr(self, self._base_prefix).layers

    @property
    def hf_model(self) -> nn.Module:
        """The `transformers` model object (shares every module with this one)."""
        return self._hf

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # HF's own router-logit recording (a ContextVar and a lock) does not trace; ours is a hook.
        kwargs = {"output_router_logits": False} if self._aux_fn is not None else {}
        if self._sequence_sharded():
            kwargs.update(self._full_sequence_inputs(tokens))
        self._router_logits.clear()
        out = self._hf(input_ids=tokens, use_cache=False, **kwargs)
        if self._aux_fn is not None:
            self._aux_loss = self._aux_fn()
        return out.logits

    def _sequence_sharded(self) -> bool:
        """True under tensor parallelism: the embedding's output is then sequence-sharded, so HF's
        base model would derive position ids and the mask from a local length. (Duck-typed: a
        DTensor weight on a mesh with a `tp` axis; models/ does not import torch.distributed.)"""
        weight = self._hf.get_input_embeddings()._parameters["weight"]
        mesh = getattr(weight, "device_mesh", None)
        return "tp" in (getattr(mesh, "mesh_dim_names", None) or ())

    def _full_sequence_inputs(self, tokens: torch.Tensor) -> dict:
        """Position ids and the attention mask of the whole sequence, built by HF's own mask
        function (None where SDPA's is_causal suffices), for the sequence-sharded (TP) case.
        TP is refused for architectures whose layers need different masks (models/hf/plan.py)."""
        from transformers import masking_utils

        config = self._hf.config
        batch, seqlen = tokens.shape
        position_ids = torch.arange(seqlen, device=tokens.device).unsqueeze(0).expand(batch, -1)
        dummy = torch.empty((batch, seqlen, 0), device=tokens.device)
        text = config.get_text_config()
        types = getattr(text, "layer_types", None)  # uniform here
        sliding = types[0] == "sliding_attention" if types else getattr(text, "sliding_window", None) is not None
        make = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
        mask = make(config=text, inputs_embeds=dummy, attention_mask=None, cache=None, position_ids=position_ids)
        return {"position_ids": position_ids, "attention_mask": mask}

    def train(self, mode: bool = True) -> "HFCausalLM":
        super().train(mode)
        self._hf.training = mode
        return self

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """The `transformers` model's own initialisation (`PreTrainedModel._init_weights` of its
        class: e.g. Linear and Embedding normal(0, initializer_range), norms ones (Gemma: zeros),
        biases zeros, the padding row zero), run in place on every module; rotary `inv_freq`
        buffers are recomputed from the config there too. `buffer_device` is unused: buffers
        are filled where `to_empty` put them."""
        del buffer_device
        for alias, owner in self._ties:
            module_name, _, attr = alias.rpartition(".")
            setattr(self.get_submodule(module_name), attr, self.get_parameter(owner))
        for module in self.modules():
            module.__dict__.pop("_is_hf_initialized", None)
            for t in [*module._parameters.values(), *module._buffers.values()]:
                if t is not None and hasattr(t, "_is_hf_initialized"):
                    del t._is_hf_initialized
        self._hf.__dict__.pop("_is_hf_initialized", None)
        self._hf.initialize_weights()

    def pop_aux_loss(self) -> torch.Tensor | None:
        aux, self._aux_loss = self._aux_loss, None
        return aux


def _router_aux(hf: nn.Module, sink: list):
    """For a MoE model: hooks that collect each router's logits into `sink`, and a function that
    turns them into the model's own load-balancing loss (`load_balancing_loss_func` of its
    modeling module, as its CausalLM forward computes it with `output_router_logits`)."""
    import sys

    base = hf.base_model
    spec = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    loss_fn = getattr(sys.modules[type(hf).__module__], "load_balancing_loss_func", None)
    text = hf.config.get_text_config()
    num_experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if spec is None or loss_fn is None or getattr(spec, "target_class", None) is None:
        raise ConfigError(
            f"model.hf_config: {type(hf).__name__} is a MoE model without a router output "
            "spec or load_balancing_loss_func; allowed: MoE models that declare both"
        )
    index = spec.index

    def record(module, args, output):
        sink.append(output[index] if isinstance(output, tuple) else output)

    for module in hf.modules():
        if isinstance(module, spec.target_class):
            module.register_forward_hook(record)

    def aux() -> torch.Tensor:
        logits = tuple(sink)
        sink.clear()
        return loss_fn(logits, num_experts, text.num_experts_per_tok, None)

    return aux


def _bypass_hub_kernel_routing(hf: nn.Module) -> None:
    """Give each module that Hugging Face's `kernels` package routes (`use_kernelized_func`, applied
    by transformers >= 5.25 when `kernels` is installed) its undecorated forward back.

    The decorated forward sets a context variable around every call (which hub kernel serves this
    model's `apply_rotary_pos_emb` and the like); under `torch.compile` that is a write to a Python
    global, a side effect a scan body or a checkpointed region cannot replay (layer scan failed with
    UncapturedHigherOrderOpError). We never `kernelize`, so with nothing set the functions run their
    plain torch code either way: the bypass changes no numerics."""
    import types

    for module in hf.modules():
        forward = getattr(type(module).forward, "__wrapped__", None)
        if "_kernel_funcs" in vars(module) and forward is not None:
            module.forward = types.MethodType(forward, module)


def _non_uniform_reason(config) -> str | None:
    """None if every decoder layer gets the same arguments, else why not."""
    types = getattr(config.get_text_config(), "layer_types", None)
    if types is not None and len(set(types)) > 1:
        return f"its layers alternate attention types ({', '.join(sorted(set(types)))})"
    return None


class HFBlockStack(BlockStack):
    """The HF decoder layers as a `BlockStack`, that the HF base model still loops over.

    Indexing by slice and iteration are what HF's loop uses: with uniform layers they return one
    `_WholeStack` callable (the stack runs as one `BlockStack.forward` over positional tensors, so
    layer scan can replace the loop); otherwise the layers themselves.
    """

    def __init__(self, layers: list[nn.Module], *, non_uniform_reason: str | None):
        if non_uniform_reason is None:
            for layer in layers:
                layer.__class__ = _positional_class(type(layer))
        super().__init__(layers)
        self.non_uniform_reason = non_uniform_reason
        self.scan_refusal: str | None = None
        """Why these layers cannot run as a scan although uniform (set by the model), or None."""

    def __getitem__(self, key):
        if isinstance(key, slice):
            layers = list(self.values())
            if self.non_uniform_reason is None and layers[key] == layers:
                return [_WholeStack(self)]
            return layers[key]
        return super().__getitem__(str(key) if isinstance(key, int) else key)

    def __iter__(self):
        return iter(self[:])

    def enable_scan(self, **kwargs) -> None:
        if self.scan_refusal is not None:
            raise ConfigError(f"compile.scan_layers: {self.scan_refusal}; allowed: false for this model")
        if self.non_uniform_reason is not None:
            raise ConfigError(
                f"compile.scan_layers: the decoder layers are not uniform: "
                f"{self.non_uniform_reason}; allowed: false for this model"
            )
        first = self["0"]
        names = [n for n, _ in first.named_parameters()]
        for key, block in self.items():
            if type(block) is not type(first) or [n for n, _ in block.named_parameters()] != names:
                raise ConfigError(
                    f"compile.scan_layers: decoder layer {key} differs from layer 0 "
                    f"({type(block).__name__}); allowed: false for this model"
                )
        super().enable_scan(**kwargs)


_PACKED = ("attention_mask", "position_ids", "position_embeddings")
_UNUSED = (
    "cache",
    "past_key_values",
    "layer_past",
    "use_cache",
    "cache_position",
    "output_attentions",
    "output_hidden_states",
    "output_router_logits",
)  # flags read by HF output recording, not by layers


class _WholeStack:
    """Stands for all layers in HF's loop; packs the layer kwargs into positional tensors."""

    def __init__(self, stack: HFBlockStack):
        self.stack = stack

    def __getattr__(self, name: str):
        return getattr(self.stack["0"], name)  # e.g. `attention_type`, read by some HF loops

    def __call__(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        for name, value in kwargs.items():
            if value is not None and value is not False and name not in _UNUSED:
                raise NotImplementedError(f"hf backend: decoder layer argument {name!r} is not supported")
        empty = hidden_states.new_empty(0)
        cos, sin = position_embeddings if position_embeddings is not None else (empty, empty)
        mask = attention_mask if attention_mask is not None else empty
        pos = position_ids if position_ids is not None else empty.long()
        return self.stack(hidden_states, mask, pos, cos, sin)


_CLASS_CACHE: dict[type, type] = {}


def _positional_class(base: type) -> type:
    """A subclass of an HF decoder layer whose forward takes `(h, mask, position_ids, cos, sin)`,
    with an empty tensor standing for None, so every block has one fixed positional signature."""
    if base not in _CLASS_CACHE:

        def forward(self, hidden_states, attention_mask, position_ids, cos, sin):
            out = base.forward(
                self,
                hidden_states,
                attention_mask=attention_mask if attention_mask.numel() else None,
                position_ids=position_ids if position_ids.numel() else None,
                position_embeddings=(cos, sin) if cos.numel() else None,
            )
            return out[0] if isinstance(out, tuple) else out

        _CLASS_CACHE[base] = type(base.__name__, (base,), {"forward": forward, "_hf_positional_base": base})
    return _CLASS_CACHE[base]
