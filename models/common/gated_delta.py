"""The gated delta rule (Gated DeltaNet, Yang et al. 2024; Qwen3-Next / Qwen 3.5 linear attention).

Per value head, a state S [k_dim, v_dim] runs over the sequence:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T,   o_t = S_t^T q_t

(q scaled by `k_dim ** -0.5`; g <= 0 the log decay, beta in (0, 1) the write strength).
`recurrent_gated_delta_rule` is that loop, token by token: the reference.
`chunk_gated_delta_rule` is the chunked form (WY / UT transform inside chunks of `chunk_size`
tokens, a scan over chunks), exactly as transformers' `torch_chunk_gated_delta_rule` computes it
(same operations in the same order, fp32): the torch reference of the op `gated_delta_rule`
(models/common/ops.py), which the models call. The implementation registered for the run serves
that op (on TPU the Pallas kernel of titan_kernels/tpu/delta_rule.py through torch-tpu's `jax_op`,
after its start-up self-check; `call_prepared` is how it is called), else this reference.

State passing: `initial_state` [b, v_heads, k_dim, v_dim] is the state before the first token and
`output_final_state` returns the state after the last one, what context parallelism would hand
from one rank's sequence shard to the next. `reset` [b, s] (bool) zeroes the state before each
marked token (a packed document starts there): the same as `g = -inf` at those tokens, computed
without infinities (masks on the in-chunk decays), so documents packed in one row do not see each
other.
"""

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, qk_l2norm):
    """Shared input handling: GQA repeat, [b, h, s, ...] fp32, optional l2norm, the q scale."""
    num_k_heads, num_v_heads = k.shape[2], v.shape[2]
    if num_k_heads != num_v_heads:
        # Each q/k head serves num_v_heads // num_k_heads consecutive value heads.
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    q, k, v, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, beta, g)
    )
    if qk_l2norm:
        q = l2norm(q, dim=-1, eps=1e-6)
        k = l2norm(k, dim=-1, eps=1e-6)
    return q, k, v, beta, g


