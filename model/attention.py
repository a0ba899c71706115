"""Causal self-attention with RoPE, switchable between softmax, cosine-sim and fastmax.

Softmax runs through PyTorch's fused SDPA kernels; cosine-sim and fastmax through the project's
functional API (attention_cuda), on its CUDA kernels with ``use_cuda_kernel`` and on the pure-PyTorch
reference otherwise. RoPE rotates q and k *before* the attention sees them, so cosine's l2-norm and
fastmax's optional ``normalize`` act on the rotated vectors (a rotation keeps norms, so they commute
with it anyway, and position enters only through q.k as it does for softmax).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention_cuda import cosine_sim_attention, fastmax_attention
from attention_cuda.functional import fastmax_flops_crossover, fastmax_linear_from


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, (seq_len, head_dim / 2) in fp32."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i + D/2}) of x (B, H, T, D) by position-dependent angles (T, D/2).

    Computed in fp32 so that under bf16 autocast the relative-position property holds to fp32
    precision, then cast back.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def attention_fn(cfg):
    """q (B, H, T, D), k/v (B, Hkv, T, D) -> (B, H, T, D), causal, for the family cfg.attention names."""
    if cfg.attention == "softmax":
        return functools.partial(F.scaled_dot_product_attention, is_causal=True,
                                 enable_gqa=cfg.n_kv_head != cfg.n_head)
    backend = "cuda" if cfg.use_cuda_kernel else "torch"
    if cfg.attention == "cosine":
        return functools.partial(cosine_sim_attention, causal=True, scale=cfg.cosine_scale, backend=backend)
    return functools.partial(fastmax_attention, causal=True, p=cfg.fastmax_p, a0=cfg.fastmax_a0,
                             a1=cfg.fastmax_a1, a2=cfg.fastmax_a2, temperature=cfg.fastmax_temperature,
                             normalize=cfg.fastmax_normalize, lim=cfg.fastmax_lim, backend=backend)


def attention_flops_per_token(cfg) -> int:
    """Training FLOPs (forward + backward = 3x forward) per token spent inside attention, all layers.

    Counted per layer and head, with D the head dim and T = seq_len:
    - softmax, cosine and fastmax in its quadratic form: q.k^T and the weighted sum of v are
      2·D FLOPs each per (query, key) pair, so 4·D·T forward and 12·D·T for training per token
      (the 12·L·H·D·T of the nanoGPT/PaLM count), halved for causal: 6·D·T.
    - fastmax in its linear form (what attention_cuda runs from fastmax_linear_from's key count: the
      PyTorch reference once T exceeds the feature count F = 1 + D (+ D(D+1)/2 for p = 2), the kernels
      from the crossover measured per head dim): each token adds phi(k) [v, 1]^T to the moments and
      reads phi(q) against them, 2·F·(D+1) FLOPs each, so 4·F·(D+1) forward and 12·F·(D+1) for training.
      Causal does not halve it; the small in-chunk band done quadratically is left out.
    The element-wise score function (exp, the polynomial) is not counted, as the convention goes.
    """
    head_dim = cfg.head_dim
    features = fastmax_flops_crossover(head_dim, cfg.fastmax_p)  # F: the feature count
    linear_from = fastmax_linear_from(head_dim, cfg.fastmax_p, cfg.use_cuda_kernel)
    if cfg.attention == "fastmax" and cfg.seq_len >= linear_from:
        per_head = 12 * features * (head_dim + 1)
    else:
        per_head = 6 * head_dim * cfg.seq_len
    return cfg.n_layer * cfg.n_head * per_head


class CausalSelfAttention(nn.Module):
    """Grouped-KV self-attention: n_head query heads share n_kv_head key/value heads."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.head_dim
        q_dim, kv_dim = cfg.n_head * self.head_dim, cfg.n_kv_head * self.head_dim
        self.qkv = nn.Linear(cfg.n_embd, q_dim + 2 * kv_dim, bias=False)
        self.proj = nn.Linear(q_dim, cfg.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.split = (q_dim, kv_dim, kv_dim)
        # No dropout on the attention weights: the cosine API has none, and the three families
        # should be regularised alike for a fair comparison.
        self.attend = attention_fn(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attend(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.proj(y))
