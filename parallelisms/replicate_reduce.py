"""The gradient reduction over `dp_replicate` once per optimizer step (`training.replicate_reduce =
"step"`), optionally bf16 on the wire with fp32 accumulation (`training.replicate_reduce_dtype`).

By default SimpleFSDP reduces every gradient over all data-parallel axes in each micro-batch's
backward (parallelisms/simple_fsdp.py: the gather's gradient is `Partial("avg")` on every dp axis).
On a multislice job `dp_replicate` is the axis across slices, over the data-center network (DCN,
docs/launch.md "Several slices"), the slowest link of the job, and with gradient accumulation that
all-reduce runs once per micro-batch. With `replicate_reduce = "step"` the gather declares the
gradient `Replicate` on `dp_replicate` (no collective there: each replica accumulates its own
slice-local gradient, reduce-scattered over `dp_shard` as before) and this module all-reduces the
accumulated gradients over `dp_replicate` once, after the last micro-batch:

- **Buckets.** Gradients are packed into flat fp32 buckets of about `bucket_mb` MB per
  replicate group, in reverse parameter order (the order the backward produces them).
- **Overlap (eager and compile modes).** During the last micro-batch's backward a hook on each
  parameter (`register_post_accumulate_grad_hook`) marks its gradient final; a bucket whose
  gradients are all final is issued at once, asynchronously (functional collectives: the wait is
  at first use), in bucket order on every rank, so the reduction runs under the rest of the
  backward. `ReplicateReducer.finish()` issues what is left, waits and writes the means back.
- **Graph mode.** The captured step calls `reduce_grads()` on the accumulated gradients: the same
  collectives as graph ops, which the compiler schedules (XLA overlaps them with the backward's
  tail where the dependencies allow).

**bf16 with fp32 accumulation** (`replicate_reduce_dtype = "bfloat16"`): each bucket is cast to
bf16 and split into R chunks (R = the replicate degree); an all-to-all gives each replica the R
copies of its chunk, summed in fp32 and divided by R; an all-gather of the bf16 means rebuilds the
bucket on every replica. The wire carries 2 x (R - 1) / R x 2 bytes per element, the bytes of a
bf16 ring all-reduce and half of fp32's, but no partial sum is ever rounded to bf16. Every
replica ends with the same bytes (the all-gather copies one result), so replicas never drift.
Error against the fp32 mean m of the R replica gradients g_r: each g_r is rounded once to bf16
and the mean once, so |error| <= u (1 + u) mean_r |g_r| + u |m| + O(R x 2^-24 x mean_r |g_r|), with
u = 2^-8 (bf16's unit roundoff; round to nearest even). tests/unit/test_replicate_reduce.py checks the
bound element-wise and that the fp32 option equals the per-micro-batch reduction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = [
    "REPLICATE_REDUCE",
    "REPLICATE_REDUCE_DTYPES",
    "ReplicateReducer",
    "canonical",
    "deferred_meshes",
    "reduce_grads",
]

REPLICATE_REDUCE = ("micro_batch", "step")
"""`training.replicate_reduce`: reduce over dp_replicate in each micro-batch's backward, or once per step."""
REPLICATE_REDUCE_DTYPES = ("float32", "bfloat16")
"""`training.replicate_reduce_dtype`: what the once-per-step reduction puts on the wire."""

BF16_UNIT_ROUNDOFF = 2.0**-8
"""u of bfloat16 (8 significand bits, round to nearest): |round(x) - x| <= u |x|."""


def deferred_meshes(model: nn.Module) -> dict[int, DeviceMesh]:
    """id(parameter) -> the 1-D dp_replicate mesh its gradient still has to be averaged over, for
    every parameter SimpleFSDP sharded with the reduction deferred (its `_GatherSpec.replicate_mesh`).
    Read from the modules' specs each time: they survive `to_empty`, which replaces the parameters."""
    out = {}
    for module in model.modules():
        for name, spec in getattr(module, "_simple_fsdp_specs", {}).items():
            mesh = getattr(spec, "replicate_mesh", None)
            param = module._parameters.get(name)
            if mesh is not None and param is not None:
                out[id(param)] = mesh
    return out


def canonical(meshes: Sequence[DeviceMesh | None]) -> list[DeviceMesh | None]:
    """`meshes` with equal meshes (the same ranks and names: one group) made the same object, so
    that `reduce_grads` can group them by identity inside a traced step."""
    seen: list[DeviceMesh] = []
    out = []
    for m in meshes:
        if m is not None:
            m = next((s for s in seen if s == m), None) or (seen.append(m) or m)
        out.append(m)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _start(flat: torch.Tensor, mesh: DeviceMesh, dtype: torch.dtype):
    """Issue the collective of one fp32 bucket (padded to a multiple of the group size)."""
    if dtype == torch.float32:
        return funcol.all_reduce(flat, "sum", mesh)
    return funcol.all_to_all_single(flat.to(dtype), None, None, mesh)