def call_prepared(
    fwd,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    qk_l2norm: bool = False,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op through a kernel `fwd(q, k, v, g, beta, h0, reset) -> (out, final state)` that takes
    the prepared inputs (`_prepare`: GQA repeated, [b, h, s, d] float32, l2-normalised; torch
    differentiates this part), the initial state (zeros when None) and `reset` as int32 (zeros
    when None); out [b, h, s, dv] float32 comes back as the reference returns it ([b, s, h, dv] in
    q's dtype). The TPU kernel's torch op (titan_kernels/tpu/register.py) and its capture stand-in
    (titan_kernels/tpu/capture.py) are called this way."""
    dtype = q.dtype
    b, s = q.shape[:2]
    q, k, v, beta, g = _prepare(q, k, v, g, beta, qk_l2norm)
    if initial_state is None:
        initial_state = v.new_zeros(b, v.shape[1], k.shape[-1], v.shape[-1])
    reset = v.new_zeros(b, s, dtype=torch.int32) if reset is None else reset.to(torch.int32)
    out, state = fwd(*(t.contiguous() for t in (q, k, v, g, beta, initial_state.float(), reset)))
    out = out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return out, state if output_final_state else None


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    qk_l2norm: bool = False,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference, one token at a time (slow: tests only). Arguments as `chunk_gated_delta_rule`."""
    dtype = q.dtype
    b, s, _, k_dim = k.shape
    num_v_heads, v_dim = v.shape[-2:]
    q, k, v, beta, g = _prepare(q, k, v, g, beta, qk_l2norm)
    q = q / (q.shape[-1] ** 0.5)
    if initial_state is None:
        state = torch.zeros(b, num_v_heads, k_dim, v_dim, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.to(torch.float32)
    out = torch.zeros_like(v)
    for t in range(s):
        decay = g[:, :, t].exp()
        if reset is not None:
            decay = decay * (~reset[:, t]).to(decay.dtype)[:, None]
        state = state * decay[..., None, None]
        kv_mem = (state * k[:, :, t, :, None]).sum(dim=-2)
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    qk_l2norm: bool = False,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule by chunks (module docstring).

    q, k [b, s, k_heads, k_dim]; v [b, s, v_heads, v_dim] (v_heads a multiple of k_heads); g, beta
    [b, s, v_heads]; `initial_state` [b, v_heads, k_dim, v_dim] or None (zeros); `qk_l2norm`:
    l2-normalise q and k first (in fp32); `reset` [b, s] bool or None. Computes in fp32 ->
    (out [b, s, v_heads, v_dim] in q's dtype, the final state [b, v_heads, k_dim, v_dim] fp32 or
    None). Without `reset` the operations are transformers' `torch_chunk_gated_delta_rule`'s.
    """
    dtype = q.dtype
    b, s, _, _ = k.shape
    num_v_heads, v_dim = v.shape[-2:]
    q, k, v, beta, g = _prepare(q, k, v, g, beta, qk_l2norm)
    q = q * q.shape[-1] ** -0.5
    q, k, k_beta, v_beta, g, pad = _to_chunks(q, k, v, beta, g, chunk_size=chunk_size)
    n = q.shape[2]
    hidden = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)  # j > i
    cum = g.cumsum(dim=3)
    if reset is not None:
        other_segment, sees_prev, to_end, chunk_open = _segments(reset, pad=pad, n=n, chunk_size=chunk_size)
        hidden = hidden | other_segment  # other segment: no pair

    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(hidden, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    from_start = cum.exp()
    if reset is not None:
        from_start = from_start * sees_prev
    decayed_k_beta = k_beta * from_start.unsqueeze(-1)
    # (I + strictly lower part of ut_system)^-1 applied to v_beta and the decayed keys.
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    q = q * from_start.unsqueeze(-1)
    to_end_decay = (cum[..., -1:] - cum).exp()
    chunk_decay = cum[..., -1].exp()
    if reset is not None:
        to_end_decay = to_end_decay * to_end
        chunk_decay = chunk_decay * chunk_open
    k = k * to_end_decay.unsqueeze(-1)
    out, state = _scan_chunks(q, k, intra, new_values, k_cumdecay, chunk_decay[..., None, None], initial_state)

    out = out.reshape(b, num_v_heads, -1, v_dim)[:, :, :s]
    out = out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return out, state if output_final_state else None


def _to_chunks(q, k, v, beta, g, *, chunk_size: int):
    """The sequence padded to whole chunks and cut into them: q, k, k * beta, v * beta
    [b, h, n, chunk_size, dim], g [b, h, n, chunk_size], and the padding length."""
    s = q.shape[2]
    pad = (chunk_size - s % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (s + pad) // chunk_size

    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (
        x.reshape(x.shape[0], x.shape[1], n, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )
    g = g.reshape(g.shape[0], g.shape[1], n, chunk_size)
    return q, k, k_beta, v_beta, g, pad


def _segments(reset: torch.Tensor, *, pad: int, n: int, chunk_size: int):
    """The in-chunk masks of `reset` [b, s] (segment = tokens between resets), each [b, 1, n, ...]:
    pairs (i, j) in different segments [.., chunk, chunk] (bool), tokens that read the old state
    (no reset in [chunk start, t]), tokens whose write reaches the new one (no reset in (t, chunk
    end]), and chunks the old state survives (no reset in the chunk), the last three as 0/1 fp32."""
    b = reset.shape[0]
    # Per chunk, segment index of each token (how many resets up to and including it).
    starts = F.pad(reset.to(torch.int64), (0, pad)).reshape(b, 1, n, chunk_size)
    seg = starts.cumsum(dim=3)
    other_segment = seg.unsqueeze(4) != seg.unsqueeze(3)
    sees_prev = (seg == 0).to(torch.float32)
    to_end = (seg == seg[..., -1:]).to(torch.float32)
    chunk_open = sees_prev[..., -1]
    return other_segment, sees_prev, to_end, chunk_open


def _scan_chunks(q, k, intra, new_values, k_cumdecay, chunk_decay, initial_state):
    """The scan over chunks: each chunk's output from the state it finds and its own tokens, then the
    state it leaves. q, k already decayed to the chunk's start and end; chunk_decay [b, h, n, 1, 1].
    -> (out [b, h, n, chunk, v_dim], the final state [b, h, k_dim, v_dim])."""
    b, h, n, _, v_dim = new_values.shape
    if initial_state is None:
        state = torch.zeros(b, h, k.shape[-1], v_dim, dtype=new_values.dtype, device=new_values.device)
    else:
        state = initial_state.to(new_values)
    out = torch.zeros_like(new_values)
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out, state
