"""Pod planning without a pod: per-device memory and step time of a parallel plan.

`scripts/estimate.py` is the command line; this module is the logic.

1. **Targets.** `parse_target("v6e-256")` names a slice: generation + size. For TPUs the size
   counts TensorCores, as Cloud TPU accelerator types do (`v5p-1024` = 512 chips; `v7x-1024` =
   512 chips). A device (one training process, one mesh rank) is a TensorCore on v5e, v6e
   and v7x (two per v7x chip) and a whole megacore chip on v4 and v5p. For GPUs the size counts
   GPUs. HBM per device and the peak come from `GENERATIONS` and `trainer/flops.py`.
2. **Real sharding on a fake world.** Inside `fake_process_group(world_size)` (PyTorch's
   "fake" backend: collectives are no-ops, so one process can be rank 0 of 1024) the
   planner builds the real mesh (`build_mesh`), the real flavor on the meta device and applies
   the real plan (`parallelize_model`: TP, EP, SimpleFSDP). Per-device parameter bytes are the
   sum of the local DTensor shards (`ShardStats`). Rank 0 is reported: `torch.chunk`
   gives it the largest piece of every unevenly split tensor.
3. **Activations, analytically.** `activation_bytes` counts the tensors each block keeps for
   backward in the eager path of this code base (bf16 compute, SDPA/flash attention so no
   seq^2 term, fp32 RMSNorm internals, fp32 log-probs for the loss) under each activation
   checkpointing mode. The formulas are in docs/planner.md; they match the bytes measured by
   `measure_saved_bytes` (a real CPU forward) to within a few bytes (tests/test_planner.py).
4. **Totals.** `estimate` adds fp32 master parameters, fp32 gradients, AdamW state (2 x fp32),
   saved activations, the bf16 weights the backward keeps, and the larger of two transient
   peaks (loss/LM head backward, one block's backward), and compares the sum with HBM minus a
   headroom margin. `recommend` searches degrees, AC mode and local batch for a target.

Nothing here touches an accelerator; it runs in seconds on a laptop CPU.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import gc
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from models.errors import ConfigError
from trainer.flops import GPU_PEAK_TFLOPS, TPU_PEAK_TFLOPS, flops_per_token

GiB = 2**30
AC_MODES = ("none", "selective", "full")

# =============================================================================== targets


@dataclass(frozen=True)
class Generation:
    """One accelerator generation: what a device is and how much memory it has."""

    name: str
    kind: str
    """"tpu" or "gpu"."""
    cores_per_chip: int
    """TensorCores per chip (what a TPU slice name counts); 1 for GPUs."""
    cores_per_device: int
    """TensorCores one device (process) drives: 2 on megacore chips (v4, v5p), else 1."""
    hbm_gib_per_device: float
    """HBM one device can use, GiB."""
    devices_per_host: int
    """Devices on one host (VM): the largest tensor-parallel degree `recommend` tries."""
    fsdp_min_tokens: int | None
    """Tokens per micro-batch per device above which FSDP's weight all-gathers hide behind
    compute (MaxText's ICI arithmetic-intensity thresholds); None where no published figure."""
    source: str

    @property
    def peak_tflops(self) -> float:
        """Dense bf16 peak per device, from trainer/flops.py (the one source of peaks)."""
        if self.kind == "tpu":
            return TPU_PEAK_TFLOPS[self.name]
        return dict(GPU_PEAK_TFLOPS)[self.name]


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v4", "tpu", 2, 2, 32.0, 4, None, "Cloud TPU v4: 32 GiB HBM2 per chip, megacore"),
        Generation("v5e", "tpu", 1, 1, 16.0, 4, None, "Cloud TPU v5e: 16 GiB HBM2 per chip"),
        Generation("v5p", "tpu", 2, 2, 95.0, 4, 2550, "Cloud TPU v5p: 95 GiB HBM2e per chip, megacore"),
        Generation("v6e", "tpu", 1, 1, 32.0, 4, 5100, "Cloud TPU v6e: 32 GiB HBM per chip"),
        Generation("v7x", "tpu", 2, 1, 96.0, 8, 12800,
                   "Cloud TPU7x: 192 GiB HBM per chip, 2 devices (TensorCores) per chip"),
        # GPUs: the capacity CUDA reports for the 80 GB / 141 GB parts; B200's vendor 180 GB
        # is taken as 10^9 bytes (not checked on a device).
        Generation("h100", "gpu", 1, 1, 79.1, 8, None, "NVIDIA H100 SXM 80 GB"),
        Generation("h200", "gpu", 1, 1, 139.8, 8, None, "NVIDIA H200 SXM 141 GB"),
        Generation("b200", "gpu", 1, 1, 180e9 / GiB, 8, None, "NVIDIA B200 180 GB"),
    )
}
_ALIASES = {"tpu7x": "v7x", "v5litepod": "v5e"}


@dataclass(frozen=True)
class Target:
    """A slice or cluster: `generation` x `devices`."""

    name: str
    generation: Generation
    devices: int
    chips: int

    @property
    def hbm_bytes(self) -> int:
        return int(self.generation.hbm_gib_per_device * GiB)

    @property
    def peak_flops(self) -> float:
        return self.generation.peak_tflops * 1e12

    def describe(self) -> str:
        g = self.generation
        unit = "TensorCores" if g.kind == "tpu" else "GPUs"
        size = int(self.name.split("-")[-1])
        return (f"{self.name}: {size} {unit} = {self.chips} chips = {self.devices} devices, "
                f"{g.hbm_gib_per_device:.1f} GiB HBM and {g.peak_tflops:g} TFLOP/s bf16 per device, "
                f"{g.devices_per_host} devices per host")


