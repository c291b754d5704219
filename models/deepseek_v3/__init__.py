"""DeepSeek-V3 family: MLA attention with YaRN, DeepSeek MoE (shared experts, sigmoid group-limited
routing, auxiliary-loss-free balancing); flavors debugmodel, 16B (V2-Lite sizes), 671B (V3), kimi_k2."""

from models.deepseek_v3.args import FLAVORS, DeepSeekV3Args
from models.deepseek_v3.model import DeepSeekV3

__all__ = ["FLAVORS", "DeepSeekV3", "DeepSeekV3Args"]
