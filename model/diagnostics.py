"""How concentrated each head's attention weights are, for logging at evaluation.

Fastmax's weights cannot concentrate the way softmax's can: f(x) = a0 + a1 x + a2 x^2 >= a0 - a1^2 / (4 a2) > 0
(a0 / 2 at the defaults) for every key, so for one key to take a share s of N keys its f must be about
s / (1 - s) N times the floor, which needs x ~ sqrt(N). attention_concentration measures, per layer and head,
the largest weight of a row and the row's entropy, over the last queries of evaluation sequences, so that the
three families can be compared head by head; summarize flattens that into a few scalars for the logger.

The model's code is not touched: a forward hook on each block's ``attn.qkv`` takes the fused projection as
the attention gets it, and the diagnostics rotate it with attention_cuda's reference RoPE (the same rows of
the model's ``rope_cos`` / ``rope_sin`` tables that GPT.forward hands every block) and recompute the
weights in fp32 from the score policy of the model's family (attention_cuda.score_policy) with
attention_cuda.attention_weights, the reference's quadratic form written out to return the weights.
"""
from __future__ import annotations

import contextlib
import math

import torch

from attention_cuda import ScorePolicy, attention_weights, rotary_qkv, score_policy
from model.attention import layer_window, score_options

# Bytes the weights of one chunk of (heads, queries, keys) may take: the chunk's logits, its weights and the
# w log w of the entropy are three fp32 copies, and a fourth element's worth is left for the masks and softmax's
# own work. Heads and queries are chunked to stay within it: at T = 32768 it is 2 heads x 256 queries, and the
# measured peak of a layer's statistics was 216 MiB on an H200 (B = 2, 8 heads of D = 64; softmax, cosine, fastmax).
CHUNK_BYTES = 256 * 2 ** 20
BYTES_PER_ELEMENT = 4 * 4
QUERIES = 256  # the last positions of each sequence whose rows are measured, by default


def softmax_policy(head_dim: int) -> ScorePolicy:
    """softmax(q.k / sqrt(D)), SDPA's default scale. The reference's "cosine" kind is exactly that: exp of the
    scaled logits less the row max, divided by the row sum; without qk_norm it leaves q and k unscaled."""
    return ScorePolicy("cosine", 1.0 / math.sqrt(head_dim))


def layer_policy(cfg, layer: int) -> tuple[ScorePolicy, int]:
    """(score policy, window) of block ``layer`` of a model of cfg: window 0 = causal over every earlier key.

    A block that model.attention.layer_window gives a window (the odd ones, with swa_window) runs softmax over
    its last window keys whatever cfg.attention is."""
    window = layer_window(cfg, layer)
    if window or cfg.attention == "softmax":
        return softmax_policy(cfg.head_dim), window
    # cosine_sdpa too: the same function on SDPA
    return score_policy(cfg.attention, **score_options(cfg)), 0


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT inside torch.compile's and DDP's wrappers (hooks and the forward go to it directly: no
    recompilation, no DDP collectives)."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


