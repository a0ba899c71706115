"""Based's hybrid (GPTConfig.swa_window): the sliding-window softmax of the odd blocks against a naive banded
reference, the hybrid model training and decoding, its config checks and its FLOP count."""
import math

import pytest
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig
from model.attention import (KVCache, attention_flops_per_token, layer_window, sliding_window_attention)
from model.context_parallel import context_zigzag
from model.variants import VARIANTS, variant_of
from helpers import decode_step_ops


def tiny(**overrides) -> GPTConfig:
    return GPTConfig(**{"n_layer": 2, "n_head": 4, "n_embd": 32, "seq_len": 32, "swa_window": 4, **overrides})


def banded_reference(q, k, v, window):
    """Full T x T scores at 1/sqrt(D), key s kept for query t iff t - window < s <= t."""
    t, d = q.shape[2], q.shape[3]
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    pos = torch.arange(t)
    keep = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    return scores.masked_fill(~keep, float("-inf")).softmax(dim=-1) @ v


@pytest.mark.parametrize("t, window, heads, kv_heads", [
    (23, 8, 4, 4),   # T not a multiple of the window
    (32, 8, 4, 4),   # a multiple
    (5, 8, 4, 4),    # T < w: the first block alone
    (8, 8, 2, 2),    # T = w
    (23, 8, 4, 2),   # grouped KV heads
    (19, 4, 4, 1),   # multi-query
    (9, 1, 2, 2),    # w = 1: each query sees only itself
])
def test_sliding_window_attention_is_the_banded_softmax_forward_and_backward(t, window, heads, kv_heads):
    torch.manual_seed(0)
    b, d = 2, 16
    q = torch.randn(b, heads, t, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, t, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = sliding_window_attention(q, k, v, window=window)
    ref = banded_reference(q, k, v, window)
    assert out.shape == (b, heads, t, d)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, e in zip("qkv", got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=f"d{name}")


def test_a_window_as_long_as_the_sequence_is_causal_softmax():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(sliding_window_attention(q, k, v, window=12), causal)
    torch.testing.assert_close(sliding_window_attention(q, k, v, window=50), causal)


def test_the_odd_blocks_are_windowed_and_the_even_keep_the_family():
    cfg = tiny(attention="fastmax", n_layer=4)
    model = GPT(cfg)
    assert [layer_window(cfg, i) for i in range(4)] == [0, 4, 0, 4]
    assert [block.attn.window for block in model.blocks] == [0, 4, 0, 4]
    assert [block.attn.attend.func is sliding_window_attention for block in model.blocks] == [False, True] * 2
    assert all(block.attn.window == 0 for block in GPT(tiny(attention="fastmax", swa_window=0)).blocks)


@pytest.mark.parametrize("overrides", [dict(attention="fastmax"), dict(attention="fastmax", n_kv_head=2),
                                       dict(attention="cosine", short_conv=3), dict(attention="softmax")],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_hybrid_model_trains_a_step(overrides):
    torch.manual_seed(0)
    model = GPT(tiny(**overrides))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 256, (3, 32))
    _, loss = model(idx, idx.roll(-1, dims=1))
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(256)) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    opt.step()
    _, after = model(idx, idx.roll(-1, dims=1))
    assert math.isfinite(after.item()) and after.item() < loss.item()


def test_a_windowed_block_sees_only_its_window():
    """Odd blocks only (the even one an identity: its branches zeroed): a byte more than a window back changes
    nothing, one inside it does."""
    torch.manual_seed(0)
    model = GPT(tiny(attention="fastmax", swa_window=4)).eval()
    with torch.no_grad():
        for p in (model.blocks[0].attn.proj.weight, model.blocks[0].mlp.proj.weight):
            p.zero_()
    idx = torch.randint(0, 256, (1, 32))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:14], b[:, 10:14])  # 10 .. 13 see position 10
    torch.testing.assert_close(a[:, 14:], b[:, 14:], rtol=0, atol=0)


@pytest.mark.parametrize("overrides, prompt", [
    (dict(attention="fastmax"), 3),  # a prefill shorter than the window
    (dict(attention="fastmax"), 10),  # longer: the ring keeps its last 4 positions
    (dict(attention="fastmax", n_kv_head=2, n_layer=3), 10),
    (dict(attention="cosine", short_conv=3), 6),
    (dict(attention="softmax", swa_window=5), 7),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) if isinstance(o, dict) else f"prompt={o}")
