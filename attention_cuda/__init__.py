"""Fused attention kernels (cosine-sim, exp, fastmax) with pure-PyTorch references.

    from attention_cuda import cosine_sim_attention, fastmax_attention, exp_attention
"""
from .fastmax_module import FastMultiHeadAttention
from .functional import (cosine_sim_attention, cuda_unavailable_reason, exp_attention, fastmax_attention,
                         fastmax_moments, fastmax_read, plan, rotary_qkv)
from .plan import TUNING, Plan, Tuning

__all__ = ["cosine_sim_attention", "fastmax_attention", "fastmax_moments", "fastmax_read", "exp_attention",
           "rotary_qkv",
           "FastMultiHeadAttention",
           "cuda_unavailable_reason", "plan", "Plan", "Tuning", "TUNING"]
