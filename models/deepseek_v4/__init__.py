"""DeepSeek-V4: mHC streams, sliding-window + compressed sparse (CSA) / heavily compressed (HCA)
shared-KV sink attention, hash- and top-k-routed MoE with a shared expert."""

from models.deepseek_v4.args import FLAVORS, DeepSeekV4Args
from models.deepseek_v4.model import DeepSeekV4

__all__ = ["FLAVORS", "DeepSeekV4", "DeepSeekV4Args"]
