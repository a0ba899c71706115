"""Fused attention kernels (cosine-sim, exp, fastmax) with pure-PyTorch references.

    from attention_cuda import cosine_sim_attention, fastmax_attention, exp_attention
"""
from .fastmax_module import FastMultiHeadAttention
from .functional import (cosine_sim_attention, cuda_unavailable_reason, exp_attention, fastmax_attention,
                         fastmax_moments, fastmax_read, plan, rotary_qkv, score_policy)
from .plan import TUNING, Plan, Tuning, fastmax_features
from .reference import attention_weights
from .score import ScorePolicy

__all__ = ["cosine_sim_attention", "fastmax_attention", "fastmax_moments", "fastmax_read", "exp_attention",
           "rotary_qkv", "attention_weights",
           "FastMultiHeadAttention",
           "cuda_unavailable_reason", "plan", "Plan", "Tuning", "TUNING", "ScorePolicy", "score_policy",
           "fastmax_features"]
