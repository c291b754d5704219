"""Qwen 3 dense (0.6B-32B) and MoE (30B-A3B, 235B-A22B), one `Transformer` switched by `num_experts`."""

from models.qwen3.args import FLAVORS, Qwen3Args
from models.qwen3.model import Transformer

__all__ = ["FLAVORS", "Qwen3Args", "Transformer"]
