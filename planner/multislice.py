"""Several slices: what crosses the data-center network (DCN) per step, and the weak scaling it allows.

The slices split the mesh's outermost axes (parallelisms/parallel_dims.py `dcn_mesh_shape`): the
pipeline stages first (`pp`, priced in planner/pipeline.py: the stage permutes), then the HSDP
replicas (`dp_replicate`), and what is left on `dp_shard` (FSDP across slices, MaxText's
`dcn_fsdp_parallelism`; `[parallelism] allow_dcn_sharding`). Per device and step:

- **HSDP gradient all-reduce** over the `r` slices `dp_replicate` spans: each device all-reduces
  the gradient shard it holds (`Estimate.grads`, fp32; bf16 halves it) with the devices holding the
  same shard in the other slices; a ring over r slices moves `2 (r - 1) / r` of it. By default
  SimpleFSDP reduces in each micro-batch's backward (parallelisms/simple_fsdp.py: the gradient of
  each gather), so a step pays it `grad_accum` times; with `[training] replicate_reduce = "step"`
  (parallelisms/replicate_reduce.py) once, under the last micro-batch's backward only.
- **DCN-FSDP** over the `s` slices `dp_shard` spans: every SimpleFSDP all-gather and gradient
  reduce-scatter is a collective over devices in `s` slices. Taken as hierarchical (bandwidth-
  optimal: the DCN leg among the `s` devices with the same position in their slices, the ICI leg
  inside each slice), a device moves `(s - 1)` times its own shard over the DCN per collective:
  a slice receives the `(s - 1) / s` of the gathered tensor the other slices hold, spread over its
  devices. Per micro-batch: the forward all-gathers every parameter shard (bf16, `Estimate.params`
  / 2, float8 gathers by `fsdp_gather_ratio`); the backward re-gathers what the forward did not
  keep (AC recomputes the blocks' gathers: all but `Estimate.saved_weights`, the weights kept
  gathered, whose shard is `saved_weights / (dp_shard x cp)`); and reduce-scatters the gradient
  (`Estimate.grads`, in the reduce dtype).

Time: bytes / (the host's DCN bandwidth / devices per host): a host's devices share its NICs.
Overlap (the rule HSDP's all-reduce always had): a layer's collective is issued a layer ahead (the
gathers) or when its backward is done (the reductions), so it runs under the compute of the other
layers of the same pass; what is left exposed is, per pass, at least one layer's share and at least
what exceeds that pass's compute (`exposed_s`): the forward gathers under the forward (1 / (3 rf)
of the compute: 2N of the 6N FLOPs per token, times the recompute factor rf), the backward's
re-gathers, reduce-scatters and all-reduce under the backward (the rest). Whether eager
collectives on torch-tpu run asynchronously is not measured here; in graph mode XLA's scheduler
places them (docs/planner.md, "Several slices"). The bytes are NIC rate (an upper bound on speed):
latency, the many per-layer messages and stragglers are left out.

Weak scaling: every slice keeps its per-device batch, so S slices do S times the work in one step;
efficiency = t_step(1 slice) / t_step(S slices) = t_compute / (t_compute + exposed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.targets import Target


@dataclass(frozen=True)
class DcnCost:
    num_slices: int
    """Slices the HSDP replicas span (`dp_replicate`'s share of the DCN split); 1: no all-reduce over DCN."""
    bytes_per_device: float
    """Gradient bytes each device all-reduces over the DCN per reduction (HSDP)."""
    host_bytes_per_s: float
    reductions: int
    """Per step: the micro-batches (SimpleFSDP reduces in each one's backward), or 1 (once per step)."""
    dcn_s: float
    """The step's DCN time, serial: the HSDP all-reduce and the DCN-FSDP collectives."""
    compute_s: float
    backward_s: float
    """The backward time the all-reduce can hide under (all of it; the last micro-batch's when once per step)."""
    layers: int
    shard_slices: int
    """Slices `dp_shard` spans (DCN-FSDP); 1: FSDP stays inside each slice."""
    forward_gather_bytes: float
    """DCN-FSDP, per device and step: the forward's all-gathers' DCN bytes (all micro-batches)."""
    backward_gather_bytes: float
    """DCN-FSDP, per device and step: the backward's re-gathers (what AC recomputes)."""
    reduce_scatter_bytes: float
    """DCN-FSDP, per device and step: the gradient reduce-scatters."""
    allreduce_s: float
    """The HSDP all-reduce's serial time."""
    full_backward_s: float
    """The whole step's backward (what DCN-FSDP's backward traffic hides under)."""
    devices_per_host: int
    """Devices sharing the host's DCN bandwidth."""

    @property
    def per_device_bytes_per_s(self) -> float:
        return self.host_bytes_per_s / max(self.devices_per_host, 1)

    @property
    def fsdp_bytes(self) -> float:
        """DCN-FSDP's bytes per device and step (gathers and reduce-scatters)."""
        return self.forward_gather_bytes + self.backward_gather_bytes + self.reduce_scatter_bytes

    @property
    def exposed_s(self) -> float:
        """What the compute cannot hide (module docstring): per pass, the larger of one layer's share
        and what exceeds the pass's compute."""
        if self.dcn_s == 0:
            return 0.0
        layers = max(self.layers, 1)
        bw = self.per_device_bytes_per_s

        def part(t: float, under: float) -> float:
            return 0.0 if t <= 0 else max(t / layers, t - under)

        backward = self.full_backward_s
        forward = self.compute_s - backward
        ar = self.allreduce_s
        fwd = self.forward_gather_bytes / bw if self.fsdp_bytes else 0.0
        bwd = (self.backward_gather_bytes + self.reduce_scatter_bytes) / bw if self.fsdp_bytes else 0.0
        if self.reductions > 1 or self.backward_s == backward:
            # the all-reduce of each micro-batch shares the backward with DCN-FSDP's backward traffic
            return part(fwd, forward) + part(ar + bwd, backward)
        # once per step: the all-reduce hides under the last micro-batch's backward only (taken as
        # not contending with DCN-FSDP's, which runs in every micro-batch's)
        return part(fwd, forward) + part(bwd, backward) + part(ar, self.backward_s)

    @property
    def efficiency_serial(self) -> float:
        return self.compute_s / (self.compute_s + self.dcn_s)

    @property
    def efficiency_overlapped(self) -> float:
        return self.compute_s / (self.compute_s + self.exposed_s)


def dcn_split(est, target: Target) -> tuple[int, int]:
    """(slices `dp_replicate` spans, slices `dp_shard` spans) of a plan on `target`: the slices go to
    the outermost axes, `pp` first (parallelisms/parallel_dims.py `dcn_mesh_shape`). An estimate
    without `dp_replicate` (a bare namespace) is taken as HSDP over the slices the stages leave."""
    s = target.num_slices
    left = s // math.gcd(max(1, getattr(est, "pp", 1)), s)
    replicate = getattr(est, "dp_replicate", None)
    if replicate is None:
        return left, 1
    on_replicate = math.gcd(replicate, left)
    return on_replicate, left // on_replicate


def dcn_cost(
    est, target: Target, *, reduce_bytes: int = 4, layers: int | None = None, once_per_step: bool = False
) -> DcnCost | None:
    """The DCN traffic of an `Estimate` on a multislice `target` (None without a published DCN
    figure): the HSDP all-reduce and the DCN-FSDP gathers and reduce-scatters (module docstring).
    `reduce_bytes`: 4 (fp32) or 2 (bf16 on the wire: `mixed_precision_reduce` or
    `replicate_reduce_dtype`; the reduce-scatter's dtype too). `once_per_step`: `replicate_reduce = "step"`."""
    host_bw = target.dcn_bytes_per_s_per_host
    if host_bw is None:
        return None
    r, s = dcn_split(est, target)
    per_host_devices = target.generation.devices_per_host
    device_bw = host_bw / per_host_devices
    per_device = est.grads / 4 * reduce_bytes  # Estimate.grads: the fp32 gradient shard
    micro = max(est.grad_accum, 1)
    reductions = 1 if once_per_step else micro
    allreduce_s = 0.0 if r == 1 else reductions * 2 * (r - 1) / r * per_device / device_bw
    fwd = bwd = rs = 0.0
    if s > 1:
        shard = est.params / 2 * getattr(est, "fsdp_gather_ratio", 1.0)  # the bf16 shard a gather moves
        kept = est.saved_weights / (est.dp_shard * getattr(est, "cp", 1))  # the kept weights' shard
        fwd = micro * (s - 1) * shard
        bwd = micro * (s - 1) * max(0.0, shard - kept * getattr(est, "fsdp_gather_ratio", 1.0))
        rs = micro * (s - 1) * per_device
    rf = est.recompute_factor
    compute_s = est.step_time_s
    backward_s = compute_s * (3 * rf - 1) / (3 * rf)  # 6N per token: 2N forward, 4N backward (+ recompute)
    return DcnCost(
        num_slices=r,
        bytes_per_device=per_device,
        host_bytes_per_s=host_bw,
        reductions=reductions,
        dcn_s=allreduce_s + (fwd + bwd + rs) / device_bw,
        compute_s=compute_s,
        backward_s=backward_s / micro if once_per_step else backward_s,
        layers=layers or est.n_layers or 1,
        shard_slices=s,
        forward_gather_bytes=fwd,
        backward_gather_bytes=bwd,
        reduce_scatter_bytes=rs,
        allreduce_s=allreduce_s,
        full_backward_s=backward_s,
        devices_per_host=per_host_devices,
    )


def priced_step_s(est, target: Target | None = None, **kw) -> float:
    """The plan's step time with its DCN traffic priced: `Estimate.step_time_s` (the compute, a
    pipeline's bubble and stage permutes) plus what the compute cannot hide of the data-parallel
    DCN traffic (`dcn_cost(...).exposed_s`; 0 on one slice or without a DCN figure)."""
    target = target or est.target
    cost = dcn_cost(est, target, **kw) if target.num_slices > 1 else None
    return est.step_time_s + (cost.exposed_s if cost is not None else 0.0)


def priced_tokens_per_s(est, target: Target | None = None, **kw) -> float:
    """Tokens per second per device at `priced_step_s`."""
    return est.tokens_per_device_step / priced_step_s(est, target, **kw)


def describe(cost: DcnCost) -> str:
    parts = []
    if cost.num_slices > 1:
        parts.append(
            f"gradient all-reduce over {cost.num_slices} slices {cost.bytes_per_device / 2**30:.2f} GiB per device "
            f"x {cost.reductions} per step ({cost.allreduce_s:.2f} s)"
        )
    if cost.shard_slices > 1:
        parts.append(
            f"FSDP over {cost.shard_slices} slices: all-gathers {cost.forward_gather_bytes / 2**30:.2f} GiB forward + "
            f"{cost.backward_gather_bytes / 2**30:.2f} GiB backward, reduce-scatters "
            f"{cost.reduce_scatter_bytes / 2**30:.2f} GiB per device and step "
            f"({cost.fsdp_bytes / cost.per_device_bytes_per_s:.2f} s)"
        )
    what = "; ".join(parts) or "no data-parallel traffic over the DCN"
    return (
        f"multislice ({cost.host_bytes_per_s / 1e9:.1f} GB/s DCN per host): {what} "
        f"-> {cost.dcn_s:.2f} s serial, {cost.exposed_s:.2f} s exposed beside a {cost.compute_s:.2f} s step; "
        f"weak-scaling efficiency {cost.efficiency_overlapped:.1%} overlapped ({cost.efficiency_serial:.1%} serial)"
    )
