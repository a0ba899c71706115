"""Causal self-attention with RoPE, switchable between softmax, cosine-sim and fastmax.

Softmax runs through PyTorch's fused SDPA kernels; cosine-sim and fastmax through the project's
functional API (attention_cuda), on its CUDA kernels with ``use_cuda_kernel`` and on the pure-PyTorch
reference otherwise. RoPE rotates q and k *before* the attention sees them, so cosine's l2-norm and
fastmax's optional ``normalize`` act on the rotated vectors (a rotation keeps norms, so they commute
with it anyway, and position enters only through q.k as it does for softmax).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_cuda import cosine_sim_attention, fastmax_attention, fastmax_moments, fastmax_read, plan, rotary_qkv
from attention_cuda.plan import fastmax_features


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles of positions 0 .. seq_len - 1, (seq_len, head_dim / 2) in fp32."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


FUNCTIONS = {"cosine": cosine_sim_attention, "fastmax": fastmax_attention}
SDPA_NAMES = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def score_options(cfg) -> dict:
    """The score options of cfg's family (cosine or fastmax), by attention_cuda's names."""
    if cfg.attention == "cosine":
        return dict(scale=cfg.cosine_scale, l2norm_qk=True)
    return dict(p=cfg.fastmax_p, a0=cfg.fastmax_a0, a1=cfg.fastmax_a1, a2=cfg.fastmax_a2,
                temperature=cfg.fastmax_temperature, normalize=cfg.fastmax_normalize, lim=cfg.fastmax_lim)


def sdpa_attention(q, k, v, *, backend: str, causal: bool = True, scale: float | None = None,
                   normalize: bool = False, mask: torch.Tensor | None = None):
    """SDPA on one backend ("auto": PyTorch's pick); with normalize, on l2-normalised q and k, which is
    cosine-sim attention (softmax(scale l2norm(q) l2norm(k)^T) v) on PyTorch's kernels. mask: bool (B, J),
    True = keep, as attention_cuda's functions take it."""
    if normalize:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    with contextlib.nullcontext() if backend == "auto" else sdpa_kernel(getattr(SDPBackend, SDPA_NAMES[backend])):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              attn_mask=None if mask is None else mask[:, None, None, :],
                                              enable_gqa=q.shape[1] != k.shape[1])


def attention_fn(cfg, causal: bool = True, unit_rows: bool = False):
    """q (B, H, T, D), k/v (B, Hkv, J, D) -> (B, H, T, D) for the family cfg.attention names: causal over
    T = J (training, a prefill), or every query over every key (a decode step's one query over the cache).
    unit_rows (cosine): q and k arrive l2-normalised, as cosine's decode cache keeps its keys."""
    if cfg.attention == "softmax":
        return functools.partial(sdpa_attention, backend=cfg.sdpa_backend, causal=causal)
    if cfg.cosine_sdpa:
        return functools.partial(sdpa_attention, backend=cfg.sdpa_backend, causal=causal, scale=cfg.cosine_scale,
                                 normalize=not unit_rows)
    options = {**score_options(cfg), **({"l2norm_qk": False} if unit_rows else {})}
    return functools.partial(FUNCTIONS[cfg.attention], causal=causal, backend=kernel_backend(cfg), **options)


def kernel_backend(cfg) -> str:
    """attention_cuda's backend for the model's attention and its RoPE: our kernels with use_cuda_kernel, else
    the PyTorch reference (softmax and cosine on SDPA rotate with PyTorch ops, as such models do)."""
    return "cuda" if cfg.use_cuda_kernel else "torch"


def attention_plan(cfg, device, dtype: torch.dtype):
    """The plan attention_cuda resolves for the model's attention on device, in dtype (the training
    dtype: autocast's); None for attention on SDPA."""
    if cfg.attention == "softmax" or cfg.cosine_sdpa:
        return None
    return plan(cfg.attention, device=device, dtype=dtype, head_dim=cfg.head_dim, keys=cfg.seq_len,
                backend=kernel_backend(cfg),
                form="auto" if cfg.attention == "fastmax" else "quadratic", **score_options(cfg))


def attention_flops_per_token(cfg, device, dtype: torch.dtype) -> int:
    """Training FLOPs (forward + backward = 3x forward) per token spent inside attention, all layers.

    Counted per layer and head, with D the head dim and T = seq_len:
    - softmax, cosine and fastmax in its quadratic form: q.k^T and the weighted sum of v are
      2·D FLOPs each per (query, key) pair, so 4·D·T forward and 12·D·T for training per token
      (the 12·L·H·D·T of the nanoGPT/PaLM count), halved for causal: 6·D·T.
    - fastmax in its linear form (as attention_cuda's plan for this config says it runs): each token
      adds phi(k) [v, 1]^T to the moments and reads phi(q) against them, 2·F·(D+1) FLOPs each with F
      the feature count, so 4·F·(D+1) forward and 12·F·(D+1) for training. Causal does not halve it;
      the small in-chunk band done quadratically is left out.
    The element-wise score function (exp, the polynomial) is not counted, as the convention goes.
    """
    head_dim = cfg.head_dim
    attention = attention_plan(cfg, device, dtype)
    if attention is not None and attention.form == "linear":
        per_head = 12 * fastmax_features(head_dim, cfg.fastmax_p) * (head_dim + 1)
    else:
        per_head = 6 * head_dim * cfg.seq_len
    return cfg.n_layer * cfg.n_head * per_head