def _complete(started: torch.Tensor, mesh: DeviceMesh, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 mean over the group from what `_start` issued."""
    r = mesh.size()
    if dtype == torch.float32:
        return started / r
    # started: the R replicas' copies of this rank's chunk, one after the other.
    mine = started.view(r, -1).to(torch.float32).sum(0) / r
    return funcol.all_gather_single(mine.to(dtype), 0, mesh).to(torch.float32)


def cut_buckets(items, meshes, numels, *, limit_bytes: float) -> list[tuple[DeviceMesh, list]]:
    """Consecutive `items` of one replicate mesh, cut where the mesh changes or the next item would
    take the bucket past `limit_bytes` of fp32 (0: no limit); items whose mesh is None are skipped.
    The eager reducer and the graph step cut alike (`ReplicateReducer`, `reduce_grads`)."""
    out: list[tuple[DeviceMesh, list]] = []
    size = 0
    for item, mesh, numel in zip(items, meshes, numels):
        if mesh is None:
            continue
        nbytes = numel * 4
        if not out or out[-1][0] != mesh or (limit_bytes and size + nbytes > limit_bytes):
            out.append((mesh, []))
            size = 0
        out[-1][1].append(item)
        size += nbytes
    return out


class _Bucket:
    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh):
        self.params = params
        self.mesh = mesh
        self.numel = sum(_local(p).numel() for p in params)
        r = mesh.size()
        self.padded = -(-self.numel // r) * r
        self.started = None

    def flat(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        parts = [
            torch.zeros(_local(p).numel(), dtype=torch.float32, device=_local(p).device)
            if g is None
            else _local(g).reshape(-1).to(torch.float32)
            for p, g in zip(self.params, grads)
        ]
        if self.padded > self.numel:
            parts.append(parts[0].new_zeros(self.padded - self.numel))
        return torch.cat(parts)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, at = [], 0
        for p in self.params:
            n = _local(p).numel()
            out.append(flat[at : at + n].view(_local(p).shape))
            at += n
        return out


class ReplicateReducer:
    """Averages the gradients of the parameters SimpleFSDP left unreduced on dp_replicate
    (`deferred_meshes`), once per step, bucketed (module docstring). Falsy when there are none.

    Eager: `arm()` before the last micro-batch's backward, `finish()` after it (before clipping).
    Engine: `finish()` without `arm()` reduces everything at once. Graph mode: `reduce_grads`.
    """

    def __init__(self, model: nn.Module, *, dtype: torch.dtype = torch.float32, bucket_mb: float = 25.0):
        self.dtype = dtype
        self.bucket_bytes = max(bucket_mb, 0.0) * 2**20
        meshes = deferred_meshes(model)
        params, seen = [], set()
        for p in model.parameters():
            if id(p) not in seen and id(p) in meshes and p.requires_grad:
                seen.add(id(p))
                params.append(p)
        self.buckets = self._buckets(reversed(params), meshes)
        self._index = {id(p): (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        self._armed = False
        self._handles = []
        if torch.is_grad_enabled():  # hooks only where gradients are taken
            for p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def __bool__(self) -> bool:
        return bool(self.buckets)

    def _buckets(self, params: Iterable[nn.Parameter], meshes: dict[int, DeviceMesh]) -> list[_Bucket]:
        """Consecutive parameters of one replicate group, cut at `bucket_bytes` of fp32."""
        params = list(params)
        cut = cut_buckets(
            params, [meshes[id(p)] for p in params], [_local(p).numel() for p in params], limit_bytes=self.bucket_bytes
        )
        return [_Bucket(ps, mesh) for mesh, ps in cut]

    # -- eager: issued during the last micro-batch's backward ------------------------------------

    def arm(self) -> None:
        """The next backward is the step's last: issue each bucket as its gradients become final."""
        self._armed = True
        self._final = [0] * len(self.buckets)
        self._next = 0
        for b in self.buckets:
            b.started = None

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        i, _ = self._index[id(param)]
        self._final[i] += 1
        # In bucket order on every rank: a collective issued out of order would pair with another
        # rank's different bucket.
        while self._next < len(self.buckets) and self._final[self._next] == len(self.buckets[self._next].params):
            self._issue(self.buckets[self._next])
            self._next += 1

    def _issue(self, bucket: _Bucket) -> None:
        flat = bucket.flat([p.grad for p in bucket.params])
        bucket.started = _start(flat, bucket.mesh, self.dtype)

    @torch.no_grad()
    def finish(self) -> None:
        """Issue the buckets not yet issued, wait, and write each mean into its parameter's grad."""
        self._armed = False
        for b in self.buckets:
            if b.started is None:
                if all(p.grad is None for p in b.params):
                    continue  # nothing was accumulated (every rank alike: the same graph runs)
                self._issue(b)
        for b in self.buckets:
            if b.started is None:
                continue
            mean = _complete(b.started, b.mesh, self.dtype)
            b.started = None
            for p, value in zip(b.params, b.split(mean[: b.numel])):
                if p.grad is not None:
                    _local(p.grad).copy_(value)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def reduce_grads(
    grads: Sequence[torch.Tensor],
    meshes: Sequence[DeviceMesh | None],
    *,
    dtype: torch.dtype = torch.float32,
    bucket_mb: float = 25.0,
) -> list[torch.Tensor]:
    """Graph mode: `grads` (local tensors) with those whose mesh is not None averaged over it, in
    buckets cut as the eager reducer cuts them; every bucket is issued before any is completed,
    and the compiler schedules them. A stacked gradient (layer scan) is one tensor like any other."""
    order = list(reversed(range(len(grads))))
    groups = cut_buckets(
        order, [meshes[k] for k in order], [grads[k].numel() for k in order], limit_bytes=max(bucket_mb, 0.0) * 2**20
    )
    out = list(grads)
    started = []
    for mesh, ks in groups:
        r = mesh.size()
        numel = sum(grads[k].numel() for k in ks)
        parts = [grads[k].reshape(-1).to(torch.float32) for k in ks]
        pad = -(-numel // r) * r - numel
        if pad:
            parts.append(parts[0].new_zeros(pad))
        started.append((mesh, ks, _start(torch.cat(parts), mesh, dtype)))
    for mesh, ks, s in started:
        mean = _complete(s, mesh, dtype)
        at = 0
        for k in ks:
            n = grads[k].numel()
            out[k] = mean[at : at + n].view(grads[k].shape).to(grads[k].dtype)
            at += n
    return out
