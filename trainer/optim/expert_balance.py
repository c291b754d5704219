"""Expert load after each step, and auxiliary-loss-free balancing (DeepSeek-V3, section 2.1.2).

Every MoE layer returns its expert load (token copies routed to each expert) as an output of its
forward, and the `BlockStack`s stack them (models/common/moe.py, models/common/stack.py), so the
load leaves an eager forward, a compiled step and a layer scan alike. `ExpertBalance` collects
it:

- `pop(model-forward)`: inside the step, after each micro-batch's forward, one flat float32
  tensor with every MoE layer's load (the step sums it over its micro-batches; in graph mode it
  is an output of the captured graph);
- `finish(load, apply)`: after the optimizer update, one all-reduce (SUM, the world group) of
  that flat tensor gives the global batch's load per layer, whatever the mesh: every rank counts
  the tokens it routed itself (data-parallel and context-parallel ranks hold different tokens;
  under TP the MoE runs on each rank's sequence shard; under EP tokens are counted before
  dispatch). Then every router with a selection bias (`moe.router.expert_bias`: deepseek_v3
  always, Qwen 3 MoE with `moe_expert_bias`) takes its step
  `bias += rate * sign(mean - load)` (`TokenChoiceTopKRouter.update_expert_bias`), with rate
  `training.expert_bias_rate` times `apply` (0 when the step's update was skipped for a
  non-finite gradient norm: the bias then keeps its value too). Identical global loads on every
  rank give identical biases, so the replicated buffer needs no broadcast.

Under the capacity dispatch (`[moe] capacity_factor`) each layer's load ends with the copies it
dropped; `finish` sums them over layers and ranks (`moe_dropped`, and `moe_dropped_pct` of the
routed copies) and takes the balance step on the routed loads alone.

It also returns the step's balance metric, `max_vio`: DeepSeek's MaxVio, (max load - mean load)
/ mean load of each layer over the global batch, averaged over the layers (0 = perfectly
balanced; logged as `moe_max_vio`). The bias lives in the model's state dict, so checkpoints
hold it and a resumed run continues its trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from models.common import distributed
from models.common.moe import MoE
from models.common.stack import BlockStack


@dataclass
class BalanceStats:
    """One step's expert statistics over the global batch (0-dim float32 tensors, every rank equal)."""

    max_vio: torch.Tensor
    """DeepSeek's MaxVio averaged over the MoE layers (logged as `moe_max_vio`)."""
    dropped: torch.Tensor | None = None
    """Capacity dispatch: token copies over capacity, summed over layers (`moe_dropped`); None: dropless."""
    dropped_pct: torch.Tensor | None = None
    """`dropped` in % of the routed copies (`moe_dropped_pct`)."""


