"""Llama 3 (3.1 8B/70B/405B, 3.2 1B/3B) built from the shared decoder blocks in models/common."""

from models.llama3.args import FLAVORS, Llama3Args
from models.llama3.model import Transformer

__all__ = ["FLAVORS", "Llama3Args", "Transformer"]