class KVCache:
    """One layer's rotated keys and values for decoding, the last ``capacity`` positions of them.

    A ring: position p lives in slot p % capacity. A decode step's single query weighs every cached key
    by its own score and sums, in whatever order the slots hold them, so the ring is never shifted; RoPE
    rotated each key at its absolute position, and q.k depends only on the distance between them.
    A step reads every slot, those not yet written hidden by a key mask, and takes its position from a
    device tensor: it launches the same work at every position, which a CUDA graph can replay (gpt-fast's
    static cache). With unit_rows (cosine) the keys are stored l2-normalised and each query is normalised
    as it reads (attend_all takes unit rows): a step streams the cache once, as SDPA's decode does, rather
    than normalising every cached key again.
    """

    def __init__(self, capacity: int, attend_all, unit_rows: bool = False):
        self.capacity, self.attend_all, self.unit_rows = capacity, attend_all, unit_rows
        self.k = self.v = self.slots = None

    def add(self, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor) -> None:
        """Store k, v (B, Hkv, t, D) of positions position .. position + t - 1 (position: (1,) on the device)."""
        if self.unit_rows:
            k = unit(k)
        if self.k is None:  # zeros, not garbage, behind the mask (kept out of every product either way)
            self.k, self.v = (x.new_zeros(*x.shape[:2], self.capacity, x.shape[-1]) for x in (k, v))
            self.slots = torch.arange(self.capacity, device=k.device)
        slots = (position + torch.arange(k.shape[2], device=k.device)) % self.capacity
        self.k.index_copy_(2, slots, k.to(self.k.dtype))
        self.v.index_copy_(2, slots, v.to(self.v.dtype))

    def read(self, q: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """q (B, H, 1, D), the query at position, over every cached position up to it."""
        written = self.slots <= position  # all of them once it wraps
        keep = written.expand(q.shape[0], self.capacity)
        return self.attend_all(unit(q) if self.unit_rows else q, self.k, self.v, mask=keep)


def unit(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to norm 1 in fp32, then rounded to x's dtype (as the kernels' and SDPA users' own are)."""
    return F.normalize(x.float(), dim=-1).to(x.dtype)


class MomentsCache:
    """A fastmax layer's decoding state: the fp32 moments of every key so far (fastmax_moments), of one
    size whatever the context, so a step costs the same at any length. Past seq_len it keeps every
    position, a longer context than the model trained on: a window would need the keys leaving it.
    A step adds to the state in place (a CUDA graph replays it on the same memory)."""

    def __init__(self, options: dict):
        self.options, self.state = options, None

    def add(self, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor) -> None:
        state = fastmax_moments(k, v, **self.options)
        if self.state is None:
            self.state = state
        else:
            self.state += state

    def read(self, q: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return fastmax_read(q, self.state, **self.options)


def decode_cache(cfg):
    """An empty decoding cache for one layer of cfg's attention."""
    if cfg.attention == "fastmax":
        return MomentsCache(score_options(cfg))
    cosine = cfg.attention == "cosine"
    return KVCache(cfg.seq_len, attention_fn(cfg, causal=False, unit_rows=cosine), unit_rows=cosine)


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
        self.backend = kernel_backend(cfg)
        # No dropout on the attention weights: the cosine API has none, and the three families
        # should be regularised alike for a fair comparison.
        self.attend = attention_fn(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                position: torch.Tensor | None = None, context=None) -> torch.Tensor:
        """x (B, T, C) (cos, sin: its RoPE rows); with a cache (decode_cache's), x's positions, from position
        ((1,) on the device) on, join it, and a decode step (T = 1) reads it. With a context
        (model.context_parallel's ContextParallel), x is a rank's slice, cos and sin its positions' rows, and
        attention runs over the slices of the whole sequence."""
        b, t, _ = x.shape
        q, k, v = rotary_qkv(self.qkv(x), cos, sin, heads=self.n_head, kv_heads=self.n_kv_head,
                             backend=self.backend)
        if cache is not None:
            cache.add(k, v, position)
        # A prefill attends causally among its own positions; a decode step's one query reads the cache.
        if context is not None:
            y = context.attend(q, k, v)
        else:
            y = self.attend(q, k, v) if cache is None or t > 1 else cache.read(q, position)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.proj(y))
