import math
import re

import pytest
import torch

from model import GPT, GPTConfig
from model.gpt import RMSNorm
from attention_cuda.reference import apply_rope
from model.attention import CausalSelfAttention, attention_flops_per_token, rope_tables
from helpers import decode_step_ops

FAMILIES = {
    "softmax": {"attention": "softmax"},
    "cosine": {"attention": "cosine"},
    "fastmax": {"attention": "fastmax"},
    "fastmax_p1_normalize": {"attention": "fastmax", "fastmax_p": 1, "fastmax_normalize": True},
}


def tiny(**overrides) -> GPTConfig:
    return GPTConfig(**{"n_layer": 2, "n_head": 4, "n_embd": 32, "seq_len": 16, **overrides})


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_backward(family):
    torch.manual_seed(0)
    model = GPT(tiny(**FAMILIES[family]))
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, idx.roll(-1, dims=1))
    assert logits.shape == (3, 16, 256)
    assert loss.shape == () and math.isfinite(loss.item())
    # Near-uniform predictions at init: the loss starts close to ln(256).
    assert abs(loss.item() - math.log(256)) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("family", FAMILIES)
def test_causal(family):
    """Changing a later byte changes no earlier logit, for every attention family."""
    torch.manual_seed(0)
    model = GPT(tiny(**FAMILIES[family])).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_per_position_loss_matches_mean():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx, targets = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    _, mean = model(idx, targets)
    _, per_token = model(idx, targets, reduction="none")
    assert per_token.shape == (2, 16)
    torch.testing.assert_close(per_token.mean(), mean)


def test_rms_norm_is_the_formula_in_fp32_and_keeps_float64():
    """The fused F.rms_norm the model uses computes x / sqrt(mean(x^2) + eps) * gain in fp32 (a bf16 stream
    comes back fp32, as the gain is), and a float64 model stays float64 (its gradient checks need it)."""
    torch.manual_seed(0)
    norm = RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24))
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    assert torch.allclose(norm(x.float()), want.float(), rtol=1e-6, atol=1e-6)
    assert norm(x.bfloat16()).dtype == torch.float32
    norm64 = RMSNorm(24, eps=1e-6).double()
    with torch.no_grad():
        norm64.weight.copy_(norm.weight.double())
    out = norm64(x)
    assert out.dtype == torch.float64 and torch.allclose(out, want, rtol=1e-12, atol=1e-12)


def test_tied_embeddings_counted_once():
    model = GPT(tiny())
    assert model.lm_head.weight is model.wte.weight
    unique = {id(p): p.numel() for m in model.modules() for p in m.parameters(recurse=False)}
    assert model.num_params() == sum(unique.values())
    assert model.num_params() < sum(p.numel() for m in model.modules() for p in m.parameters(recurse=False))


def test_residual_projections_start_smaller():
    cfg = tiny(n_layer=8, n_embd=256)
    model = GPT(cfg)
    block = model.blocks[0]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for proj in (block.attn.proj, block.mlp.proj):
        assert proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05)


def test_generate_length_and_greedy_determinism():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    prompt = torch.randint(0, 256, (2, 5))
    out = model.generate(prompt, 20, top_k=1, generator=torch.Generator().manual_seed(1), use_cache=False)
    again = model.generate(prompt, 20, top_k=1, generator=torch.Generator().manual_seed(2), use_cache=False)
    assert out.shape == (2, 25)  # 25 > seq_len: the context is cropped to the last 16 bytes
    assert torch.equal(out[:, :5], prompt)
    assert torch.equal(out, again)
    logits, _ = model(out[:, -17:-1])  # the last step saw exactly the 16 bytes before it
    assert torch.equal(out[:, -1], logits[:, -1].argmax(-1))


CACHED = [dict(attention="softmax"), dict(attention="cosine"), dict(attention="cosine", cosine_sdpa=True),
          dict(attention="fastmax"), dict(attention="softmax", n_kv_head=2), dict(attention="cosine", short_conv=3)]


