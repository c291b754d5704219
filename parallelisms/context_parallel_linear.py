"""Context parallelism for linear attention (Qwen 3.5's Gated DeltaNet): the ops that read earlier
tokens, served for a rank that holds two load-balanced chunks of the sequence.

A cp rank holds global chunks `r` and `2 cp - 1 - r` (parallelisms/context_parallel.py). Three
ops of a Gated DeltaNet block read tokens before a chunk's first one, which live on another rank:

- `causal_conv1d` (the short depthwise convolution, kernel K): the last `K - 1` rows of every
  chunk are all-gathered (with the segment ids when there are documents), each local chunk gets
  its global predecessor's rows in front (zeros before the sequence's first chunk) and is
  convolved without padding. The gather is a functional collective: the halo's gradient goes back
  to its owner by the reduce-scatter of its backward.
- `segment_starts` (document starts, the delta rule's `reset`): a chunk's first token is compared
  with its predecessor's last segment id (gathered), not with the other local chunk's.
- `gated_delta_rule`: the state at a chunk's start must be the state after every earlier chunk.
  The recurrence is affine in the initial state: per token `S_t = A_t S_{t-1} + k_t d_t^T` with
  `A_t = exp(g_t) (I - beta_t k_t k_t^T)` acting on the key axis (a reset makes `A_t = 0`), so a
  chunk started from `S` ends at `Pi S + F` (`Pi = A_c .. A_1` [dk, dk], `F` the end state from
  zeros) and its outputs are `o_t^0 + S^T Phi_t^T q_t` (`Phi_t = A_t .. A_1`). One call of the
  op (whatever kernel serves it) computes all of that: values `[v | 0]` (dk zero columns
  appended) from the initial state `[0 | I]` give, columns being independent, the outputs
  `[o^0 | (Phi_t^T q_t)^T]` and the final state `[F | Pi]`. Each rank runs its two chunks as a
  batch of 2b, all-gathers `[F | Pi]` of every chunk (functional, autograd: reduce-scatter),
  folds `S_{j+1} = Pi_j S_j + F_j` over the 2 cp chunks in sequence order (the same on every
  rank; 2 cp small matmuls), and corrects its outputs by `(Phi_t^T q_t)^T S_j`. Cost: the op on
  `dv + dk` value columns instead of `dv` (2x at dk = dv, Qwen 3.5's widths), one all-gather of
  `2 b h dk (dv + dk)` floats per rank and layer, no sequential dependence between ranks (a
  send/recv ring would idle rank r until ranks 0..r-1 finished). Gradients flow through the fold
  and the gathers to every chunk's `Pi` and `F`.

`apply_linear_cp(cp)` registers the three for the job (trainer/job.py `serve_ops`, after `apply_cp`); the inner delta rule
is the kernel registered before (the TPU Pallas kernel, which takes an initial state and returns
its gradient, or the torch reference). See docs/context_parallel.md, "Linear attention".
"""

from __future__ import annotations

import torch

from parallelisms.context_parallel import CPGroup, gather_sequence


def _chunks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's two chunks of x [b, s_local, ...] (early, late)."""
    assert x.shape[1] % 2 == 0, f"a cp shard holds two equal chunks, got {x.shape[1]} tokens"
    return x.chunk(2, dim=1)


def _predecessors(tails: torch.Tensor, cp: CPGroup, fill: float | int) -> torch.Tensor:
    """tails [2, b, n, ...] (this rank's chunks' last n rows) -> [2, b, n, ...]: the last n rows of
    each local chunk's global predecessor (`fill` before chunk 0), via one all-gather of every
    rank's tails (autograd: the gradient returns to the owner)."""
    every = gather_sequence(tails, 0, cp)  # [2 cp, b, n, ...] in global chunk order
    every = torch.cat([torch.full_like(every[:1], fill), every[:-1]])  # chunk j -> chunk j - 1's rows
    return torch.stack([every[cp.rank], every[2 * cp.size - 1 - cp.rank]])


def cp_causal_conv1d(cp: CPGroup, inner):
    """The op `causal_conv1d` for a cp rank: each local chunk with its predecessor's K - 1 rows in
    front, then `inner` (the reference) on the extended chunk, the front rows' outputs dropped."""

    def causal_conv1d(x, weight, segment_ids=None):
        halo = weight.shape[-1] - 1
        parts = _chunks(x)
        if halo == 0:
            return inner(x, weight, segment_ids)
        assert parts[0].shape[1] >= halo, f"cp chunks of {parts[0].shape[1]} tokens under a {halo + 1}-tap conv"
        before = _predecessors(torch.stack([p[:, -halo:] for p in parts]), cp, 0.0)
        seg_parts = seg_before = None
        if segment_ids is not None:
            seg_parts = _chunks(segment_ids)
            # Before the sequence: an id no segment has, so the taps read nothing there.
            seg_before = _predecessors(torch.stack([p[:, -halo:] for p in seg_parts]), cp, -1)
        outs = []
        for i, part in enumerate(parts):
            ext = torch.cat([before[i], part], dim=1)
            seg = None if segment_ids is None else torch.cat([seg_before[i], seg_parts[i]], dim=1)
            outs.append(inner(ext, weight, seg)[:, halo:])
        return torch.cat(outs, dim=1)

    return causal_conv1d


