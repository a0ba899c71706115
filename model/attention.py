"""Causal self-attention with RoPE, switchable between softmax, cosine-sim and fastmax.

Softmax runs through PyTorch's fused SDPA kernels; cosine-sim and fastmax through the project's
functional API (attention_cuda), on its CUDA kernels with ``use_cuda_kernel`` and on the pure-PyTorch
reference otherwise. RoPE rotates q and k *before* the attention sees them, so cosine's l2-norm and
fastmax's optional ``normalize`` act on the rotated vectors (a rotation keeps norms, so they commute
with it anyway, and position enters only through q.k as it does for softmax).

With ``swa_window`` (Based's hybrid) the blocks of odd index run exact causal softmax over the last
swa_window positions instead (sliding_window_attention, on SDPA), rotated by RoPE like the rest.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_cuda import (cosine_sim_attention, fastmax_attention, fastmax_features, fastmax_moments, fastmax_read,
                            plan, rotary_qkv)
from attention_cuda.context_parallel import cosine_ring_attention, fastmax_context_parallel
from model.softmax_ring import softmax_context_parallel, softmax_mesh


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles of positions 0 .. seq_len - 1, (seq_len, head_dim / 2) in fp32."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


SDPA_NAMES = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


@dataclass(frozen=True)
class Family:
    """What differs between the model's attention families, one row each in FAMILIES."""

    function: Callable | None  # attention_cuda's function; None: softmax, on SDPA
    options: Callable  # cfg -> the score options of that function, by attention_cuda's names
    cache: str  # a decode step reads "keys" (KVCache), "unit keys" (KVCache of unit rows) or fastmax's "moments"
    # Across a context group (model.context_parallel): whether the slices take zigzag order, and (cfg, group,
    # device) -> the attention over the group's slices, (q, k, v) -> out. Causal cosine and softmax are quadratic:
    # in plain order the last rank's queries see every key, the first rank's only its own, so zigzag balances the
    # ring (and is PyTorch's head-tail order, which its softmax ring takes). Fastmax is linear: each chunk reads
    # one state and does its own band, the same work wherever it sits, and plain order sends one state per rank
    # rather than two (and is the order its kernels take).
    zigzag: bool
    across_ranks: Callable


def _softmax_across(cfg, group, device):
    return functools.partial(softmax_context_parallel, mesh=softmax_mesh(group, device), backend=cfg.sdpa_backend)


def _cosine_across(cfg, group, device):
    return functools.partial(cosine_ring_attention, group=group, causal=True, scale=cfg.cosine_scale,
                             zigzag=family(cfg).zigzag, backend=kernel_backend(cfg))


def _fastmax_options(cfg) -> dict:
    return dict(p=cfg.fastmax_p, a0=cfg.fastmax_a0, a1=cfg.fastmax_a1, a2=cfg.fastmax_a2,
                temperature=cfg.fastmax_temperature, normalize=cfg.fastmax_normalize, lim=cfg.fastmax_lim)


def _fastmax_across(cfg, group, device):
    return functools.partial(fastmax_context_parallel, group=group, causal=True, zigzag=family(cfg).zigzag,
                             backend=kernel_backend(cfg), **_fastmax_options(cfg))


FAMILIES = {
    "softmax": Family(None, lambda cfg: {}, "keys", True, _softmax_across),
    "cosine": Family(cosine_sim_attention, lambda cfg: dict(scale=cfg.cosine_scale, l2norm_qk=True), "unit keys",
                     True, _cosine_across),
    "fastmax": Family(fastmax_attention, _fastmax_options, "moments", False, _fastmax_across),
}


def family(cfg) -> Family:
    """cfg.attention's row of FAMILIES, or ValueError naming the families there are."""
    if cfg.attention not in FAMILIES:
        raise ValueError(f"attention: expected one of {tuple(FAMILIES)}, got {cfg.attention!r}")
    return FAMILIES[cfg.attention]


def score_options(cfg) -> dict:
    """The score options of cfg's family, by attention_cuda's names (none for softmax, on SDPA)."""
    return family(cfg).options(cfg)


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


