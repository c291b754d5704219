"""Building blocks shared by every model family: RMSNorm, RoPE, attention, SwiGLU, MoE, the decoder."""