def parse_target(name: str) -> Target:
    """`v6e-256`, `v5p-1024`, `v7x-512` (also `tpu7x-512`), `v5litepod-64`, `h100-64`, ..."""
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", name.strip().lower())
    allowed = f"allowed: <generation>-<size> with generation one of {', '.join(GENERATIONS)}, e.g. v6e-256"
    if not m:
        raise ConfigError(f"--target: {name!r} is not a target name; {allowed}")
    gen_name, size = _ALIASES.get(m.group(1), m.group(1)), int(m.group(2))
    if gen_name not in GENERATIONS:
        raise ConfigError(f"--target: unknown generation {m.group(1)!r}; {allowed}")
    gen = GENERATIONS[gen_name]
    if size < 1 or size % gen.cores_per_device or size % gen.cores_per_chip:
        raise ConfigError(
            f"--target: {name}: the size counts {'TensorCores' if gen.kind == 'tpu' else 'GPUs'} and must be a "
            f"positive multiple of {max(gen.cores_per_chip, gen.cores_per_device)} for {gen_name}"
        )
    return Target(name=f"{gen_name}-{size}", generation=gen, devices=size // gen.cores_per_device,
                  chips=size // gen.cores_per_chip)


def target_table() -> str:
    """A printable table of the generations (per device)."""
    rows = ["generation  device                      HBM/device GiB  peak bf16 TFLOP/s  devices/host  FSDP tokens",
            "----------  --------------------------  --------------  -----------------  ------------  -----------"]
    for g in GENERATIONS.values():
        if g.kind == "gpu":
            device = "1 GPU"
        elif g.cores_per_device == 2:
            device = "1 chip (megacore, 2 TC)"
        else:
            device = f"1 TensorCore ({g.cores_per_chip}/chip)"
        rows.append(f"{g.name:<10}  {device:<26}  {g.hbm_gib_per_device:>14.1f}  {g.peak_tflops:>17g}  "
                    f"{g.devices_per_host:>12}  {g.fsdp_min_tokens or '-':>11}")
    return "\n".join(rows)


# =============================================================================== the real plan on a fake world


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Be rank `rank` of `world_size` on PyTorch's fake backend (collectives do nothing).

    Meshes, DTensors and the plan are built exactly as in a real job; tensors stay on meta.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the planner needs its own (fake) process group, but one is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# Mesh axes whose shards SimpleFSDP all-gathers before use; every other axis (tp, ep) stays split.
_DP_AXES = frozenset({"dp_replicate", "dp_shard", "dp", "efsdp"})


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _gathered_numel(param: torch.Tensor) -> int:
    """Elements of `param` after the data-parallel all-gather (still TP/EP-sharded)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param.numel()
    shape = list(param.shape)
    names = param.device_mesh.mesh_dim_names or ()
    for axis, placement in enumerate(param.placements):
        if names[axis] not in _DP_AXES and isinstance(placement, Shard):
            shape[placement.dim] = -(-shape[placement.dim] // param.device_mesh.size(axis))
    return math.prod(shape)


@dataclass(frozen=True)
class ShardStats:
    """Parameter elements one rank holds after the real plan (rank 0 of the fake world)."""

    n_layers: int
    root_numel: int
    """Local elements of the parameters outside the blocks (embedding, final norm, output)."""
    blocks_numel: int
    """Local elements of all blocks together."""
    block_gathered_numel: int
    """Elements of the largest block after the dp all-gather (what SimpleFSDP materializes in bf16)."""
    largest_block_param_gathered: int
    """Elements of the largest single block parameter after the dp all-gather."""
    root_gathered: dict[str, int]
    """Per root parameter: elements after the dp all-gather."""
    local_shapes: dict[str, tuple[int, ...]]
    """Local shard shape of each root parameter and of block 0's parameters."""
    probed: bool
    """True when one block was sharded and multiplied by n_layers (blocks are identical)."""

    @property
    def param_numel(self) -> int:
        return self.root_numel + self.blocks_numel

    @property
    def lm_head_gathered_numel(self) -> int:
        """The output projection (or the tied embedding) after the dp all-gather."""
        return self.root_gathered.get("output.weight", self.root_gathered.get("tok_embeddings.weight", 0))


def load_plan(family):
    """The family's parallel plan (`models/<family>/plan.py: PLAN`, dense and MoE blocks)."""
    return family.plan


def build_parallel_model(family, args, parallel_dims, *, ac_mode: str = "none",
                         enable_loss_parallel: bool = False) -> nn.Module:
    """Meta model -> the project's `parallelize_model` on the real mesh (needs a process group)."""
    from parallelisms.parallel_dims import build_mesh
    from parallelisms.parallelize import parallelize_model

    mesh = build_mesh(parallel_dims, "cpu") if parallel_dims.world_size > 1 else None
    with torch.device("meta"):
        model = family.model_cls(args)
    return parallelize_model(
        model, plan=load_plan(family), parallel_dims=parallel_dims, mesh=mesh,
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ac_mode=ac_mode,
        compile_backend=None, enable_loss_parallel=enable_loss_parallel,
    )


def shard_model(family, args, parallel_dims, *, probe: bool = False) -> ShardStats:
    """Apply the real plan to the meta model on the current (fake) world; count rank 0's shards.

    `probe=True` shards a one-block copy and multiplies the block by `n_layers`; exact for
    these models, whose blocks all have the same parameters, and fast for 100+ layers.
    """
    assert dist.is_initialized() and dist.get_world_size() == parallel_dims.world_size, (
        "run shard_model inside fake_process_group(parallel_dims.world_size)"
    )
    n_layers = args.n_layers
    model = build_parallel_model(family, dataclasses.replace(args, n_layers=1) if probe else args,
                                 parallel_dims)
    root_numel = 0
    root_gathered: dict[str, int] = {}
    block_local: dict[str, int] = {}
    block_gathered: dict[str, int] = {}
    largest = 0
    shapes: dict[str, tuple[int, ...]] = {}
    prefix = "layers."
    for name, param in model.named_parameters():
        local = _local(param)
        if name.startswith(prefix):
            block = name.split(".")[1]
            block_local[block] = block_local.get(block, 0) + local.numel()
            block_gathered[block] = block_gathered.get(block, 0) + _gathered_numel(param)
            largest = max(largest, _gathered_numel(param))
            if block == "0":
                shapes[name] = tuple(local.shape)
        else:
            root_numel += local.numel()
            root_gathered[name] = _gathered_numel(param)
            shapes[name] = tuple(local.shape)
    blocks_numel = block_local["0"] * n_layers if probe else sum(block_local.values())
    return ShardStats(n_layers=n_layers, root_numel=root_numel, blocks_numel=blocks_numel,
                      block_gathered_numel=max(block_gathered.values()), largest_block_param_gathered=largest,
                      root_gathered=root_gathered, local_shapes=shapes, probed=probe)


# =============================================================================== activations


@dataclass(frozen=True)
class ModelShape:
    """The sizes the activation model needs, read from the model's own modules."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    qk_norm: bool
    ffn_hidden: int
    """Dense SwiGLU width (0 for MoE blocks)."""
    num_experts: int = 0
    top_k: int = 0
    moe_hidden: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_model(cls, model: nn.Module, *, n_layers: int) -> ModelShape:
        block = model.layers["0"]
        attention = block.attention
        head_dim = attention.head_dim
        kw = dict(
            n_layers=n_layers, dim=model.tok_embeddings.embedding_dim,
            n_heads=attention.wq.out_features // head_dim, n_kv_heads=attention.wk.out_features // head_dim,
            head_dim=head_dim, vocab_size=model.tok_embeddings.num_embeddings,
            qk_norm=attention.q_norm is not None, ffn_hidden=0,
        )
        if getattr(block, "is_moe", False):
            router = block.moe.router
            kw.update(num_experts=router.num_experts, top_k=router.top_k,
                      moe_hidden=block.moe.experts.w1.shape[1])
        else:
            kw.update(ffn_hidden=block.feed_forward.w1.out_features)
        return cls(**kw)

    @classmethod
    def from_args(cls, family, args) -> ModelShape:
        with torch.device("meta"):
            model = family.model_cls(dataclasses.replace(args, n_layers=1))
        return cls.from_model(model, n_layers=args.n_layers)


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes one device keeps from forward to backward for one micro-batch (analytic)."""

    per_block: int
    """Saved by one block under the AC mode."""
    blocks: int
    """All blocks."""
    outside: int
    """Outside the blocks: final norm, LM-head input, token ids/labels (+ TP/AC extras)."""
    loss: int
    """The fp32 log-probabilities cross entropy keeps ([tokens, vocab or vocab/tp])."""
    per_block_none: int
    """What one block would keep without AC (recomputed during its backward under AC)."""
    logits_transient: int
    """The log-softmax backward's fp32 gradient in and out, [tokens, vocab] each (on top of `loss`)."""

    @property
    def total(self) -> int:
        return self.blocks + self.outside + self.loss


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _moe_none_per_token(s: ModelShape) -> int:
    """Bytes per token one MoE block keeps without AC (tp = 1).

    Routed token copies in (gathered, bf16) and out (re-ordered, bf16): 4kd; grouped SwiGLU:
    gate, up, silu(gate), product: 8kF; router: two fp32 softmax outputs and the fp32 logits
    of the z-loss (12E), top-k indices + values + bf16 scores + sort indices (30k), sums (8).
    """
    k, e = s.top_k, s.num_experts
    return 4 * k * s.dim + 8 * k * s.moe_hidden + 12 * e + 30 * k + 8


def activation_bytes(shape: ModelShape, *, local_batch_size: int, seq_len: int, tp: int, ac_mode: str,
                     loss_parallel: bool) -> ActivationBytes:
    """Saved-for-backward bytes per device, bf16 compute, one micro-batch (see docs/planner.md).

    T = local_batch_size * seq_len tokens per micro-batch; with TP the residual stream and the
    norms hold T/tp tokens (sequence parallel) and the projections the full T with heads/hidden
    split by tp.
    """
    if ac_mode not in AC_MODES:
        raise ConfigError(f"activation_checkpoint.mode: {ac_mode!r}; allowed: {', '.join(AC_MODES)}")
    s = shape
    d, hd = s.dim, s.head_dim
    t_full = local_batch_size * seq_len
    t_seq = t_full // tp  # sequence-parallel tokens (seq_len divides by tp: checked by ParallelDims)
    heads, kv_heads = s.n_heads // tp, s.n_kv_heads // tp
    norm = 6 * d + 4  # RMSNorm: fp32 copy of its input, fp32 rsqrt, bf16 normalized value

    # -- no AC. The inputs of the attention and FFN in-projections hold the full sequence
    # (TP all-gathers it; without TP it is the norm's output).
    none = 2 * norm * t_seq + 2 * (2 * d) * t_full
    attention = 8 * heads * hd + 4 * heads  # q, repeated k, repeated v, SDPA out (bf16), logsumexp (fp32)
    if s.qk_norm:  # per-head RMSNorm on q and k: fp32 copy, rsqrt, bf16 normalized
        attention += 6 * heads * hd + 4 * heads + 6 * kv_heads * hd + 4 * kv_heads
    none += attention * t_full
    if s.is_moe:
        assert tp == 1, "MoE blocks have no tensor-parallel plan"
        none += _moe_none_per_token(s) * t_full
    else:
        none += 8 * _cdiv(s.ffn_hidden, tp) * t_full  # w1 out, silu, w3 out, product (bf16)

    # -- per AC mode
    block_input = 2 * d * t_seq
    if ac_mode == "none":
        per_block = none
    elif ac_mode == "full":
        per_block = block_input
    else:  # selective: outputs of matmuls, attention and TP reduce-scatters
        saved = 2 * heads * hd + 4 * kv_heads * hd + 2 * d  # wq, wk, wv, wo (partial sums, full seq)
        saved += 2 * heads * hd + 4 * heads  # SDPA out + logsumexp
        if s.is_moe:  # router logits, grouped gate/up/down outputs
            saved += 2 * s.num_experts + s.top_k * (4 * s.moe_hidden + 2 * d)
        else:
            saved += 4 * _cdiv(s.ffn_hidden, tp) + 2 * d  # w1, w3, w2
        per_block = block_input + saved * t_full + (2 * 2 * d * t_seq if tp > 1 else 0)

    # -- outside the blocks
    outside = norm * t_seq + 2 * d * t_full + 8 * t_full  # final norm, LM-head input, labels
    if tp > 1:
        outside += 8 * t_full  # vocab-sharded embedding keeps its masked token ids
        if ac_mode != "none":
            outside += 2 * d * t_seq  # measured: the embedding's waited reduce-scatter output stays referenced
    vocab = _cdiv(s.vocab_size, tp) if (loss_parallel and tp > 1) else s.vocab_size
    loss = 4 * t_full * vocab
    return ActivationBytes(per_block=per_block, blocks=per_block * s.n_layers, outside=outside, loss=loss,
                           per_block_none=none, logits_transient=8 * t_full * vocab)


# =============================================================================== measurement


def measure_saved_bytes(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, *,
                        loss_parallel: bool = False) -> int:
    """Bytes of the tensors a real forward + loss leaves alive for backward (CPU, real data).

    Every tensor an op creates during the forward is recorded (a TorchDispatchMode); after
    the forward, a storage still referenced by someone other than the recorder is kept by
    autograd (saved tensors, checkpoint inputs, SAC caches). Parameters and buffers are
    excluded; the bf16 weight copies SimpleFSDP makes and the backward keeps are included.
    """
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from parallelisms.tensor_parallel import loss_parallel_context
    from trainer.step import lm_loss

    class _Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.storages: dict[int, torch.UntypedStorage] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, DTensor):
                    t = t._local_tensor
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    storage = t.untyped_storage()
                    self.storages.setdefault(storage._cdata, storage)
            return out

    owned = {_local(t).untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    recorder = _Recorder()
    with recorder:
        logits = model(tokens)
        with loss_parallel_context(loss_parallel):
            loss = lm_loss(logits, labels)
    del logits
    gc.collect()
    total = 0
    for key, storage in recorder.storages.items():
        # Use count 1 = only the recorder holds it: the tensor would have been freed.
        if key not in owned and torch._C._storage_Use_Count(storage._cdata) > 1:
            total += storage.nbytes()
    del loss
    return total


# =============================================================================== estimate


@dataclass
class Estimate:
    """Per-device memory (bytes) and throughput estimate of one plan on one target."""

    model: str
    target: Target
    n_layers: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    ac_mode: str
    local_batch_size: int
    seq_len: int
    grad_accum: int
    loss_parallel: bool
    params: int
    grads: int
    optimizer: int
    saved_weights: int
    activations: ActivationBytes
    transient_loss: int
    transient_block: int
    headroom: float
    assumed_mfu: float
    flops_per_token: float
    recompute_factor: float
    fsdp_min_tokens: int | None
    probed: bool = False
    notes: list[str] = field(default_factory=list)

    # -- memory
    @property
    def transient(self) -> int:
        return max(self.transient_loss, self.transient_block)

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.saved_weights + self.activations.total
                + self.transient)

    @property
    def usable(self) -> int:
        return int(self.target.hbm_bytes * (1.0 - self.headroom))

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    @property
    def spare(self) -> int:
        return self.usable - self.total

    # -- throughput
    @property
    def tokens_per_device_step(self) -> float:
        """Tokens per optimizer step per device (TP ranks share their dp rank's tokens)."""
        return self.local_batch_size * self.seq_len * self.grad_accum / self.tp

    @property
    def step_time_s(self) -> float:
        flops = self.tokens_per_device_step * self.flops_per_token * self.recompute_factor
        return flops / (self.target.peak_flops * self.assumed_mfu)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_device_step / self.step_time_s

    @property
    def mfu(self) -> float:
        return self.assumed_mfu / self.recompute_factor

    @property
    def global_batch_tokens(self) -> int:
        return self.local_batch_size * self.seq_len * self.grad_accum * self.dp_replicate * self.dp_shard

    @property
    def fsdp_bound(self) -> bool:
        """True when a micro-batch is too small to hide FSDP's all-gathers (see GENERATIONS)."""
        if self.fsdp_min_tokens is None or self.dp_shard == 1:
            return False
        return self.local_batch_size * self.seq_len < self.fsdp_min_tokens

    def plan_str(self) -> str:
        ep = f" x ep {self.ep}" if self.ep > 1 else ""
        return (f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x tp {self.tp}{ep}, AC {self.ac_mode}, "
                f"local batch {self.local_batch_size} x seq {self.seq_len}"
                + (f" x accum {self.grad_accum}" if self.grad_accum > 1 else "")
                + (", loss parallel" if self.loss_parallel and self.tp > 1 else ""))


