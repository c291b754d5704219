"""Context parallelism (CP): the sequence split over a `cp` mesh axis, attention over all of it.

The sequence of length `s` is cut into `2 * cp` chunks of `c = s / (2 * cp)` tokens; CP rank
`r` keeps chunks `r` and `2 * cp - 1 - r` (causal load balancing: an early chunk, which sees
few keys, paired with a late one, which sees many, so every rank does the same causal work).

- `shard_sequence(x, dim, cp_rank, cp_size)` / `unshard_sequence(x, dim, cp_size)`: that
  layout and its inverse (no communication).
- `positions(seq_len, cp_rank, cp_size)`: the global positions a rank holds, in its local
  order; a model takes its RoPE rows by them (`cos[positions]`), not `cos[:s / cp]`.
- `gather_sequence(x, dim, cp)`: all-gather a load-balanced tensor over the cp group and
  put the chunks back in global order. It is a functional collective
  (`_functional_collectives.all_gather_single`, autograd-aware: its backward is a
  reduce-scatter), so eager, `torch.compile`, the graph trainer's capture and XLA all see
  one `all_gather_into_tensor` and, in the backward, one `reduce_scatter_tensor`.
- `context_parallel_attention(q, k, v, segment_ids, *, cp)`: causal (optionally
  document-masked) attention of the local queries against the keys and values of the whole
  sequence, gathered over `cp` (all-gather keys/values strategy, as TorchTitan's and
  Megatron's "allgather" CP). `cp_attention_fn(cp)` binds `cp` so the result can serve the
  op `causal_attention` (`models.common.ops.register`), i.e. a model runs it unchanged.

The attention product: the early local chunk (global chunk `r < cp`) can only see keys in
the first half of the sequence, the late chunk sees up to all of it, so the early queries
are multiplied against the first `s / 2` keys and the late ones against all `s` keys, each
with an explicit boolean mask `key_pos <= query_pos` (and `same segment`). That is 3/4 of the
work of an `s / cp x s` masked product, with shapes that are the same on every rank (only
the mask's contents depend on the rank), so every rank traces the same program. It runs
`F.scaled_dot_product_attention` with a mask (the CPU flash kernel takes one; a v narrower or
wider than q/k, MLA's, through `models.common.ops.sdpa`, which pads to one width); k/v heads are
repeated for grouped-query attention after the gather (`models.common.ops.repeat_kv`), so the
collective moves only the kv heads. A TPU splash-attention version would take the same
gathered k/v and, instead of a dense mask, a mask *function* of (query position, key
position, segment): splash's `segment_ids` plus a causal mask with a per-rank query offset
table, which lets it skip fully masked blocks (bringing the work to `(2 cp + 1) / (4 cp)` of
the dense product) and never materialise the `[c, s]` mask.

Gradient flow: the loss of a CP rank covers its own tokens only, so the global loss is the
sum of the ranks' token sums divided by the global token count, and parameter gradients are
summed over `cp` (SimpleFSDP over `dp x cp` does exactly that). Gradients of the gathered
k/v come back to their owners through the all-gather's reduce-scatter.

See docs/context_parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from models.common.ops import repeat_kv, sdpa
from models.errors import ConfigError
from parallelisms.device_order import shard_rank

CP_KEY = "parallelism.context_parallel_degree"


@dataclass(frozen=True)
class CPGroup:
    """The cp process group as collectives take it, with its size and this rank's index.

    Built once, outside traced code (`cp_group(mesh_or_group)`), so a traced function reads
    plain ints and never asks the process group during tracing.
    """

    group: DeviceMesh | dist.ProcessGroup
    size: int
    rank: int


def cp_group(mesh_or_group: DeviceMesh | dist.ProcessGroup) -> CPGroup:
    """A 1-D DeviceMesh (e.g. `mesh["cp"]`) or a ProcessGroup -> `CPGroup`."""
    if isinstance(mesh_or_group, DeviceMesh):
        assert mesh_or_group.ndim == 1, f"a 1-D cp mesh is needed, got {mesh_or_group.ndim} dims"
        return CPGroup(mesh_or_group, mesh_or_group.size(), shard_rank(mesh_or_group))
    return CPGroup(mesh_or_group, dist.get_world_size(mesh_or_group), dist.get_rank(mesh_or_group))


def check_seq_len(seq_len: int, cp_size: int) -> None:
    """ConfigError unless the sequence cuts into `2 * cp_size` equal chunks."""
    if seq_len % (2 * cp_size) != 0:
        raise ConfigError(
            f"{CP_KEY}: {cp_size} needs a sequence length divisible by 2 x {cp_size} = "
            f"{2 * cp_size} (two load-balanced chunks per rank), got training.seq_len = {seq_len}; "
            f"allowed: degrees cp with seq_len % (2 * cp) == 0"
        )


def positions(seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (int64 [seq_len / cp_size]) rank `cp_rank` holds, in local order:
    chunk `cp_rank` then chunk `2 * cp_size - 1 - cp_rank`, chunks of `seq_len / (2 cp)`."""
    check_seq_len(seq_len, cp_size)
    assert 0 <= cp_rank < cp_size, f"cp rank {cp_rank} outside [0, {cp_size})"
    chunk = seq_len // (2 * cp_size)
    arange = torch.arange(chunk, dtype=torch.int64, device=device)
    return torch.cat([cp_rank * chunk + arange, (2 * cp_size - 1 - cp_rank) * chunk + arange])


