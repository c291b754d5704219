"""gpt-oss (20B, 120B): sink attention, alternating sliding-window / full layers, YaRN, biased top-4 MoE."""

from models.gpt_oss.args import FLAVORS, GptOssArgs
from models.gpt_oss.model import GptOssTransformer

__all__ = ["FLAVORS", "GptOssArgs", "GptOssTransformer"]
