"""Muon: orthogonalised momentum for the matrices of the blocks, AdamW for everything else.

Muon (Keller Jordan, 2024) keeps a momentum buffer per weight matrix and applies, instead of the
momentum itself, its nearest semi-orthogonal matrix, approximated by five iterations of a quintic
Newton-Schulz map with the published coefficients (3.4445, -4.7750, 2.0315). The update of a
matrix [m, n] is then scaled by `0.2 * sqrt(max(m, n))` (Moonshot, "Muon is Scalable for LLM
Training", 2025): an orthogonal [m, n] matrix has entries of RMS `1/sqrt(max(m, n))`, and 0.2 is
the RMS that AdamW's updates settle at, so the AdamW learning rate and weight decay carry over
to the Muon matrices (the alternative, Keller Jordan's `sqrt(max(1, m/n))`, needs a ~20-60x
larger lr on these matrices than the AdamW groups). Weight decay is decoupled, `p *= 1 - lr*wd`,
as in AdamW.

Which parameters get Muon (`split_muon_params`): every parameter with 2 or more dims, except
those whose module path has a component in `[optimizer] muon_exclude` (default: the token
embedding, the output head and the MoE router gate, under this tree's names and Hugging Face's:
`tok_embeddings`/`embed_tokens`, `output`/`lm_head`, `gate`, which is not `gate_proj`). Embeddings are lookups, not linear maps
(a row is updated only when its token appears, which orthogonalisation of the whole matrix
ignores); the head's rows are per-token logits, where Moonshot and Keller Jordan both keep AdamW;
the router gate is a small [n_experts, dim] matrix whose row norms set the routing temperature,
which orthogonalisation would force to be equal. Norm weights and biases (1-D) always take
AdamW, and so do the tensors of 2 or more dims that a model class names as no linear map
(`non_matrix_params`: gpt-oss's attention sinks [H, 1] and per-expert bias tables [E, n],
Qwen 3.5's depthwise conv taps [C, 1, K] and its [1, dim] shared-expert gate), which
orthogonalisation would reduce to rescaled unit rows. MoE experts' weights [n_experts, out, in] get one Newton-Schulz per expert (batched over
the leading dims), scaled by that expert matrix's own shape.

Sharded parameters (SimpleFSDP, TP, EP: DTensors): the momentum update is elementwise on the
local shard; the matrices to orthogonalise are then gathered whole over the mesh axes that
shard their last two dims (one all-gather per step: the parameter's size in fp32, the same bytes
as the forward's parameter all-gather in fp32; an axis that shards experts or stacked layers
moves nothing), every rank runs Newton-Schulz on the whole matrices it holds (redundant compute
over the gathering axes: 5 x 3 matmuls of the matrix's size per rank), and each rank keeps its
own shard of the result (a local slice, no traffic). Graph mode (`[compile] mode = "graph"`,
the pod recipes' mode) replaces the gather by two all-to-alls that give each rank ceil(B/D) of
the B whole matrices (`trainer.graph.optim.orthogonalize_sharded`): no redundant compute, and
no rank holds the whole stack.

Optimizer state uses torch.optim's names so checkpoints look familiar: Muon parameters hold
`momentum_buffer` (a DTensor like the parameter), AdamW parameters `step`, `exp_avg`,
`exp_avg_sq` exactly as `torch.optim.AdamW` (its functional kernel does their update).

MuonClip's QK clip (Kimi K2) is in `trainer/optim/qk_clip.py`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.optim.adamw import adamw as adamw_functional

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients (a, b, c): X <- aX + b(XX^T)X + c(XX^T)^2 X."""