def test_decoding_with_the_cache_is_decoding_without_it(overrides, prompt):
    """Up to seq_len bytes, cached generation (the windowed blocks' ring of swa_window positions) gives the bytes
    of the model run on the whole prefix at every step, and each step's logits are the prefix's last."""
    torch.manual_seed(0)
    model = GPT(tiny(**overrides)).eval()
    idx = torch.randint(0, 256, (2, prompt))
    new = 32 - prompt
    cached = model.generate(idx, new, top_k=1, use_cache=True)
    assert torch.equal(cached, model.generate(idx, new, top_k=1, use_cache=False))
    sampled = model.generate(idx, new, generator=torch.Generator().manual_seed(5), use_cache=True)
    assert torch.equal(sampled, model.generate(idx, new, generator=torch.Generator().manual_seed(5), use_cache=False))
    cache = model.new_cache()
    with torch.no_grad():
        steps = [model(cached[:, :prompt], cache=cache)[0][:, -1]]
        steps += [model(cached[:, t:t + 1], cache=cache)[0][:, -1] for t in range(prompt, 32)]
        whole, _ = model(cached)
    torch.testing.assert_close(torch.stack(steps, dim=1), whole[:, prompt - 1:], rtol=1e-4, atol=1e-4)
    rings = [layer.attn for layer in cache.layers[1::2]]
    assert all(isinstance(ring, KVCache) and ring.capacity == model.cfg.swa_window and ring.k.shape[2] == ring.capacity
               for ring in rings)


def test_a_decode_step_of_the_hybrid_does_the_same_work_at_every_position():
    """The same ops on the same shapes before the windowed ring wraps and after (CapturedStep replays one)."""
    torch.manual_seed(0)
    model = GPT(tiny(attention="fastmax")).eval()
    steps = decode_step_ops(model, torch.randint(0, 256, (2, 20)), prefill=2)  # the window of 4 wraps at position 4
    assert steps[0] and all(ops == steps[0] for ops in steps)


@pytest.mark.parametrize("overrides, match", [
    (dict(swa_window=-1), "swa_window: expected 0 .* got -1"),
    (dict(swa_window=4, n_layer=1), "swa_window: .* n_layer >= 2, got n_layer=1"),
])
def test_bad_windows_are_refused_naming_swa_window(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny(**overrides)


@pytest.mark.parametrize("attention", ["softmax", "cosine", "fastmax"])
def test_context_parallelism_refuses_a_window(attention):
    with pytest.raises(ValueError, match="swa_window: .* no sliding window.* got 64"):
        context_zigzag(tiny(attention=attention, seq_len=256, swa_window=64), 4)
    context_zigzag(tiny(attention=attention, seq_len=256, swa_window=0), 4)  # without one it runs


def test_attention_flops_count_the_band_in_the_windowed_blocks(fake_kernels):
    cpu, f32 = torch.device("cpu"), torch.float32
    d, t, w = 8, 1024, 64
    full = 6 * d * t  # per head: the causal quadratic count
    band = 12 * d * (t * w - w * w // 2) // t  # T·w - w²/2 (query, key) pairs, 12·D FLOPs each, per token
    assert band == 6 * d * w * (2 * t - w) // t
    assert attention_flops_per_token(tiny(seq_len=t, swa_window=w, attention="softmax"), cpu, f32) == 4 * (full + band)
    assert attention_flops_per_token(tiny(seq_len=t, swa_window=w, n_layer=5), cpu, f32) == 4 * (3 * full + 2 * band)
    assert attention_flops_per_token(tiny(seq_len=t, swa_window=0), cpu, f32) == 4 * 2 * full
    # fastmax's linear form in the even blocks (F = 45 features at d = 8), the band in the odd
    linear = 12 * 45 * 9
    hybrid = tiny(seq_len=t, swa_window=w, attention="fastmax")
    assert attention_flops_per_token(hybrid, cpu, f32) == 4 * (linear + band)
    # a window as long as the context is the causal count
    assert attention_flops_per_token(tiny(seq_len=t, swa_window=t), cpu, f32) == 4 * 2 * full
    assert attention_flops_per_token(tiny(seq_len=t, swa_window=4 * t), cpu, f32) == 4 * 2 * full
    # the count is the band's own: sum over queries of min(t + 1, w) keys, up to the convention's w/2
    exact = sum(min(i + 1, w) for i in range(t))
    assert abs(band - 12 * d * exact / t) <= 12 * d * w / t


def test_the_fastmax_swa_variant_is_its_config_and_found_again():
    variant = VARIANTS["fastmax-swa"]
    assert dict(variant.settings) == dict(attention="fastmax", use_cuda_kernel=True, swa_window=64)
    assert variant.flags() == ["--attention", "fastmax", "--use_cuda_kernel", "True", "--swa_window", "64"]
    assert variant_of(tiny(**dict(variant.settings))) is variant
    assert variant_of(tiny(attention="fastmax", use_cuda_kernel=True, swa_window=0)) is VARIANTS["fastmax-kernel"]
    with pytest.raises(ValueError, match="swa_window=32"):
        variant_of(tiny(attention="fastmax", use_cuda_kernel=True, swa_window=32))