def shard_sequence(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Rank `cp_rank`'s load-balanced shard of `x` along `dim`: chunks `r` and `2 cp - 1 - r`
    of `2 cp` equal chunks, concatenated (a new tensor of `x.shape[dim] / cp_size` there)."""
    check_seq_len(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def _rank_major_to_global(x: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[cp * s_local, ...] (rank r's shard at rows r * s_local..) -> [s, ...] in global order.

    Row block r holds chunks (r, 2 cp - 1 - r): the early halves in rank order are chunks
    0..cp-1 and the late halves in reverse rank order are chunks cp..2cp-1.
    """
    total = x.shape[0]
    assert total % (2 * cp_size) == 0, f"{total} rows do not split into 2 x {cp_size} chunks"
    chunk = total // (2 * cp_size)
    blocks = x.view(cp_size, 2, chunk, *x.shape[1:])
    early, late = blocks[:, 0], blocks[:, 1].flip(0)
    return torch.cat([early, late]).reshape(total, *x.shape[1:])


def unshard_sequence(x: torch.Tensor, dim: int, cp_size: int) -> torch.Tensor:
    """Inverse of `shard_sequence`: `x` is the ranks' shards concatenated along `dim` in rank
    order; returns the sequence in global order."""
    return _rank_major_to_global(x.movedim(dim, 0), cp_size).movedim(0, dim)


def gather_sequence(x: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
    """All-gather the load-balanced shards of `x` along `dim` over `cp`, in global order.

    Autograd: the gradient of the result is reduce-scattered back (summed over the ranks
    that used this rank's rows). One `all_gather_into_tensor` along dim 0 (contiguous
    buffers, no per-chunk collectives); the reorder is local.
    """
    if cp.size == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    gathered = funcol.all_gather_single(moved, 0, cp.group)
    return _rank_major_to_global(gathered, cp.size).movedim(0, dim)


def _masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_seg: torch.Tensor | None,
    k_seg: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA of q [b, h, m, d] against k, v [b, h, n, d] with `k_pos <= q_pos` (and same
    segment) as the boolean mask. The key at the query's own position is always in the
    same segment and visible, so no row is fully masked."""
    mask = k_pos[None, :] <= q_pos[:, None]  # [m, n]
    if q_seg is not None:
        mask = mask[None] & (q_seg[:, :, None] == k_seg[:, None, :])  # [b, m, n]
        mask = mask[:, None]  # [b, 1, m, n]
    return sdpa(q, k, v, attn_mask=mask)  # v at its own width (MLA), as the op allows


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    *,
    cp: CPGroup,
    local_attention=None,
) -> torch.Tensor:
    """Causal attention of this rank's queries against the whole sequence's keys.

    q [b, q_heads, s/cp, d], k and v [b, kv_heads, s/cp, d] and `segment_ids` [b, s/cp] (or
    None) in the load-balanced layout of `shard_sequence` -> [b, q_heads, s/cp, d], the rows
    of the full-sequence `causal_attention` that this rank holds. k, v and the segment ids
    are all-gathered over `cp` (their gradients reduce-scattered back).

    `local_attention(q, k_all, v_all, segment_ids, segment_ids_all)`: a kernel for this rank's
    queries against the gathered k/v (kv heads, unrepeated), e.g. TPU splash with the rank's
    causal offsets (`titan_kernels.tpu.cp_attention`); None: the dense-mask SDPA below.
    """
    s_local = q.shape[2]
    assert s_local % 2 == 0 and k.shape[2] == s_local, f"bad local lengths {q.shape} {k.shape}"
    if local_attention is not None:
        seg_all = None if segment_ids is None else gather_sequence(segment_ids, 1, cp)
        return local_attention(q, gather_sequence(k, 2, cp), gather_sequence(v, 2, cp), segment_ids, seg_all)
    chunk, seq_len = s_local // 2, s_local * cp.size
    n_rep = q.shape[1] // k.shape[1]
    k_all = repeat_kv(gather_sequence(k, 2, cp), n_rep)
    v_all = repeat_kv(gather_sequence(v, 2, cp), n_rep)
    seg_all = None if segment_ids is None else gather_sequence(segment_ids, 1, cp)
    q_pos = positions(seq_len, cp.rank, cp.size, device=q.device)
    k_pos = torch.arange(seq_len, dtype=torch.int64, device=q.device)
    half = seq_len // 2
    seg_local = segment_ids
    outs = []
    # Early chunk (global chunk r < cp): every visible key lies in the first half.
    # Late chunk (global chunk 2cp-1-r >= cp): keys anywhere up to its own position.
    for part, n_keys in ((slice(0, chunk), half), (slice(chunk, s_local), seq_len)):
        outs.append(
            _masked_sdpa(
                q[:, :, part],
                k_all[:, :, :n_keys],
                v_all[:, :, :n_keys],
                q_pos[part],
                k_pos[:n_keys],
                None if seg_local is None else seg_local[:, part],
                None if seg_all is None else seg_all[:, :n_keys],
            )
        )
    return torch.cat(outs, dim=2)


def cp_attention_fn(cp: CPGroup, device_type: str = "cpu"):
    """`context_parallel_attention` bound to `cp`, with the signature of the op
    `causal_attention` (`(q, k, v)` or `(q, k, v, segment_ids)`), for `ops.register`.

    On `device_type` "tpu" the local product is splash with this rank's causal offsets
    (`titan_kernels.tpu.cp_attention`, built here, once, outside any trace) when the TPU kernels
    loaded; tensors not on the TPU still take the dense-mask SDPA."""
    local = None
    if device_type == "tpu":
        from titan_kernels.tpu import cp_attention

        local = cp_attention(cp.rank, cp.size)

    def attention(q, k, v, segment_ids=None):
        kernel = local if local is not None and q.device.type == "tpu" else None
        return context_parallel_attention(q, k, v, segment_ids, cp=cp, local_attention=kernel)

    return attention


def apply_cp(cp: CPGroup, device_type: str, *, replacing: str, references: bool = False) -> str:
    """Context parallelism's step of `parallelize_model`'s order, taken where the op table is filled
    (`trainer.job.serve_ops`) because it serves an op rather than wrapping a module: the op
    `causal_attention` is served, for this job, by `cp_attention_fn(cp, device_type)` in place of
    the kernel chosen for a whole sequence (described by `replacing`; the job then serves linear
    attention's ops with `context_parallel_linear.apply_linear_cp`); `references`: a capture
    for `device_type` (the recipe check) serves the dense-mask SDPA. Returns the banner's
    attention line. The windows are sharded by the task, given `cp` at construction; the
    parameters are sharded over dp_shard x cp by SimpleFSDP (`parallelize_model`)."""
    from models.common import ops

    ops.register("causal_attention", cp_attention_fn(cp, "cpu" if references else device_type))
    local = "splash with per-rank causal offsets" if device_type == "tpu" else "SDPA with a causal mask"
    return f"context parallel over {cp.size} ranks (k/v all-gather, {local}), replacing {replacing}"