MUON_EXCLUDE_DEFAULT = ("tok_embeddings", "output", "gate", "embed_tokens", "lm_head")
"""Module-path components whose parameters stay on AdamW (`[optimizer] muon_exclude`)."""

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def newton_schulz5(
    g: torch.Tensor, *, steps: int, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U V^T of each matrix g[..., m, n] (g = U S V^T).

    Quintic Newton-Schulz in `dtype` (bf16 as published: the iteration only needs singular
    values pushed into ~[0.7, 1.2], not exact orthogonality). The matrix is first scaled to
    Frobenius norm <= 1 (so its spectral norm is <= 1, inside the iteration's basin) and, when
    m > n, iterated on its transpose so X X^T is the smaller [min, min] Gram matrix.
    Returns a tensor of g's shape and `dtype`.
    """
    assert g.dim() >= 2, g.shape
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    transpose = g.size(-2) > g.size(-1)
    if transpose:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if transpose else x


def update_scale(shape: torch.Size) -> float:
    """Moonshot's RMS match for a matrix of shape [..., m, n]: 0.2 * sqrt(max(m, n))."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def split_muon_params(named_params, exclude=MUON_EXCLUDE_DEFAULT, *, non_matrices=()) -> tuple[list, list]:
    """(Muon parameters, AdamW parameters) of `model.named_parameters()` (see the module docstring).
    `non_matrices`: components of a parameter's dotted name (module or parameter) whose 2-D+
    tensors are not linear maps (the model's `non_matrix_params`): AdamW's too."""
    muon, adamw = [], []
    skip, vectors = set(exclude), set(non_matrices)
    for name, p in named_params:
        if not p.requires_grad:
            continue
        parts = name.split(".")
        if p.dim() >= 2 and not skip.intersection(parts[:-1]) and not vectors.intersection(parts):
            muon.append(p)
        else:
            adamw.append(p)
    return muon, adamw


def orthogonalize(update: torch.Tensor, *, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz of a (maybe sharded) update, scaled; returns the local shard in update's dtype.

    A DTensor has its matrix dims (the last two) gathered (`redistribute` to Replicate on the
    mesh axes that shard them); axes that shard a leading dim (stacked layers, experts under EP)
    stay sharded, since each matrix is orthogonalised on its own. Every rank runs Newton-Schulz on
    the matrices it then holds, and keeps its own shard of the result (a local slice, no
    communication). The graph step does the same with all-to-alls instead of gathers
    (`trainer.graph.optim.orthogonalize_sharded`).
    """
    if isinstance(update, DTensor):
        mesh, placements = update.device_mesh, update.placements
        whole = tuple(Replicate() if p.is_shard() and p.dim >= update.ndim - 2 else p for p in placements)
        if all(p.is_replicate() for p in whole) or any(type(p) not in (Shard, Replicate) for p in placements):
            # Whole on every rank (also the TP x FSDP _StridedShard layouts, which redistribute
            # to a partial Replicate does not take).
            full = update.full_tensor()
            ortho = newton_schulz5(full, steps=steps, dtype=dtype).to(full.dtype) * update_scale(full.shape)
            return distribute_tensor(ortho, mesh, placements, src_data_rank=None).to_local()
        matrices = update.redistribute(mesh, whole).to_local()
        ortho = newton_schulz5(matrices, steps=steps, dtype=dtype).to(matrices.dtype) * update_scale(update.shape)
        ortho = DTensor.from_local(ortho, mesh, whole, shape=update.shape, stride=update.stride())
        return ortho.redistribute(mesh, placements).to_local()
    return newton_schulz5(update, steps=steps, dtype=dtype).to(update.dtype) * update_scale(update.shape)


class Muon(torch.optim.Optimizer):
    """Muon for the groups with `use_muon=True`, AdamW for the others; one optimizer, one state.

    Muon group keys: `lr`, `weight_decay`, `momentum` (beta), `nesterov`, `ns_steps`, `ns_dtype`.
    AdamW group keys: `lr`, `weight_decay`, `betas`, `eps` (torch.optim.AdamW's arithmetic).
    Both kinds follow the same lr schedule (the scheduler scales every group's `lr`).

    Muon update of a matrix W with gradient G (momentum as an EMA, Keller Jordan's current form;
    the older `buf = beta*buf + G` differs by the factor 1-beta only, which the normalisation
    inside Newton-Schulz removes):
        buf <- beta*buf + (1-beta)*G
        u   <- (1-beta)*G + beta*buf if nesterov else buf
        W   <- W*(1 - lr*wd) - lr * 0.2*sqrt(max(m, n)) * NS5(u)
    """

    def __init__(
        self,
        muon_params,
        adamw_params,
        *,
        lr: float,
        weight_decay: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: str = "bfloat16",
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        qk_clip=None,
    ):
        self.qk_clip = qk_clip
        """A `trainer.optim.qk_clip.QKClip` (MuonClip) applied after each step, or None."""
        groups = []
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        if muon_params:
            groups.append(
                {
                    "params": muon_params,
                    "use_muon": True,
                    "momentum": momentum,
                    "nesterov": nesterov,
                    "ns_steps": ns_steps,
                    "ns_dtype": ns_dtype,
                }
            )
        if adamw_params:
            groups.append({"params": adamw_params, "use_muon": False, "betas": tuple(betas), "eps": eps})
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Muon.step takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["use_muon"]:
                self._muon_group(group, params)
            else:
                self._adamw_group(group, params)
        if self.qk_clip is not None:
            self.qk_clip.apply()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # A step starts here (eager step, engine): MuonClip's max logits start afresh too, so a
        # skipped (non-finite) step's logits do not carry over.
        super().zero_grad(set_to_none=set_to_none)
        if self.qk_clip is not None:
            self.qk_clip.reset()

    def _muon_group(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
        dtype = NS_DTYPES[group["ns_dtype"]]
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            grad_local, buf_local, p_local = _local(p.grad), _local(buf), _local(p)
            buf_local.lerp_(grad_local, 1 - beta)
            u_local = grad_local.lerp(buf_local, beta) if group["nesterov"] else buf_local.clone()
            u = (
                DTensor.from_local(u_local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                if isinstance(p, DTensor)
                else u_local
            )
            delta = orthogonalize(u, steps=group["ns_steps"], dtype=dtype)
            if wd != 0:
                p_local.mul_(1 - lr * wd)
            p_local.add_(delta, alpha=-lr)

    def _adamw_group(self, group: dict, params: list[torch.Tensor]) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw_functional(
            params,
            [p.grad for p in params],
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def build_muon(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas,
    eps: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    ns_dtype: str,
    exclude,
    qk_clip_tau: float = 0.0,
) -> Muon:
    """Muon over `model`'s parameters, split by `split_muon_params`; MuonClip when qk_clip_tau > 0."""
    qk_clip = None
    if qk_clip_tau > 0:
        from trainer.optim.qk_clip import QKClip

        qk_clip = QKClip(model, qk_clip_tau)
    muon, adamw = split_muon_params(
        model.named_parameters(), exclude, non_matrices=getattr(model, "non_matrix_params", ())
    )
    return Muon(
        muon,
        adamw,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        ns_dtype=ns_dtype,
        betas=betas,
        eps=eps,
        qk_clip=qk_clip,
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
