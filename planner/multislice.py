"""Several slices: the cross-slice (DCN) gradient all-reduce and the weak scaling it allows.

With HSDP across slices (`dp_replicate` a multiple of the slice count, parallelisms/parallel_dims.py)
the only traffic on the data-center network is the gradient all-reduce over `dp_replicate`: each
device all-reduces the gradient shard it holds (`Estimate.grads`, fp32; bf16 halves it) with the
devices holding the same shard in the other slices. A ring over the S slices moves 2 (S - 1) / S of
a host's shards through its NICs (all its devices' shards share them), so

    t_dcn = 2 (S - 1) / S x grad_bytes_per_device x devices_per_host / dcn_bytes_per_s_per_host

per reduction. By default SimpleFSDP reduces in each micro-batch's backward (parallelisms/simple_fsdp.py:
the gradient of each gather), so a step pays it `grad_accum` times; with `[training]
replicate_reduce = "step"` (parallelisms/replicate_reduce.py) once, overlapped with the last
micro-batch's backward only. Overlap: the reduction of a layer's gradient is issued when its
backward is done, so it can run under the backward of the layers before it; what is left exposed
is at least one layer's share and at least what exceeds the overlapping backward's time
(`exposed_s`). Whether eager collectives on torch-tpu run asynchronously is not
measured here; in graph mode XLA's scheduler places them (docs/planner.md, "Several slices").

Weak scaling: every slice keeps its per-device batch, so S slices do S times the work in one step;
efficiency = t_step(1 slice) / t_step(S slices) = t_compute / (t_compute + exposed).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.targets import Target


@dataclass(frozen=True)
class DcnCost:
    num_slices: int
    bytes_per_device: float
    """Gradient bytes each device all-reduces over the DCN per reduction."""
    host_bytes_per_s: float
    reductions: int
    """Per step: the micro-batches (SimpleFSDP reduces in each one's backward), or 1 (once per step)."""
    dcn_s: float
    """The step's DCN all-reduce time, serial."""
    compute_s: float
    backward_s: float
    """The backward time the reductions can hide under (all of it; the last micro-batch's when once per step)."""
    layers: int

    @property
    def exposed_s(self) -> float:
        """What the backward cannot hide: the last layer's share, or all above the backward's time."""
        if self.dcn_s == 0:
            return 0.0
        return max(self.dcn_s / max(self.layers, 1), self.dcn_s - self.backward_s)

    @property
    def efficiency_serial(self) -> float:
        return self.compute_s / (self.compute_s + self.dcn_s)

    @property
    def efficiency_overlapped(self) -> float:
        return self.compute_s / (self.compute_s + self.exposed_s)


def dcn_cost(
    est, target: Target, *, reduce_bytes: int = 4, layers: int | None = None, once_per_step: bool = False
) -> DcnCost | None:
    """The DCN all-reduce of an `Estimate` on a multislice `target` (None without a published DCN
    figure). `reduce_bytes`: 4 (fp32) or 2 (bf16 on the wire: `mixed_precision_reduce` or
    `replicate_reduce_dtype`). `once_per_step`: `replicate_reduce = "step"`."""
    host_bw = target.dcn_bytes_per_s_per_host
    if host_bw is None:
        return None
    # pipeline stages over the slices (`pp` outermost): only the replicas left span the DCN
    s = max(1, target.num_slices // max(1, getattr(est, "pp", 1)))
    per_device = est.grads / 4 * reduce_bytes  # Estimate.grads: the fp32 gradient shard
    per_host = per_device * target.generation.devices_per_host
    micro = max(est.grad_accum, 1)
    reductions = 1 if once_per_step else micro
    dcn_s = 0.0 if s == 1 else reductions * 2 * (s - 1) / s * per_host / host_bw
    rf = est.recompute_factor
    compute_s = est.step_time_s
    backward_s = compute_s * (3 * rf - 1) / (3 * rf)  # 6N per token: 2N forward, 4N backward (+ recompute)
    return DcnCost(
        num_slices=s,
        bytes_per_device=per_device,
        host_bytes_per_s=host_bw,
        reductions=reductions,
        dcn_s=dcn_s,
        compute_s=compute_s,
        backward_s=backward_s / micro if once_per_step else backward_s,
        layers=layers or est.n_layers or 1,
    )


def describe(cost: DcnCost) -> str:
    return (
        f"multislice ({cost.num_slices} slices over DCN, {cost.host_bytes_per_s / 1e9:.1f} GB/s per host): "
        f"gradient all-reduce {cost.bytes_per_device / 2**30:.2f} GiB per device x {cost.reductions} per step "
        f"-> {cost.dcn_s:.2f} s serial, {cost.exposed_s:.2f} s exposed beside a {cost.compute_s:.2f} s step; "
        f"weak-scaling efficiency {cost.efficiency_overlapped:.1%} overlapped ({cost.efficiency_serial:.1%} serial)"
    )