class ExpertBalance:
    """The MoE layers of one model, in the order their loads are popped."""

    def __init__(self, model: nn.Module, *, rate: float):
        self.rate = float(rate)
        self.stacks: list[BlockStack] = []
        self.layers: list[MoE] = []
        for module in model.modules():
            if isinstance(module, BlockStack):
                moes = [m for m in module.modules() if isinstance(m, MoE)]
                if moes:
                    self.stacks.append(module)
                    self.layers.extend(moes)
        experts = {m.router.num_experts for m in self.layers}
        assert len(experts) <= 1, f"MoE layers with different expert counts {sorted(experts)}"
        self.num_experts = experts.pop() if experts else 0
        capacity = {m.capacity_factor > 0 for m in self.layers}
        assert len(capacity) <= 1, "MoE layers with and without a capacity"
        self.capacity = capacity.pop() if capacity else False
        """The layers drop copies over a capacity: each load row ends with the dropped count."""
        self.biased = [(i, m.router) for i, m in enumerate(self.layers) if m.router.expert_bias is not None]
        """(layer index, router) of the routers with a selection bias."""

    def __bool__(self) -> bool:
        return bool(self.layers)

    def pop(self) -> torch.Tensor:
        """The last forward's loads, flat `[sum of layers x experts]` float32 (clears them)."""
        loads = [stack.pop_expert_load() for stack in self.stacks]
        missing = [i for i, load in enumerate(loads) if load is None]
        assert not missing, "the expert loads are available once after each forward"
        return torch.cat([load.reshape(-1) for load in loads])

    @torch.no_grad()
    def finish(
        self, load: torch.Tensor, apply: torch.Tensor | None = None, *, group=None, pp_group=None
    ) -> BalanceStats:
        """Sum the step's `load` (from `pop`, summed over micro-batches) over all ranks, move the
        selection biases (module docstring), and return the step's statistics (every rank equal).

        Pipeline parallelism (trainer/step/pipeline.py): a pp rank holds some of the layers, so
        `load` is theirs (in this model's layer order) and is summed over `group`, the ranks of its
        stage (the same layers, other tokens) instead of the world; the statistics then combine
        the pp ranks' layers over `pp_group` (MaxVio's mean over every layer, the dropped copies'
        sum), so they are the one-process figures."""
        load = load.detach().float().clone()
        if distributed.multi_rank():
            dist.all_reduce(load, group=group)
        per_layer = load.view(len(self.layers), self.num_experts + int(self.capacity))
        dropped = None
        if self.capacity:  # the capacity dispatch's last entry: the copies each layer dropped
            per_layer, dropped = per_layer[:, :-1], per_layer[:, -1].sum()
        if self.rate != 0:
            rate = self.rate if apply is None else apply.to(torch.float32) * self.rate
            for i, router in self.biased:
                router.update_expert_bias(per_layer[i], rate)
        # MaxVio of every layer at once (a handful of ops whatever the depth), then their mean.
        mean = per_layer.mean(dim=1)
        vios = (per_layer.amax(dim=1) - mean) / mean.clamp(min=1.0)
        routed = per_layer.sum()
        if pp_group is not None:  # (sum of MaxVio, layers, dropped, routed) over the pp ranks' layers
            parts = torch.stack(
                [
                    vios.sum(),
                    vios.new_tensor(float(len(self.layers))),
                    routed.new_zeros(()) if dropped is None else dropped,
                    routed,
                ]
            )
            return _over_pp(parts, pp_group, capacity=dropped is not None)
        vio = vios.mean()
        if dropped is None:
            return BalanceStats(max_vio=vio)
        return BalanceStats(max_vio=vio, dropped=dropped, dropped_pct=100 * dropped / routed.clamp(min=1.0))

    @torch.no_grad()
    def join_without_layers(self, pp_group, device: torch.device, capacity: bool) -> BalanceStats:
        """On a pp rank without MoE layers (this balance empty): `finish`'s pp-axis reduction with
        a zero contribution, -> the statistics the ranks with layers return (`capacity`: their
        layers drop copies)."""
        return _over_pp(torch.zeros(4, dtype=torch.float32, device=device), pp_group, capacity=capacity)


def _over_pp(parts: torch.Tensor, pp_group, *, capacity: bool) -> BalanceStats:
    """A pp rank's (sum of MaxVio, layers, dropped, routed) summed over the pp ranks -> the step's
    statistics: MaxVio's mean over every layer, the dropped copies' sum."""
    dist.all_reduce(parts, group=pp_group)
    vio = parts[0] / parts[1].clamp(min=1.0)
    if not capacity:
        return BalanceStats(max_vio=vio)
    return BalanceStats(max_vio=vio, dropped=parts[2], dropped_pct=100 * parts[2] / parts[3].clamp(min=1.0))


class StageBalance:
    """The expert balance of a pp rank in graph mode (trainer/graph/pipeline.py; `GraphStep(balance=)`):
    `finish(load, apply)` as `ExpertBalance.finish` with the stage's ranks summing this rank's layers'
    loads and the statistics combined over the pp axis, as eager PP (trainer/step/pipeline.py) calls
    it; a rank without MoE layers (`balance` empty) joins that reduction with zeros
    (`ExpertBalance.join_without_layers`), so every rank returns the same statistics. `pop` is never
    called: the pipeline's `terms` return the loads."""

    def __init__(self, balance: ExpertBalance, *, stage_mesh, pp_group, device: torch.device, capacity: bool):
        from parallelisms.parallel_dims import stage_group_mesh

        self.balance = balance
        self.pp_group = pp_group
        self.device = device
        self.capacity = capacity
        self.stage_group = stage_group_mesh(stage_mesh).get_group() if balance else None

    def finish(self, load: torch.Tensor | None, apply: torch.Tensor | None = None) -> BalanceStats:
        if not self.balance:
            return self.balance.join_without_layers(self.pp_group, self.device, self.capacity)
        return self.balance.finish(load, apply=apply, group=self.stage_group, pp_group=self.pp_group)