@pytest.mark.parametrize("overrides", CACHED, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_decoding_with_the_cache_gives_the_bytes_and_logits_of_the_whole_window(overrides):
    """Up to seq_len bytes, a prefill then one byte per step over the cache is the model on the whole
    prefix: the same greedy bytes, and each step's logits those of the prefix's last position."""
    torch.manual_seed(0)
    model = GPT(tiny(**overrides)).eval()
    prompt = torch.randint(0, 256, (2, 5))
    cached = model.generate(prompt, 11, top_k=1, use_cache=True)
    assert torch.equal(cached, model.generate(prompt, 11, top_k=1, use_cache=False))
    cache = model.new_cache()
    with torch.no_grad():
        steps = [model(cached[:, :5], cache=cache)[0][:, -1]]
        steps += [model(cached[:, t:t + 1], cache=cache)[0][:, -1] for t in range(5, 16)]
        whole, _ = model(cached[:, :16])
    torch.testing.assert_close(torch.stack(steps, dim=1), whole[:, 4:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention", ["softmax", "fastmax"])
def test_the_decoding_state_of_fastmax_keeps_one_size_and_a_kv_cache_holds_seq_len_positions(attention):
    """The issue's memory bar, counted: fastmax's moments take the same bytes after a prefill of 3 bytes and
    after 30 more steps; a KV cache holds its seq_len slots of keys and values from its first write."""
    torch.manual_seed(0)
    cfg = tiny(attention=attention, seq_len=64)
    model = GPT(cfg).eval()
    data = torch.randint(0, 256, (2, 40))
    cache = model.new_cache()
    with torch.no_grad():
        model(data[:, :3], cache=cache)
        first = cache.nbytes()
        for t in range(3, 33):
            model(data[:, t:t + 1], cache=cache)
    assert cache.nbytes() == first
    head_dim = cfg.n_embd // cfg.n_head
    kv = cfg.n_layer * 2 * 2 * cfg.n_kv_head * cfg.seq_len * head_dim * 4  # layers, k and v, batch, fp32
    assert (first >= kv) == (attention == "softmax")


@pytest.mark.parametrize("kwargs, match", [
    (dict(use_graph=True), "use_graph: replays the cache's step on CUDA, got use_cache=True and idx on cpu"),
    (dict(use_graph=True, use_cache=False), "use_graph: .* got use_cache=False"),
])
def test_a_stream_that_cannot_run_says_why_before_its_first_byte(kwargs, match):
    model = GPT(tiny()).eval()
    with pytest.raises(ValueError, match=match):
        model.stream(torch.zeros(1, 3, dtype=torch.long), 4, **kwargs)


def test_past_seq_len_the_cache_keeps_the_last_seq_len_positions_at_their_own_rotations():
    """A step past seq_len attends to the last seq_len positions: with one layer (no earlier context in the
    keys and values) that is the model on the last seq_len bytes, whose RoPE differs only by a shift."""
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=1)).eval()
    data = torch.randint(0, 256, (1, 41))
    cache = model.new_cache(40)
    with torch.no_grad():
        model(data[:, :16], cache=cache)
        for t in range(16, 40):
            step, _ = model(data[:, t:t + 1], cache=cache)
            window, _ = model(data[:, t - 15:t + 1])
            torch.testing.assert_close(step[:, -1], window[:, -1], rtol=1e-4, atol=1e-4)
    assert cache.pos == 40 and cache.position.item() == 40 and cache.layers[0].attn.k.shape[2] == 16
    with pytest.raises(ValueError, match="one byte per call"):
        model(data[:, :2], cache=cache)
    with pytest.raises(ValueError, match="position 40 is past the cache's 40 positions"):
        model(data[:, 40:], cache=cache)
    with pytest.raises(ValueError, match="sequence length 17 exceeds the model's seq_len=16"):
        model(data[:, :17], cache=model.new_cache())  # a prefill longer than the cache
    with pytest.raises(ValueError, match="positions: expected >= 1"):
        model.new_cache(0)


@pytest.mark.parametrize("attention", ["softmax", "cosine", "fastmax"])
def test_a_decode_step_does_the_same_work_at_every_position(attention):
    """A step's operations and their shapes do not depend on its position (the position is a device tensor,
    the ring is read whole behind a mask, states change in place), before the ring wraps and after: what
    lets CapturedStep record one step and replay it at every later position."""
    torch.manual_seed(0)
    model = GPT(tiny(attention=attention, short_conv=3)).eval()
    steps = decode_step_ops(model, torch.randint(0, 256, (2, 40)), prefill=5)
    assert steps[0] and all(ops == steps[0] for ops in steps)  # positions 5 .. 39; seq_len 16: the ring wraps


def test_the_fastmax_state_after_a_prefill_is_the_state_built_byte_by_byte_and_its_size_stays():
    torch.manual_seed(0)
    model = GPT(tiny(attention="fastmax")).eval()
    data = torch.randint(0, 256, (2, 40))
    whole, steps = model.new_cache(), model.new_cache(40)
    with torch.no_grad():
        model(data[:, :12], cache=whole)
        for t in range(12):
            model(data[:, t:t + 1], cache=steps)
        for a, b in zip(whole.layers, steps.layers):
            torch.testing.assert_close(a.attn.state, b.attn.state, rtol=1e-5, atol=1e-5)
        size = [layer.attn.state.shape for layer in steps.layers]
        for t in range(12, 40):  # past seq_len = 16: every position stays in the moments
            model(data[:, t:t + 1], cache=steps)
    assert [layer.attn.state.shape for layer in steps.layers] == size and steps.pos == 40


def test_generate_samples_from_its_generator():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    prompt = torch.zeros(1, 1, dtype=torch.long)
    a = model.generate(prompt, 30, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 30, generator=torch.Generator().manual_seed(3))
    c = model.generate(prompt, 30, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_rope_depends_on_relative_position_only():
    torch.manual_seed(0)
    d, n = 16, 64
    cos, sin = rope_tables(n, d, 10000.0)
    q, k = torch.randn(d), torch.randn(d)

    def score(m, s):  # q at position m against k at position s
        qm = apply_rope(q.expand(1, 1, n, d), cos, sin)[0, 0, m]
        ks = apply_rope(k.expand(1, 1, n, d), cos, sin)[0, 0, s]
        return (qm @ ks).item()

    assert score(10, 3) == pytest.approx(score(40, 33), abs=1e-4)
    assert score(5, 5) == pytest.approx(score(50, 50), abs=1e-4)
    assert score(5, 5) == pytest.approx((q @ k).item(), abs=1e-4)  # offset 0: no rotation left
    assert abs(score(10, 3) - score(10, 4)) > 1e-3
    # A rotation keeps norms, so cosine's l2-normalisation after RoPE sees the same lengths.
    rotated = apply_rope(q.expand(1, 1, n, d), cos, sin)[0, 0]
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm().expand(n))


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_kv_equals_repeated_heads(family):
    """n_kv_head=2 of 4 heads == full multi-head attention with each kv head copied to its query group."""
    torch.manual_seed(0)
    grouped = CausalSelfAttention(tiny(n_kv_head=2, **FAMILIES[family]))
    full = CausalSelfAttention(tiny(**FAMILIES[family]))
    d = 8
    assert grouped.qkv.weight.shape == ((4 + 2 * 2) * d, 32)
    wq, wk, wv = grouped.qkv.weight.split([4 * d, 2 * d, 2 * d])
    expand = lambda w: w.view(2, d, 32).repeat_interleave(2, dim=0).reshape(4 * d, 32)  # noqa: E731
    with torch.no_grad():
        full.qkv.weight.copy_(torch.cat([wq, expand(wk), expand(wv)]))
        full.proj.weight.copy_(grouped.proj.weight)
    x = torch.randn(2, 16, 32)
    cos, sin = rope_tables(16, d, 10000.0)
    torch.testing.assert_close(grouped(x, cos, sin), full(x, cos, sin), rtol=1e-5, atol=1e-6)


def test_attention_flops(fake_kernels):
    cpu, f32 = torch.device("cpu"), torch.float32
    cfg = tiny(seq_len=1024)
    assert attention_flops_per_token(cfg, cpu, f32) == 2 * 4 * 6 * 8 * 1024  # L·H·6·D·T: causal quadratic
    # fastmax past the feature count F = 1 + 8 + 36 runs (and is counted in) its linear form
    fast = tiny(seq_len=1024, attention="fastmax")
    assert attention_flops_per_token(fast, cpu, f32) == 2 * 4 * 12 * 45 * 9
    assert attention_flops_per_token(tiny(seq_len=40, attention="fastmax"), cpu, f32) == 2 * 4 * 6 * 8 * 40
    # with the kernels, from the key count where their linear form was measured faster (d=16: 8192)
    gpu, bf16 = torch.device("cuda"), torch.bfloat16
    on_kernels = dict(n_embd=64, attention="fastmax", use_cuda_kernel=True)
    assert attention_flops_per_token(tiny(seq_len=8191, **on_kernels), gpu, bf16) == 2 * 4 * 6 * 16 * 8191
    assert attention_flops_per_token(tiny(seq_len=8192, **on_kernels), gpu, bf16) == 2 * 4 * 12 * 153 * 17
    model = GPT(cfg)
    assert model.flops_per_token(f32) == 6 * model.num_params() + attention_flops_per_token(cfg, cpu, f32)


@pytest.mark.parametrize("overrides, field", [
    ({"n_embd": 30}, "n_embd"),
    ({"n_embd": 36}, "n_embd"),  # head dim 9: RoPE needs pairs
    ({"n_kv_head": 3}, "n_kv_head"),
    ({"attention": "foo"}, "attention"),
    ({"dropout": 1.0}, "dropout"),
    ({"n_layer": 0}, "n_layer"),
    ({"attention": "softmax", "use_cuda_kernel": True}, "use_cuda_kernel"),
    ({"attention": "fastmax", "fastmax_a0": 0.0}, "fastmax_"),
    ({"attention": "fastmax", "fastmax_temperature": -1.0}, "fastmax_"),
    ({"cosine_scale": 0.0}, "cosine_scale"),
])
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


def test_sequence_longer_than_seq_len_is_refused():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_cosine_on_sdpa_is_the_cosine_attention(backend):
    """cosine_sdpa computes what cosine_sim_attention computes: softmax(scale * q^ k^T) v, causal."""
    from attention_cuda import cosine_sim_attention
    from model.attention import attention_fn

    torch.manual_seed(0)
    q, (k, v) = torch.randn(2, 4, 17, 16, dtype=torch.float64), (torch.randn(2, 2, 17, 16, dtype=torch.float64)
                                                                 for _ in range(2))
    cfg = tiny(attention="cosine", cosine_sdpa=True, sdpa_backend=backend, n_kv_head=2)
    ours = cosine_sim_attention(q, k, v, causal=True, scale=cfg.cosine_scale, backend="torch")
    torch.testing.assert_close(attention_fn(cfg)(q, k, v), ours)


@pytest.mark.parametrize("overrides, message", [
    ({"attention": "fastmax", "cosine_sdpa": True}, "cosine_sdpa: runs attention='cosine' on SDPA"),
    ({"attention": "cosine", "cosine_sdpa": True, "use_cuda_kernel": True}, "cosine_sdpa"),
    ({"attention": "cosine", "sdpa_backend": "cudnn"}, "sdpa_backend: 'cudnn' applies to attention run on SDPA"),
    ({"attention": "softmax", "sdpa_backend": "tpu"}, "sdpa_backend: expected one of"),
])
def test_sdpa_settings_are_checked(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny(**overrides)


def test_every_variant_is_a_config_and_found_again():
    from model.variants import VARIANTS, variant_of
    for variant in VARIANTS.values():
        assert variant_of(tiny(**dict(variant.settings))) is variant
    with pytest.raises(ValueError, match="no registered attention variant"):
        variant_of(tiny(attention="softmax", sdpa_backend="flash"))


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [dict(attention="softmax"), dict(attention="cosine", use_cuda_kernel=True),
                                       dict(attention="cosine", cosine_sdpa=True),
                                       dict(attention="fastmax", use_cuda_kernel=True, short_conv=4)],
                         ids=["softmax", "cosine-kernel", "cosine-sdpa", "fastmax-kernel-conv"])
def test_a_captured_decode_step_replays_the_eager_one(overrides):
    """A decode step recorded as a CUDA graph (CapturedStep) and replayed gives the eager step's logits, at
    every later position, past seq_len too (the ring wraps), on a cache it updates as the eager step would."""
    from model import CapturedStep
    torch.manual_seed(0)
    model = GPT(tiny(**overrides, n_head=2, n_embd=128, seq_len=256)).cuda().eval()
    data = torch.randint(0, 256, (2, 400), device="cuda")
    eager, graphed = model.new_cache(400), model.new_cache(400)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        for cache in (eager, graphed):
            model(data[:, :200], cache=cache)
            for t in range(200, 203):
                model(data[:, t:t + 1], cache=cache)
        step = CapturedStep(model, graphed, batch=2)
        for t in range(203, 399):
            want, _ = model(data[:, t:t + 1], cache=eager)
            # The same kernels on the same values; only cuBLAS may pick another algorithm under capture.
            torch.testing.assert_close(step(data[:, t:t + 1]), want, rtol=2e-2, atol=2e-2)
        want, _ = model(data[:, 399:], cache=eager)
    with torch.no_grad():  # the autocast it was recorded in has ended: the graph holds its own casts
        torch.testing.assert_close(step(data[:, 399:]), want, rtol=2e-2, atol=2e-2)
    assert graphed.pos == eager.pos == 400
    with pytest.raises(ValueError, match="past the cache's 400 positions"):
        step(data[:, :1])


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["cosine", "fastmax"])
def test_decoding_on_our_kernels_matches_float64(attention):
    """On our kernels, in bf16, a decode step is one query over the cache (cosine: unit keys, on the decode
    kernel; fastmax: the fp32 moments): its logits stay as close to the float64 reference model's as the
    whole window's on the same kernels (the FlashAttention rule: at most 2x that error, plus an atol)."""
    torch.manual_seed(0)
    model = GPT(tiny(attention=attention, use_cuda_kernel=True, n_head=2, n_embd=128, seq_len=2048)).cuda().eval()
    reference = GPT(tiny(attention=attention, n_head=2, n_embd=128, seq_len=2048)).cuda().double().eval()
    reference.load_state_dict(model.state_dict())
    data = torch.randint(0, 256, (2, 2048), device="cuda")
    cache = model.new_cache()
    with torch.no_grad():
        want = reference(data)[0][:, 1499:]
        with torch.autocast("cuda", torch.bfloat16):
            steps = [model(data[:, :1500], cache=cache)[0][:, -1]]
            steps += [model(data[:, t:t + 1], cache=cache)[0][:, -1] for t in range(1500, 2048)]
            whole = model(data)[0][:, 1499:]
    err_decode = (torch.stack(steps, dim=1).double() - want).abs().max().item()
    err_whole = (whole.double() - want).abs().max().item()
    assert err_decode <= 2 * err_whole + 2e-3 * max(want.abs().max().item(), 1.0), (err_decode, err_whole)


@pytest.mark.gpu
def test_generation_on_a_gpu_replays_a_graph_whose_bytes_are_the_eager_steps_greedy_ones():
    """generate on CUDA records a step after the first few and replays it (past seq_len too): each greedy byte
    it gives is the top byte of the eager steps' logits over the same bytes (to a rounding: a tie may break
    either way)."""
    torch.manual_seed(0)
    model = GPT(tiny(n_head=2, n_embd=128, seq_len=256)).cuda().eval()
    prompt = torch.randint(0, 256, (2, 100), device="cuda")
    out = model.generate(prompt, 200, top_k=1)
    cache = model.new_cache(300)
    with torch.no_grad():
        logits = [model(out[:, :100], cache=cache)[0][:, -1]]
        logits += [model(out[:, t:t + 1], cache=cache)[0][:, -1] for t in range(100, 299)]
    logits = torch.stack(logits, dim=1)
    chosen = logits.gather(-1, out[:, 100:, None])[..., 0]
    assert (logits.amax(-1) - chosen).max().item() < 1e-4