def cp_segment_starts(cp: CPGroup):
    """The op `segment_starts` for a cp rank: each local chunk's first token against its global
    predecessor's last segment id (no start at the sequence's first token)."""

    def segment_starts(segment_ids):
        parts = _chunks(segment_ids)
        before = _predecessors(torch.stack([p[:, -1:] for p in parts]), cp, -1)  # [2, b, 1]
        outs = []
        for i, part in enumerate(parts):
            prev = torch.cat([before[i], part[:, :-1]], dim=1)
            starts = part != prev
            if i == 0 and cp.rank == 0:  # the sequence's first token: nothing before it
                starts = torch.cat([torch.zeros_like(starts[:, :1]), starts[:, 1:]], dim=1)
            outs.append(starts)
        return torch.cat(outs, dim=1)

    return segment_starts


def cp_gated_delta_rule(cp: CPGroup, inner):
    """The op `gated_delta_rule` for a cp rank, with the state passed in sequence order (module
    docstring); `inner` is the implementation that served the op before (kernel or reference)."""

    def gated_delta_rule(
        q, k, v, g, beta, *, chunk_size=64, initial_state=None, output_final_state=False, qk_l2norm=False, reset=None
    ):
        b, _, v_heads, dv = v.shape
        dk, dtype = k.shape[-1], q.dtype
        # The two local chunks as a batch of 2b rows: [2b, c, ...] (early chunks first). q in fp32 (the
        # op computes in fp32 whatever it is given), so the outputs' Phi^T q columns come back unrounded.
        q2, k2, v2, g2, beta2 = (torch.cat(_chunks(t), dim=0) for t in (q.float(), k, v, g, beta))
        reset2 = None if reset is None else torch.cat(_chunks(reset), dim=0)
        v_ext = torch.cat([v2, v2.new_zeros(*v2.shape[:-1], dk)], dim=-1)  # [v | 0]
        eye = torch.eye(dk, dtype=torch.float32, device=v.device)
        h0 = torch.cat([eye.new_zeros(dk, dv), eye], dim=-1).expand(2 * b, v_heads, dk, dv + dk)  # [0 | I]
        out, final = inner(
            q2,
            k2,
            v_ext,
            g2,
            beta2,
            chunk_size=chunk_size,
            initial_state=h0,
            output_final_state=True,
            qk_l2norm=qk_l2norm,
            reset=reset2,
        )
        # Every chunk's [F | Pi] in global order: [2 cp, b, h, dk, dv + dk].
        every = gather_sequence(final.view(2, b, v_heads, dk, dv + dk), 0, cp)
        state = (
            torch.zeros(b, v_heads, dk, dv, dtype=torch.float32, device=v.device)
            if initial_state is None
            else initial_state.float()
        )
        starts = []
        for j in range(2 * cp.size):  # S_{j+1} = Pi_j S_j + F_j
            starts.append(state)
            ends = every[j]
            state = ends[..., dv:] @ state + ends[..., :dv]
        mine = torch.cat([starts[cp.rank], starts[2 * cp.size - 1 - cp.rank]])  # [2b, h, dk, dv]
        # o_t = o_t^0 + (Phi_t^T q_t)^T S_j, per value head: [2b, c, h, dk] x [2b, h, dk, dv].
        correction = torch.einsum("bthk,bhkv->bthv", out[..., dv:].float(), mine)
        out = (out[..., :dv].float() + correction).to(dtype)
        out = torch.cat(out.chunk(2, dim=0), dim=1)  # back to [b, s_local, h, dv]
        return out, state if output_final_state else None

    return gated_delta_rule


def apply_linear_cp(cp: CPGroup) -> None:
    """Serve the ops that read earlier tokens (`causal_conv1d`, `segment_starts`,
    `gated_delta_rule`) for this cp rank; the delta rule wraps the implementation registered now."""
    from models.common import ops

    ops.register("causal_conv1d", cp_causal_conv1d(cp, ops.torch_causal_conv1d))
    ops.register("segment_starts", cp_segment_starts(cp))
    ops.register("gated_delta_rule", cp_gated_delta_rule(cp, ops.implementation("gated_delta_rule")))
