"""The LM task: next-token prediction on packed token windows (trainer/data/text.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from models.common.ops import IGNORE_INDEX
from models.common.rope import document_positions
from models.errors import ConfigError
from parallelisms.context_parallel import CPGroup, shard_sequence
from trainer.data import build_dataloader, build_tokenizer
from trainer.runtime.device import gather_objects
from trainer.runtime.flops import flops_per_token


class LMTask:
    """Next-token prediction on packed token windows (trainer/data/text.py)."""

    name = "lm"
    unit = "tokens"
    restart_positions: bool = False
    """Micro-batches carry per-document RoPE positions (from the step plan; off without one)."""
    cp: CPGroup | None = None
    """The cp group when the windows are split over context-parallel ranks (given at construction):
    `prepare` returns this rank's load-balanced shard of every window and `loss_fn` divides the
    loss by the global token count (parallelisms/context_parallel.py)."""

    @staticmethod
    def seq_len_to_divide(training) -> int:
        """The sequence length the parallel degrees must divide: the LM's windows."""
        return training.seq_len

    def __init__(self, cfg, *, args, step_plan=None, compute_dtype=None, cp: CPGroup | None = None):
        self.cfg = cfg
        self.args = args
        self.cp = cp if cp is not None and cp.size > 1 else None
        # The step plan decodes `document_mask` / `document_positions` (without a plan: global positions).
        self.restart_positions = bool(step_plan is not None and step_plan.restart_positions)
        self.units_per_sample = cfg.training.seq_len
        self.tokenizer = build_tokenizer(cfg.model.tokenizer)
        if self.tokenizer.n_vocab > args.vocab_size:
            raise ConfigError(
                f"model.tokenizer: {cfg.model.tokenizer} has {self.tokenizer.n_vocab} tokens but the model's "
                f"vocab_size is {args.vocab_size}; set model.vocab_size >= {self.tokenizer.n_vocab}"
            )

    def build_loader(self, *, split: str, local_batch_size: int, dp_rank: int, dp_degree: int):
        t = self.cfg.training
        return build_dataloader(
            dataset=t.dataset if split == "train" else self.cfg.validation.dataset, tokenizer=self.tokenizer,
            seq_len=t.seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank, dp_degree=dp_degree,
            seed=t.seed, split=split, text_field=t.dataset_text_field, num_shards=t.dataset_shards,
            gather=gather_objects() if split == "train" else None, document_ids=t.document_mask,
        )

    def prepare(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(inputs, labels), or with `[training] document_mask` (inputs, labels, segment_ids) and,
        with `document_positions = "restart"`, the per-document RoPE positions after them.

        With context parallelism every tensor is this cp rank's shard (`shard_sequence`: chunks
        r and 2 cp - 1 - r of the window) and the RoPE positions always come last: the
        shard's global positions, or the restart-per-document positions of the whole window,
        sharded the same way (a document cut by a shard boundary keeps counting)."""
        batch = tuple(batch)
        restart = self.restart_positions
        if restart:
            batch = (*batch, document_positions(batch[2]))
        if self.cp is None:
            return batch
        rank, size = self.cp.rank, self.cp.size
        if not restart:  # global positions: position i of the window is i
            window = batch[0]
            batch = (*batch, torch.arange(window.shape[1], dtype=torch.int32, device=window.device)
                     .expand_as(window))
        return tuple(shard_sequence(x, 1, rank, size) for x in batch)

    def loss_fn(self, step_plan) -> Callable:
        if self.cp is None:
            return step_plan.lm_loss
        cp, document_mask = self.cp, step_plan.document_mask

        def cp_lm_loss(model, inputs, labels, *extra):
            """This rank's token sum x cp / the cp group's token count: SimpleFSDP's gradient
            mean over dp_shard x cp then gives each data-parallel group's mean over all its
            tokens, whatever number of labels each shard ignores; the mean of the logged
            per-rank values over cp is that group's mean loss."""
            segment_ids, positions = (extra[0], extra[1]) if document_mask else (None, extra[0])
            total = step_plan.lm_loss(model, inputs, labels, segment_ids, positions, reduction="sum")
            count = (labels != IGNORE_INDEX).sum().to(torch.float32)
            # A functional collective: traced into graph mode's one graph like the k/v gathers.
            scale = cp.size / funcol.all_reduce(count, "sum", cp.group)
            if isinstance(total, DTensor):  # loss parallel: a replicated DTensor over tp
                scale = DTensor.from_local(scale, total.device_mesh, total.placements, run_check=False)
            return total * scale

        return cp_lm_loss

    def example_batch(self, local_batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """A micro-batch of the shapes and dtypes `prepare` returns (the recipe check captures with it)."""
        ids = torch.zeros(local_batch_size, self.cfg.training.seq_len, dtype=torch.long, device=device)
        t = self.cfg.training
        if not t.document_mask:
            return self.prepare((ids, ids.clone()))
        return self.prepare((ids, ids.clone(), torch.zeros_like(ids, dtype=torch.int32)))

    def sample_grid(self, model) -> None:
        return None

    def flops_per_unit(self) -> dict[str, float]:
        shape = self.args.shape()
        return flops_per_token(num_matmul_params=self.args.num_active_params(exclude_embedding=True),
                               n_layers=shape.n_layers, n_heads=shape.n_heads, head_dim=shape.head_dim,
                               seq_len=self.cfg.training.seq_len)
