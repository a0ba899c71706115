"""RoPE on the fused projection (attention_cuda.rotary_qkv): its contract and errors, the glue of its kernel
path on stand-in ops (on a CPU), and on a GPU the kernels (attn_cuda::rope_split, rope_merge) against float64
under the FlashAttention error rule, forward and gradient."""
import functools

import pytest
import torch

import kernel_standins
from attention_cuda import _kernels, rotary_qkv
from attention_cuda.plan import kernels_reason, rope_kernels_reason
from attention_cuda.reference import apply_rope
from helpers import poison_allocator, rule_violation
from model.attention import rope_tables

GPU = torch.cuda.is_available() and rope_kernels_reason(torch.device("cuda"), torch.bfloat16, 64) is None


def projection(b, t, heads, kv_heads, d, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(b, t, (heads + 2 * kv_heads) * d, generator=gen, device=device, dtype=dtype)


def by_hand(qkv, cos, sin, heads, kv_heads):
    """Split by slicing, then the model's apply_rope: what rotary_qkv must equal."""
    b, t, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    rows = qkv.view(b, t, heads + 2 * kv_heads, d).transpose(1, 2)
    q, k, v = rows[:, :heads], rows[:, heads:heads + kv_heads], rows[:, heads + kv_heads:]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def test_the_reference_rotates_q_and_k_and_passes_v_as_a_view():
    qkv = projection(2, 12, 4, 2, 16)
    cos, sin = rope_tables(12, 16, 10000.0)
    q, k, v = rotary_qkv(qkv, cos, sin, heads=4, kv_heads=2, backend="torch")
    for got, want in zip((q, k, v), by_hand(qkv, cos, sin, 4, 2)):
        assert torch.equal(got, want)
    assert v.data_ptr() == qkv[..., 6 * 16:].data_ptr()  # no copy of the values


@pytest.mark.parametrize("call, error, match", [
    (lambda qkv, c, s: rotary_qkv(qkv[0], c, s, heads=4, kv_heads=2), ValueError, "qkv: expected a floating"),
    (lambda qkv, c, s: rotary_qkv(qkv[..., :-1], c, s, heads=4, kv_heads=2), ValueError, "qkv: expected a last dim"),
    (lambda qkv, c, s: rotary_qkv(qkv, c, s, heads=0, kv_heads=2), ValueError, "heads, kv_heads: expected positive"),
    (lambda qkv, c, s: rotary_qkv(qkv, c[:5], s, heads=4, kv_heads=2), ValueError, r"cos: expected \(12, 8\)"),
    (lambda qkv, c, s: rotary_qkv(qkv, c, s, heads=4, kv_heads=2, backend="gpu"), ValueError, "backend: expected"),
    (lambda qkv, c, s: rotary_qkv(qkv, c, s, heads=4, kv_heads=2, backend="cuda"), NotImplementedError,
     'backend="cuda": '),
])
def test_bad_arguments_are_named(call, error, match):
    qkv = projection(2, 12, 4, 2, 16)
    cos, sin = rope_tables(12, 16, 10000.0)
    with pytest.raises(error, match=match):
        call(qkv, cos, sin)


def test_what_the_kernels_cannot_take_is_named(fake_kernels):
    """RoPE's kernels and the attention's share the device and dtype checks; each names its own argument."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert rope_kernels_reason(cuda, torch.bfloat16, 48) is None
    assert rope_kernels_reason(cpu, torch.bfloat16, 64) == "qkv: inputs are on cpu, the kernels run on CUDA devices"
    assert rope_kernels_reason(cuda, torch.float64, 64).startswith("qkv: dtype torch.float64 is not supported")
    assert "head dim 40 is not a multiple of 16" in rope_kernels_reason(cuda, torch.float16, 40)
    assert kernels_reason(cpu, torch.bfloat16, 64) == "q: inputs are on cpu, the kernels run on CUDA devices"
    assert kernels_reason(cuda, torch.float64, 64).startswith("q: dtype torch.float64 is not supported")


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (3, 1)])
def test_the_kernel_path_glue_gives_the_references_rows_and_gradient(monkeypatch, heads, kv_heads):
    """_kernels.rotary_qkv on float64 stand-ins of the ops: the same q, k, v and the same gradient of qkv as
    the reference, whatever the outputs' upstream gradients (an unused output's too: zeros)."""
    kernel_standins.install(functools.partial(monkeypatch.setattr, raising=False))
    cos, sin = rope_tables(10, 32, 10000.0)
    qkv = projection(2, 10, heads, kv_heads, 32).requires_grad_()
    got = _kernels.rotary_qkv(qkv, cos, sin, heads, kv_heads)
    want = by_hand(qkv, cos, sin, heads, kv_heads)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert got[0].is_contiguous() and got[1].is_contiguous()
    for used in ((0, 1, 2), (0, 2)):
        weights = [torch.randn_like(w) for w in want]
        grads = [torch.autograd.grad(sum((outs[i] * weights[i]).sum() for i in used), qkv)[0]
                 for outs in (_kernels.rotary_qkv(qkv, cos, sin, heads, kv_heads),
                              by_hand(qkv, cos, sin, heads, kv_heads))]
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and the compiled kernels")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("heads, kv_heads, d", [(8, 8, 64), (8, 2, 128), (4, 1, 16), (6, 3, 96), (2, 2, 32)])
def test_the_kernels_meet_the_error_rule(dtype, heads, kv_heads, d):
    """rope_split and rope_merge against float64: rows, and qkv's gradient through both, under the FA rule
    (the same PyTorch math in dtype, the reference's, sets the bar), on a contiguous projection and on a
    strided one (a slice of a wider one), the allocator poisoned with NaN first so no row goes unwritten."""
    b, t = 2, 300
    wide = projection(b, t, heads + 1, kv_heads, d, device="cuda", seed=d)  # a wider row: qkv is a strided view
    qkv64 = wide[..., :(heads + 2 * kv_heads) * d]
    cos, sin = rope_tables(t, d, 10000.0)
    cos, sin = cos.cuda(), sin.cuda()
    upstream = [torch.randn_like(x) for x in by_hand(qkv64, cos, sin, heads, kv_heads)]

    def run(x, backend):
        x = x.detach().requires_grad_()
        outs = rotary_qkv(x, cos, sin, heads=heads, kv_heads=kv_heads, backend=backend)
        loss = sum((o.double() * u).sum() for o, u in zip(outs, upstream))
        return [o.detach() for o in outs] + [torch.autograd.grad(loss, x)[0]]

    expected = run(qkv64, "torch")
    same_math = run(qkv64.to(dtype), "torch")
    poison_allocator()
    got = run(qkv64.to(dtype).contiguous(), "cuda")
    poison_allocator()
    got_strided = run(wide.to(dtype)[..., :(heads + 2 * kv_heads) * d], "cuda")
    problems = [f"{name} {what}: {p}" for what, outs in (("contiguous", got), ("strided", got_strided))
                for name, g, s, e in zip(("q", "k", "v", "dqkv"), outs, same_math, expected)
                if (p := rule_violation(g, s, e, dtype))]
    assert not problems, "\n".join(problems)