RECOMPUTE_FACTOR = {"none": 1.0, "selective": 1.0, "full": 4.0 / 3.0}
"""Hardware FLOPs / model FLOPs: full AC repeats the forward (2 of the 6 FLOPs per param per
token); selective AC recomputes only pointwise ops, norms and all-gathers (no matmuls)."""


def estimate(*, model: str, target: Target, shape: ModelShape, stats: ShardStats, parallel_dims,
             local_batch_size: int, seq_len: int, ac_mode: str, loss_parallel: bool,
             flops_per_token: float, grad_accum: int = 1, headroom: float = 0.1,
             assumed_mfu: float = 0.4) -> Estimate:
    """Combine the real shard sizes with the activation model (see the module docstring)."""
    tp = parallel_dims.tp
    loss_parallel = loss_parallel and tp > 1
    acts = activation_bytes(shape, local_batch_size=local_batch_size, seq_len=seq_len, tp=tp,
                            ac_mode=ac_mode, loss_parallel=loss_parallel)
    local = stats.param_numel
    # Weights the backward needs in bf16: SimpleFSDP gathers (or casts) a weight where it is
    # used and the matmul keeps that copy, unless AC recomputes the block. The LM head and
    # the final norm sit outside the checkpointed blocks, so their copies are always kept.
    kept = stats.lm_head_gathered_numel + stats.root_gathered.get("norm.weight", 0)
    if ac_mode == "none":
        kept += stats.block_gathered_numel * stats.n_layers
    # Transients. Loss: see below. Block backward under AC: the recompute
    # re-gathers the whole block's bf16 weights and re-creates its activations; in every mode
    # one weight gradient at a time exists unsharded (bf16 + fp32 copy for the reduce-scatter,
    # each parameter's gradient is reduced as soon as autograd produces it), plus the
    # gradients of the two all-gathered projection inputs.
    head = stats.lm_head_gathered_numel
    # Two phases: log-softmax backward (fp32 logits gradient in and out, log-probs still kept),
    # then the LM head backward (bf16 logits gradient + weight gradient; log-probs freed).
    transient_loss = max(acts.logits_transient, 6 * head + acts.logits_transient // 4 - acts.loss)
    recompute = {"none": 0, "full": acts.per_block_none,
                 "selective": max(0, acts.per_block_none - acts.per_block)}[ac_mode]
    regather = 2 * stats.block_gathered_numel if ac_mode != "none" else 0
    t_proj = local_batch_size * seq_len
    transient_block = (regather + recompute + 6 * stats.largest_block_param_gathered
                       + 2 * (2 * shape.dim * t_proj))
    sparsity = shape.num_experts / shape.top_k if shape.is_moe else 1
    gen = target.generation
    est = Estimate(
        model=model, target=target, n_layers=shape.n_layers, dp_replicate=parallel_dims.dp_replicate, dp_shard=parallel_dims.dp_shard,
        tp=tp, ep=parallel_dims.ep, ac_mode=ac_mode, local_batch_size=local_batch_size, seq_len=seq_len,
        grad_accum=grad_accum, loss_parallel=loss_parallel,
        params=4 * local, grads=4 * local, optimizer=8 * local, saved_weights=2 * kept, activations=acts,
        transient_loss=transient_loss, transient_block=transient_block, headroom=headroom,
        assumed_mfu=assumed_mfu, flops_per_token=flops_per_token, recompute_factor=RECOMPUTE_FACTOR[ac_mode],
        fsdp_min_tokens=int(gen.fsdp_min_tokens * sparsity) if gen.fsdp_min_tokens else None,
        probed=stats.probed,
    )
    if tp > gen.devices_per_host:
        est.notes.append(f"tp {tp} spans more than one host ({gen.devices_per_host} devices per host): "
                         "TP collectives would leave the host's fastest links")
    if parallel_dims.ep > 1:
        est.notes.append("expert parallelism: the all-to-all token buffers are not modelled")
    if est.fsdp_bound:
        est.notes.append(f"{local_batch_size * seq_len} tokens per micro-batch is below the ~{est.fsdp_min_tokens} "
                         f"that hide FSDP's all-gathers on {gen.name}: expect exposed communication")
    return est


# =============================================================================== plans


@dataclass(frozen=True)
class PlanInputs:
    """What a plan needs besides the degrees: the model and the batch."""

    family: object
    args: object
    model_name: str
    seq_len: int
    local_batch_size: int
    grad_accum: int = 1


def model_flops_per_token(args, shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token, PaLM convention (trainer/flops.py)."""
    return flops_per_token(num_matmul_params=args.num_active_params(exclude_embedding=True),
                           n_layers=shape.n_layers, n_heads=shape.n_heads, head_dim=shape.head_dim,
                           seq_len=seq_len)["palm"]


def make_parallel_dims(*, dp_replicate: int, dp_shard: int, tp: int, ep: int, world_size: int,
                       args, shape: ModelShape, seq_len: int, plan=None):
    """Validated `ParallelDims` (ConfigError naming the key if the degrees cannot work)."""
    from parallelisms.parallel_dims import ParallelDims

    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, ep=ep, world_size=world_size)
    dims.validate_for_model(args.shape(), seq_len=seq_len)
    if shape.is_moe and tp > 1:
        # The trainer runs MoE x TP (experts on the EP mesh, attention TP-sharded), but this
        # planner's activation model covers MoE blocks at tp = 1 only.
        raise ConfigError(
            f"parallelism.tensor_parallel_degree: {tp}: the planner models MoE models at tp = 1 only "
            "(use expert_parallel_degree and data-parallel degrees); allowed: 1"
        )
    return dims


def plan_estimate(inputs: PlanInputs, target: Target, *, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1,
                  ep: int = 1, ac_mode: str = "none", loss_parallel: bool = False, headroom: float = 0.1,
                  assumed_mfu: float = 0.4, probe: bool = False) -> Estimate:
    """Estimate one explicit plan: validate, shard the real model on a fake world, add activations."""
    shape = ModelShape.from_args(inputs.family, inputs.args)
    plan = load_plan(inputs.family)
    dims = make_parallel_dims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, ep=ep,
                              world_size=target.devices, args=inputs.args, shape=shape, seq_len=inputs.seq_len, plan=plan)
    with fake_process_group(target.devices):
        stats = shard_model(inputs.family, inputs.args, dims, probe=probe)
    return estimate(model=inputs.model_name, target=target, shape=shape, stats=stats, parallel_dims=dims,
                    local_batch_size=inputs.local_batch_size, seq_len=inputs.seq_len, ac_mode=ac_mode,
                    loss_parallel=loss_parallel, grad_accum=inputs.grad_accum, headroom=headroom,
                    assumed_mfu=assumed_mfu, flops_per_token=model_flops_per_token(inputs.args, shape, inputs.seq_len))


def _powers_of_two_dividing(n: int, limit: int) -> list[int]:
    return [v for v in (2**i for i in range(0, 31)) if v <= limit and n % v == 0]


def preference_key(est: Estimate) -> tuple:
    """Smaller is better; documented in docs/planner.md ("How --recommend chooses").

    1. micro-batches big enough to hide FSDP's all-gathers on this generation;
    2. the smallest TP degree (TP puts activation collectives on every layer's critical path,
       FSDP's weight gathers overlap with compute): pure FSDP first, then add TP;
    3. the least recompute: none, then selective, then full;
    4. the most tokens per device per step (amortizes the per-step FSDP traffic);
    5. the fewest replicas (HSDP only when it costs nothing else).
    """
    return (est.fsdp_bound, est.tp, AC_MODES.index(est.ac_mode), -est.tokens_per_device_step, est.dp_replicate)


def recommend(inputs: PlanInputs, target: Target, *, headroom: float = 0.1, assumed_mfu: float = 0.4,
              max_global_tokens: int = 16 * 2**20, max_local_batch: int = 64,
              tp_choices: list[int] | None = None, ac_modes: tuple[str, ...] = AC_MODES,
              dp_replicate_choices: list[int] | None = None) -> list[Estimate]:
    """Search dp_replicate, tp (<= devices per host), AC mode and local batch for `target`.

    Returns every candidate evaluated (fitting or not), best first by `preference_key` among
    those that fit. Shard sizes come from the real plan applied to a one-block copy (exact:
    blocks are identical); `plan_estimate(..., probe=False)` re-checks a choice on the full model.
    """
    shape = ModelShape.from_args(inputs.family, inputs.args)
    plan = load_plan(inputs.family)
    world = target.devices
    tps = tp_choices or _powers_of_two_dividing(world, target.generation.devices_per_host)
    fpt = model_flops_per_token(inputs.args, shape, inputs.seq_len)
    candidates: list[Estimate] = []
    with fake_process_group(world):
        for tp in tps:
            for dp_replicate in dp_replicate_choices or _powers_of_two_dividing(world // tp, world // tp):
                try:
                    dims = make_parallel_dims(dp_replicate=dp_replicate, dp_shard=-1, tp=tp, ep=1, world_size=world,
                                              args=inputs.args, shape=shape, seq_len=inputs.seq_len, plan=plan)
                except ConfigError:
                    continue  # this tp does not divide the model's heads / hidden sizes / seq_len
                stats = shard_model(inputs.family, inputs.args, dims, probe=True)
                dp = dims.dp_degree
                batches = [b for b in (2**i for i in range(0, 12)) if b <= max_local_batch
                           and (b == 1 or b * inputs.seq_len * dp <= max_global_tokens)]
                for ac_mode in ac_modes:
                    for batch in batches:
                        candidates.append(estimate(
                            model=inputs.model_name, target=target, shape=shape, stats=stats, parallel_dims=dims,
                            local_batch_size=batch, seq_len=inputs.seq_len, ac_mode=ac_mode, loss_parallel=tp > 1,
                            flops_per_token=fpt, headroom=headroom, assumed_mfu=assumed_mfu))
    fitting = sorted((c for c in candidates if c.fits), key=preference_key)
    rest = sorted((c for c in candidates if not c.fits), key=lambda c: c.total)
    return fitting + rest


def suggest_fixes(inputs: PlanInputs, est: Estimate, *, limit: int = 4) -> list[str]:
    """For a plan that does not fit: single changes that would fit, then the best plan overall.

    Tries the other AC modes, smaller local batches, larger TP (up to a host) with loss
    parallel, and loss parallel alone; then runs `recommend` for the target.
    """
    target = est.target
    kw = dict(headroom=est.headroom, assumed_mfu=est.assumed_mfu)
    host = target.generation.devices_per_host
    tps = sorted({est.tp, *(t for t in (2 * est.tp, 4 * est.tp) if t <= host)})
    near = recommend(dataclasses.replace(inputs, local_batch_size=est.local_batch_size), target,
                     tp_choices=tps, dp_replicate_choices=[est.dp_replicate], max_local_batch=est.local_batch_size,
                     **kw)
    out: list[str] = []

    def describe(c: Estimate) -> str:
        changes = []
        if c.ac_mode != est.ac_mode:
            changes.append(f"activation_checkpoint.mode = {c.ac_mode}")
        if c.local_batch_size != est.local_batch_size:
            changes.append(f"training.local_batch_size = {c.local_batch_size}")
        if c.tp != est.tp:
            changes.append(f"parallelism.tensor_parallel_degree = {c.tp}")
        if c.loss_parallel != est.loss_parallel:
            changes.append("parallelism.enable_loss_parallel = true")
        return f"{', '.join(changes)}: {gib(c.total)} GiB (fits)"

    for c in near:
        if not c.fits or len(out) >= limit:
            continue
        changed = [c.ac_mode != est.ac_mode, c.local_batch_size != est.local_batch_size, c.tp != est.tp]
        if sum(changed) == 1 or (sum(changed) == 0 and c.loss_parallel != est.loss_parallel):
            out.append(describe(c))
    everything = recommend(inputs, target, **kw)
    if everything and everything[0].fits:
        best = everything[0]
        out.append(f"the planner's choice for {target.name} (--recommend): {best.plan_str()}: {gib(best.total)} GiB")
        return out
    needs = [(n, preference_key(c), c) for c in everything if (n := devices_needed(c))]
    if needs:
        n, _, c = min(needs, key=lambda x: x[:2])
        out.append(f"no plan fits {target.name}; about {n} devices would fit {c.plan_str()} "
                   f"(its parameters, gradients and optimizer state shrink with more FSDP shards)")
    else:
        out.append(f"no plan fits {target.name}, and more devices would not help: activations alone exceed HBM; "
                   "shorten training.seq_len")
    return out


def best_per_layout(estimates: list[Estimate]) -> list[Estimate]:
    """The first (best) estimate of each (tp, AC mode), in the given order."""
    seen, out = set(), []
    for est in estimates:
        key = (est.tp, est.ac_mode)
        if key not in seen:
            seen.add(key)
            out.append(est)
    return out


def devices_needed(est: Estimate) -> int:
    """Smallest power-of-two device count at which this plan's memory would fit.

    Parameters, gradients and optimizer state shrink with the number of dp shards; activations
    and the gathered bf16 weights per device do not.
    """
    sharded = est.params + est.grads + est.optimizer
    fixed = est.total - sharded
    if fixed >= est.usable:
        return 0  # activations alone do not fit: more devices do not help
    need = sharded * est.target.devices / (est.usable - fixed)
    return 2 ** math.ceil(math.log2(max(need, 1)))


# =============================================================================== output


def gib(n: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / GiB:.2f}"


def format_estimate(est: Estimate) -> str:
    """A per-device breakdown with the verdict."""
    a = est.activations
    lines = [
        f"{est.model} on {est.target.describe()}",
        f"plan: {est.plan_str()}",
        "per device (rank 0)" + (" [blocks probed: 1 block x n_layers]" if est.probed else "") + ":",
    ]
    rows = [
        ("parameters (fp32 master shards)", est.params),
        ("gradients (fp32 shards)", est.grads),
        ("optimizer state (AdamW exp_avg + exp_avg_sq, fp32)", est.optimizer),
        ("bf16 weights kept for backward (SimpleFSDP gathers)", est.saved_weights),
        (f"activations: blocks ({est.n_layers} x {gib(a.per_block)} GiB, AC {est.ac_mode})", a.blocks),
        ("activations: final norm, LM-head input, token ids", a.outside),
        (f"loss: fp32 log-probs ({'vocab/tp' if est.loss_parallel else 'full vocab'})", a.loss),
        (f"transient peak (max of loss/LM head {gib(est.transient_loss)}, block backward "
         f"{gib(est.transient_block)})", est.transient),
    ]
    width = max(len(r[0]) for r in rows) + 2
    for label, value in rows:
        lines.append(f"  {label:<{width}}{gib(value):>9} GiB")
    lines.append(f"  {'total':<{width}}{gib(est.total):>9} GiB")
    lines.append(f"  {'HBM / usable (' + format(est.headroom, '.0%') + ' headroom)':<{width}}"
                 f"{gib(est.target.hbm_bytes):>9} / {gib(est.usable)} GiB")
    if est.fits:
        lines.append(f"verdict: FITS with {gib(est.spare)} GiB to spare "
                     f"({est.total / est.target.hbm_bytes:.0%} of HBM)")
    else:
        over = -est.spare
        lines.append(f"verdict: DOES NOT FIT: needs {gib(est.total)} GiB, usable {gib(est.usable)} GiB; "
                     f"over by {gib(over)} GiB ({over / est.usable:.0%})")
    lines.append(
        f"throughput (estimate): {est.tokens_per_device_step:,.0f} tokens/device/step, global batch "
        f"{est.global_batch_tokens:,} tokens; step {est.step_time_s:.2f} s at an assumed "
        f"{est.assumed_mfu:.0%} MFU without recompute"
        + (f" (x{est.recompute_factor:.2f} FLOPs for AC {est.ac_mode}: MFU {est.mfu:.0%})"
           if est.recompute_factor != 1.0 else "")
        + f" -> {est.tokens_per_s:,.0f} tokens/s/device"
    )
    lines.extend(f"note: {n}" for n in est.notes)
    return "\n".join(lines)


SUMMARY_HEADER = ("dp_rep  dp_shard  tp  AC         batch  tok/dev/step   params+opt  kept-wts  activ.  "
                  "transient  total GiB  fits  step s  tok/s/dev")


def format_summary_row(est: Estimate) -> str:
    static = est.params + est.grads + est.optimizer
    return (f"{est.dp_replicate:>6}  {est.dp_shard:>8}  {est.tp:>2}  {est.ac_mode:<9}  {est.local_batch_size:>5}  "
            f"{est.tokens_per_device_step:>12,.0f}  {gib(static):>10}  {gib(est.saved_weights):>8}  "
            f"{gib(est.activations.total):>6}  {gib(est.transient):>9}  {gib(est.total):>9}  "
            f"{'yes' if est.fits else 'NO':>4}  {est.step_time_s:>6.2f}  {est.tokens_per_s:>9,.0f}")


def format_summary(estimates: list[Estimate]) -> str:
    return "\n".join([SUMMARY_HEADER, *(format_summary_row(e) for e in estimates)])


CSV_FIELDS = (
    "model", "target", "devices", "hbm_bytes", "dp_replicate", "dp_shard", "tp", "ep", "ac_mode",
    "local_batch_size", "seq_len", "grad_accum", "loss_parallel", "params_bytes", "grads_bytes",
    "optimizer_bytes", "saved_weights_bytes", "block_activation_bytes", "outside_activation_bytes",
    "loss_bytes", "transient_bytes", "total_bytes", "usable_bytes", "fits", "tokens_per_device_step",
    "global_batch_tokens", "est_step_s", "est_tokens_per_s_per_device", "est_mfu_pct", "assumed_mfu_pct",
)


def csv_row(est: Estimate) -> dict:
    a = est.activations
    return {
        "model": est.model, "target": est.target.name, "devices": est.target.devices,
        "hbm_bytes": est.target.hbm_bytes, "dp_replicate": est.dp_replicate, "dp_shard": est.dp_shard,
        "tp": est.tp, "ep": est.ep, "ac_mode": est.ac_mode, "local_batch_size": est.local_batch_size,
        "seq_len": est.seq_len, "grad_accum": est.grad_accum, "loss_parallel": est.loss_parallel,
        "params_bytes": est.params, "grads_bytes": est.grads, "optimizer_bytes": est.optimizer,
        "saved_weights_bytes": est.saved_weights, "block_activation_bytes": a.blocks,
        "outside_activation_bytes": a.outside, "loss_bytes": a.loss, "transient_bytes": est.transient,
        "total_bytes": est.total, "usable_bytes": est.usable, "fits": est.fits,
        "tokens_per_device_step": round(est.tokens_per_device_step, 3),
        "global_batch_tokens": est.global_batch_tokens, "est_step_s": round(est.step_time_s, 4),
        "est_tokens_per_s_per_device": round(est.tokens_per_s, 1), "est_mfu_pct": round(100 * est.mfu, 2),
        "assumed_mfu_pct": round(100 * est.assumed_mfu, 2),
    }


def write_csv(estimates: list[Estimate], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for est in estimates:
            writer.writerow(csv_row(est))


def recipe_snippet(est: Estimate) -> str:
    """The recipe keys that select this plan."""
    return "\n".join([
        "[training]",
        f"local_batch_size = {est.local_batch_size}",
        f"seq_len = {est.seq_len}",
        "[parallelism]",
        f"data_parallel_replicate_degree = {est.dp_replicate}",
        f"data_parallel_shard_degree = {est.dp_shard}",
        f"tensor_parallel_degree = {est.tp}",
        f"enable_loss_parallel = {'true' if est.loss_parallel else 'false'}",
        "[activation_checkpoint]",
        f'mode = "{est.ac_mode}"',
    ])