def layer_window(cfg, layer: int) -> int:
    """The sliding window of block ``layer``'s attention: swa_window for the odd blocks (Based's hybrid), else
    0, the family's attention over the whole context."""
    return cfg.swa_window if layer % 2 else 0


def sliding_window_attention(q, k, v, *, window: int, scale: float | None = None):
    """Causal softmax attention over the last ``window`` positions, exactly: q (B, H, T, D), k/v (B, Hkv, T, D)
    -> (B, H, T, D), query t weighing key s iff t - window < s <= t; scale None = 1/sqrt(D), softmax's.

    In O(T·window) memory, on SDPA: the queries are cut into blocks of w = window, and each block attends to
    its own keys and the previous block's (2w keys) under one band mask (key j of the pair for query i iff
    i < j <= i + w), the blocks folded into the batch (B·(T/w - 1), H, w, 2w), T padded up to a multiple of
    w (the padded keys lie past every real query, so the band hides them; the padded queries are dropped).
    The first block has no previous block: it is its own call, plain causal over its keys (T <= w: the only
    one). Grouped KV heads go to SDPA as they are (enable_gqa; on CUDA the masked call then runs on cuDNN or
    math, as PyTorch's memory-efficient kernel takes no grouped heads)."""
    b, h, t, d = q.shape
    w = window
    gqa = k.shape[1] != h
    first = F.scaled_dot_product_attention(q[:, :, :w], k[:, :, :w], v[:, :, :w], is_causal=True, scale=scale,
                                           enable_gqa=gqa)
    if t <= w:
        return first
    n = -(-t // w) - 1  # the blocks after the first
    pad = (n + 1) * w - t
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))

    def pairs(x):  # (B, Hx, (n + 1) w, D) -> (B n, Hx, 2w, D): block i's keys after block i - 1's, i = 1 .. n
        x = x.reshape(b, x.shape[1], n + 1, w, d)
        return torch.cat([x[:, :, :-1], x[:, :, 1:]], dim=3).transpose(1, 2).reshape(b * n, -1, 2 * w, d)

    queries = q[:, :, w:].reshape(b, h, n, w, d).transpose(1, 2).reshape(b * n, h, w, d)
    i, j = torch.arange(w, device=q.device)[:, None], torch.arange(2 * w, device=q.device)
    band = (j > i) & (j <= i + w)
    later = F.scaled_dot_product_attention(queries, pairs(k), pairs(v), attn_mask=band, scale=scale, enable_gqa=gqa)
    later = later.reshape(b, n, h, w, d).transpose(1, 2).reshape(b, h, n * w, d)[:, :, :t - w]
    return torch.cat([first, later], dim=2)


def attention_fn(cfg, causal: bool = True, unit_rows: bool = False, window: int = 0):
    """q (B, H, T, D), k/v (B, Hkv, J, D) -> (B, H, T, D) for the family cfg.attention names: causal over
    T = J (training, a prefill), or every query over every key (a decode step's one query over the cache).
    unit_rows (cosine): q and k arrive l2-normalised, as cosine's decode cache keeps its keys. window > 0
    (layer_window's): softmax over the last window positions whatever the family, on SDPA's own pick of
    backend (sdpa_backend is the family's; flash takes no mask); not causal, plain softmax over a decode
    cache's ring of them."""
    if window:
        if causal:
            return functools.partial(sliding_window_attention, window=window)
        return functools.partial(sdpa_attention, backend="auto", causal=False)
    if cfg.attention == "softmax":
        return functools.partial(sdpa_attention, backend=cfg.sdpa_backend, causal=causal)
    if cfg.cosine_sdpa:
        return functools.partial(sdpa_attention, backend=cfg.sdpa_backend, causal=causal, scale=cfg.cosine_scale,
                                 normalize=not unit_rows)
    options = {**score_options(cfg), **({"l2norm_qk": False} if unit_rows else {})}
    return functools.partial(family(cfg).function, causal=causal, backend=kernel_backend(cfg), **options)