@contextlib.contextmanager
def _rotated_qkv_hooks(gpt, t: int, on_qkv):
    """While open, each block's attention calls on_qkv(layer, q, k, v) with its q (B, H, T, D) and k, v
    (B, Hkv, T, D) as its attention sees them: the qkv Linear's output split and RoPE-rotated by the reference
    (in fp32, rounded back to the projection's dtype, as CausalSelfAttention's rotary_qkv does), with rows
    0 .. t - 1 of the model's tables, which GPT.forward hands every block when it has no cache or context."""
    cos, sin = gpt.rope_cos[:t], gpt.rope_sin[:t]

    def hook(layer):
        def fn(module, inputs, output):
            attn = gpt.blocks[layer].attn
            q, k, v = rotary_qkv(output, cos, sin, heads=attn.n_head, kv_heads=attn.n_kv_head, backend="torch")
            on_qkv(layer, q, k, v)
        return fn

    handles = [block.attn.qkv.register_forward_hook(hook(i)) for i, block in enumerate(gpt.blocks)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _plain_eval_forward(gpt):
    """The model in eval mode (no dropout) and on the whole sequence (no context group), restored after."""
    training, context = gpt.training, getattr(gpt, "context", None)
    gpt.eval()
    if context is not None:
        gpt.context = None
    try:
        yield
    finally:
        gpt.train(training)
        if context is not None:
            gpt.context = context


@torch.no_grad()
def capture_qkv(model, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every block's (q, k, v) as its attention sees them in one eval forward of x (B, T): all of them held at
    once, so for tests and small inputs (attention_concentration keeps one layer's)."""
    gpt, out = _unwrap(model), []
    with _plain_eval_forward(gpt), _rotated_qkv_hooks(gpt, x.shape[1], lambda layer, q, k, v: out.append((q, k, v))):
        gpt(x)
    return out


def _head_stats(q: torch.Tensor, k: torch.Tensor, policy: ScorePolicy, window: int, n: int):
    """Sums over the batch and the last n queries of each head's largest weight and entropy: two (H,) fp64."""
    b, heads, t, d = q.shape
    group = heads // k.shape[1]
    top, entropy = (q.new_zeros(heads, dtype=torch.float64) for _ in range(2))
    rows = max(1, CHUNK_BYTES // (BYTES_PER_ELEMENT * t))  # (head, query) rows of t keys at most per chunk
    per_chunk = max(1, min(heads, rows // n))  # heads at a time: all n queries of each, or one head in parts
    span = min(n, rows)
    for i in range(b):
        for h0 in range(0, heads, per_chunk):
            h1 = min(h0 + per_chunk, heads)
            kv = torch.arange(h0, h1, device=q.device) // group
            for t0 in range(t - n, t, span):
                t1 = min(t0 + span, t)
                lo = max(0, t0 - window + 1) if window else 0  # no query of the chunk sees keys before lo
                w = attention_weights(q[i, h0:h1, t0:t1], k[i].index_select(0, kv)[:, lo:t1], policy, start=t0,
                                      key_start=lo, window=window)
                top[h0:h1] += w.amax(dim=-1).sum(dim=-1, dtype=torch.float64)
                entropy[h0:h1] -= torch.xlogy(w, w).sum(dim=-1).sum(dim=-1, dtype=torch.float64)
    return top, entropy


@torch.no_grad()
def attention_concentration(model, x: torch.Tensor, queries: int = QUERIES) -> dict:
    """Per layer and head, how concentrated the attention weights of the last ``queries`` positions of each
    sequence of x (B, T) are (all T positions when T < queries), in one eval forward of the model on x.

    Call it on the model's device under the autocast of evaluation: q and k are taken as the attention gets
    them in that dtype, and the weights computed from them in fp32 (layer_policy's: softmax, cosine or
    fastmax by the config, sliding-window softmax for odd blocks with swa_window). Dropout is off for the
    forward and the model's train/eval mode is restored; wrappers (torch.compile, DDP) are looked through and
    a context group is set aside, so it runs on one process with no collective.

    Returns
      max_weight: [[per head] per layer], the mean over the B x queries rows of the row's largest weight
      entropy:    [[per head] per layer], the mean over the rows of -sum w log w, in nats
      keys:       [per layer], the mean number of keys a chosen query sees (t + 1, or min(t + 1, window))
      log_keys:   [per layer], the mean of log(keys): the entropy uniform weights would have
      queries:    the queries taken from each sequence (rows = B x queries)
    """
    gpt = _unwrap(model)
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"x: expected (batch, at least one byte), got shape {tuple(x.shape)}")
    if isinstance(queries, bool) or not isinstance(queries, int) or queries < 1:
        raise ValueError(f"queries: expected a positive int, got {queries!r}")
    b, t = x.shape
    n = min(queries, t)
    top, entropy, keys, log_keys = [], [], [], []

    def on_qkv(layer, q, k, v):
        policy, window = layer_policy(gpt.cfg, layer)
        sums = _head_stats(q, k, policy, window, n)
        top.append(sums[0] / (b * n))
        entropy.append(sums[1] / (b * n))
        seen = [min(p + 1, window) if window else p + 1 for p in range(t - n, t)]
        keys.append(sum(seen) / n)
        log_keys.append(sum(math.log(s) for s in seen) / n)

    with _plain_eval_forward(gpt), _rotated_qkv_hooks(gpt, t, on_qkv):
        gpt(x)
    return {"max_weight": torch.stack(top).tolist(), "entropy": torch.stack(entropy).tolist(),
            "keys": keys, "log_keys": log_keys, "queries": n}


def summarize(stats: dict) -> dict:
    """attention_concentration's stats as flat scalars for the logger:
      attn/max_weight:       mean over layers and heads of max_weight (1 / keys for uniform weights)
      attn/max_weight_max:   the most concentrated head's max_weight
      attn/entropy:          mean over layers and heads of entropy (nats)
      attn/entropy_min:      the most concentrated head's entropy
      attn/entropy_uniform:  the mean over layers of log_keys, the entropy of uniform weights, for scale
    """
    top = [w for layer in stats["max_weight"] for w in layer]
    entropy = [e for layer in stats["entropy"] for e in layer]
    return {"attn/max_weight": sum(top) / len(top), "attn/max_weight_max": max(top),
            "attn/entropy": sum(entropy) / len(entropy), "attn/entropy_min": min(entropy),
            "attn/entropy_uniform": sum(stats["log_keys"]) / len(stats["log_keys"])}
