"""The LM task: next-token prediction on packed token windows (trainer/data/text.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.common.rope import document_positions
from models.errors import ConfigError
from trainer.data import build_dataloader, build_tokenizer
from trainer.runtime.device import gather_objects
from trainer.runtime.flops import flops_per_token


class LMTask:
    """Next-token prediction on packed token windows (trainer/data/text.py)."""

    name = "lm"
    unit = "tokens"

    @staticmethod
    def seq_len_to_divide(training) -> int:
        """The sequence length the parallel degrees must divide: the LM's windows."""
        return training.seq_len

    def __init__(self, cfg, *, args):
        self.cfg = cfg
        self.args = args
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
        with `document_positions = "restart"`, the per-document RoPE positions after them."""
        batch = tuple(batch)
        if self.cfg.training.document_mask and self.cfg.training.document_positions == "restart":
            batch = (*batch, document_positions(batch[2]))
        return batch

    def loss_fn(self, step_plan) -> Callable:
        return step_plan.lm_loss

    def example_batch(self, local_batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """A micro-batch of the shapes and dtypes `prepare` returns (the recipe check captures with it)."""
        ids = torch.zeros(local_batch_size, self.cfg.training.seq_len, dtype=torch.long, device=device)
        t = self.cfg.training
        if not t.document_mask:
            return ids, ids.clone()
        segment_ids = torch.zeros_like(ids, dtype=torch.int32)
        if t.document_positions == "restart":
            return ids, ids.clone(), segment_ids, segment_ids.clone()
        return ids, ids.clone(), segment_ids

    def sample_grid(self, model) -> None:
        return None

    def flops_per_unit(self) -> dict[str, float]:
        shape = self.args.shape()
        return flops_per_token(num_matmul_params=self.args.num_active_params(exclude_embedding=True),
                               n_layers=shape.n_layers, n_heads=shape.n_heads, head_dim=shape.head_dim,
                               seq_len=self.cfg.training.seq_len)