def kernel_backend(cfg) -> str:
    """attention_cuda's backend for the model's attention and its RoPE: our kernels with use_cuda_kernel, the
    PyTorch reference without (softmax and cosine on SDPA rotate with PyTorch ops, as such models do), and
    attention_cuda's own "auto" while use_cuda_kernel is None (a model built outside train.py, which settles it
    for its device at start-up: lab.steps.resolve_kernel_choice)."""
    return {True: "cuda", False: "torch", None: "auto"}[cfg.use_cuda_kernel]


def attention_plan(cfg, device, dtype: torch.dtype):
    """The plan attention_cuda resolves for the model's attention on device, in dtype (the training
    dtype: autocast's); None for attention on SDPA."""
    if cfg.on_sdpa:
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
    - a sliding-window block (swa_window = w, the odd blocks): softmax over the causal band of the last w
      keys, T·w - w²/2 (query, key) pairs (the causal count's T²/2 with the first w queries' triangle),
      so 6·D·w·(2T - w) / T per token, 12·D·w for w << T, and 6·D·T, the quadratic count, at w = T (w is
      taken as min(w, T)). The blocks of keys that sliding_window_attention computes and masks are not counted,
      as causal's masked half is not.
    The element-wise score function (exp, the polynomial) is not counted, as the convention goes.
    """
    head_dim = cfg.head_dim
    attention = attention_plan(cfg, device, dtype)
    if attention is not None and attention.form == "linear":
        per_head = 12 * fastmax_features(head_dim, cfg.fastmax_p) * (head_dim + 1)
    else:
        per_head = 6 * head_dim * cfg.seq_len
    windowed = sum(1 for layer in range(cfg.n_layer) if layer_window(cfg, layer))
    w, t = min(cfg.swa_window, cfg.seq_len), cfg.seq_len
    per_windowed_head = 6 * head_dim * w * (2 * t - w) // t
    return cfg.n_head * ((cfg.n_layer - windowed) * per_head + windowed * per_windowed_head)


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
        """Store k, v (B, Hkv, t, D) of positions position .. position + t - 1 (position: (1,) on the device);
        of more than capacity positions (a prefill longer than a sliding window's ring), the last capacity."""
        if k.shape[2] > self.capacity:
            position = position + (k.shape[2] - self.capacity)
            k, v = k[:, :, -self.capacity:], v[:, :, -self.capacity:]
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


def decode_cache(cfg, window: int = 0):
    """An empty decoding cache for one layer of cfg's attention; window > 0 (layer_window's), a sliding-window
    layer's: a ring of the last window positions' keys and values, read with plain softmax."""
    if window:
        return KVCache(window, attention_fn(cfg, causal=False, window=window))
    cache = family(cfg).cache
    if cache == "moments":
        return MomentsCache(score_options(cfg))
    unit_rows = cache == "unit keys"
    return KVCache(cfg.seq_len, attention_fn(cfg, causal=False, unit_rows=unit_rows), unit_rows=unit_rows)


class CausalSelfAttention(nn.Module):
    """Grouped-KV self-attention: n_head query heads share n_kv_head key/value heads. ``layer``: the block's
    index, which picks sliding-window softmax for the odd blocks with swa_window (layer_window)."""

    def __init__(self, cfg, layer: int = 0):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.head_dim
        q_dim, kv_dim = cfg.n_head * self.head_dim, cfg.n_kv_head * self.head_dim
        self.qkv = nn.Linear(cfg.n_embd, q_dim + 2 * kv_dim, bias=False)
        self.proj = nn.Linear(q_dim, cfg.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # RoPE on the model's backend in every block, a sliding-window one too: one rotation for the whole model.
        self.backend = kernel_backend(cfg)
        self.window = layer_window(cfg, layer)
        # No dropout on the attention weights: the cosine API has none, and the three families
        # should be regularised alike for a fair comparison.
        self.attend = attention_fn(cfg, window=self.window)

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
