"""Qwen 3.5 dense and MoE: Gated DeltaNet linear attention in three of four blocks, gated full attention in the fourth."""

from models.qwen3_5.args import FLAVORS, Qwen3_5Args
from models.qwen3_5.model import Qwen3_5Transformer

__all__ = ["FLAVORS", "Qwen3_5Args", "Qwen3_5Transformer"]
