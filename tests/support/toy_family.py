"""A model family defined outside `models/`: the proof that the model contract is enough.

`ParallelLM` is a decoder of *parallel* blocks (GPT-J / PaLM style): one RMSNorm feeds both the
attention and a GELU MLP, and both add to the residual stream. Its layout differs from the
Llama 3 / Qwen 3 blocks (no second norm, a two-matrix GELU MLP named fc_in / fc_out), and its
plan, args and model are written here against `models/contract.py` only. The trainer reaches it
as `--model.name=tests.support.toy_family:TOY`; tests/e2e/test_new_family.py trains it with SimpleFSDP,
tensor parallelism and the graph trainer with layer scan, with no edit to `trainer/` or
`parallelisms/`. docs/adding_a_model.md walks through this file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models import ModelFamily
from models.common.attention import Attention
from models.common.init import trunc_normal_
from models.common.norm import RMSNorm
from models.common.plan import ModelPlan
from models.common.rope import RopeConfig
from models.common.stack import BlockStack
from models.contract import ModelShape


@dataclass
class ToyArgs:
    dim: int = 64
    """Residual-stream width."""
    n_layers: int = 2
    """Parallel blocks."""
    n_heads: int = 4
    """Attention heads (no grouped-query sharing)."""
    mlp_ratio: int = 4
    """GELU MLP width = mlp_ratio x dim."""
    vocab_size: int = 4096
    """Vocabulary (the bundled tokenizer has 4096 tokens)."""
    max_seq_len: int = 256
    """RoPE table length; the trainer sets it to training.seq_len."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def shape(self) -> ModelShape:
        return ModelShape(
            n_layers=self.n_layers,
            dim=self.dim,
            n_heads=self.n_heads,
            n_kv_heads=self.n_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            ffn_hidden=self.mlp_ratio * self.dim,
        )

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        d, h = self.dim, self.mlp_ratio * self.dim
        block = d + 4 * d * d + 2 * d * h  # norm, q/k/v/o, fc_in/fc_out
        total = self.vocab_size * d + self.n_layers * block + d + d * self.vocab_size
        return total - (self.vocab_size * d if exclude_embedding else 0)

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        return self.num_params(exclude_embedding=exclude_embedding)


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc_in = nn.Linear(dim, hidden, bias=False)
        self.fc_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


class ParallelBlock(nn.Module):
    """`h + attention(norm(h)) + mlp(norm(h))`."""

    def __init__(self, args: ToyArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.norm = RMSNorm(args.dim)
        self.attention = Attention(dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_heads, head_dim=args.head_dim)
        self.mlp = GeluMLP(args.dim, args.mlp_ratio * args.dim)

    def forward(self, h: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        return h + self.attention(x, rope_cos, rope_sin) + self.mlp(x)


class ParallelLM(nn.Module):
    """Embedding -> parallel blocks -> RMSNorm -> vocabulary projection."""

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.rope = RopeConfig(head_dim=args.head_dim, max_seq_len=args.max_seq_len, theta=args.rope_theta)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = BlockStack(ParallelBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = self.rope.cos_sin()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        h = self.layers(self.tok_embeddings(tokens), self.rope_cos[:seqlen], self.rope_sin[:seqlen])
        return self.output(self.norm(h))

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Embedding normal(0.02); q/k/v and fc_in trunc-normal(0.02); the residual outputs
        (attention.wo, mlp.fc_out) trunc-normal(0.02 / sqrt(2 n_layers)); norms ones; output
        trunc-normal(dim ** -0.5); RoPE tables rebuilt on `buffer_device`."""
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = self.rope.cos_sin(device)
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        out_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for block in self.layers.values():
            block.norm.init_weights()
            block.attention.init_weights(out_std)
            trunc_normal_(block.mlp.fc_in.weight, std=0.02)
            trunc_normal_(block.mlp.fc_out.weight, std=out_std)
        self.norm.init_weights()
        trunc_normal_(self.output.weight, std=self.args.dim**-0.5)

    def pop_aux_loss(self) -> torch.Tensor | None:
        return None


PLAN = ModelPlan(
    block="layers",
    tp={"tok_embeddings": "embedding", "norm": "sequence_parallel", "output": "output"},
    tp_block={
        "norm": "sequence_parallel",
        "attention": "block_input",
        "attention.wq": "colwise",
        "attention.wk": "colwise",
        "attention.wv": "colwise",
        "attention.wo": "rowwise",
        "mlp": "block_input",
        "mlp.fc_in": "colwise",
        "mlp.fc_out": "rowwise",
    },
)

TOY = ModelFamily(name="toy", args_cls=ToyArgs, flavors={"debugmodel": ToyArgs()}, model_cls=ParallelLM, plan=PLAN)
