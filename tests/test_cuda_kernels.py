"""The CUDA kernels (backend="cuda") against float64 PyTorch, on a GPU.

Error rule (FlashAttention's): for the output and every gradient, max |kernel - float64| must stay
within 2x max |the same PyTorch math in the input dtype - float64|, plus a small atol (relative to
the reference's magnitude, or to 1 where the exact gradient is 0). fp32 inputs run as TF32 in the
kernels, so their PyTorch counterpart gets q, k, v and the upstream gradient rounded to TF32 and TF32
matmuls: the same operand precision. Every kernel call gets fresh random inputs and a caching
allocator whose free memory was filled with NaN first, so an output element the kernels never write
shows up as NaN.
"""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from attention_cuda import _extension, build, cosine_sim_attention, exp_attention, fastmax_attention
from helpers import poison_allocator, rule_violation

pytestmark = pytest.mark.gpu

DTYPES = [getattr(torch, d.torch) for d in build.DTYPES]  # the build list: attention_cuda/build.py
LINEAR_DTYPES = [getattr(torch, d.torch) for d in build.DTYPES if d.linear]  # the linear form's
HEAD_DIMS = list(build.HEAD_DIMS)

FAMILIES = {
    # name: (call(q, k, v, **kw), takes attn_bias, inputs are pre-normalised rows)
    "cosine": (lambda q, k, v, **kw: cosine_sim_attention(q, k, v, scale=10.0, **kw), True, False),
    # the caller normalised q and k: nothing bounds the logits for the kernel, so it keeps a row max
    "cosine_prenormed": (lambda q, k, v, **kw: cosine_sim_attention(q, k, v, scale=10.0, l2norm_qk=False, **kw),
                         True, True),
    "exp": (lambda q, k, v, **kw: exp_attention(q, k, v, scale=0.5 / math.sqrt(q.shape[-1]), **kw), False, False),
    "fastmax": (lambda q, k, v, **kw: fastmax_attention(q, k, v, temperature=math.sqrt(q.shape[-1]),
                                                        form="quadratic", **kw), False, False),
    "fastmax_norm": (lambda q, k, v, **kw: fastmax_attention(q, k, v, normalize=True, lim=1.5, form="quadratic", **kw),
                     False, False),
}
SHAPES = [  # (b, h, h_kv, i, j): length 1, MQA, grouped cross-attention at non-tile lengths, i > j
    (2, 2, 2, 1, 1),
    (1, 4, 1, 77, 77),
    (2, 4, 2, 130, 257),
    (3, 2, 2, 200, 65),
]
FLAGS = ["none", "causal", "mask", "bias", "all"]


def round_to_tf32(x):
    """fp32 -> the nearest value with a 10-bit mantissa (ties away from zero, as cvt.rna.tf32)."""
    return ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


@contextlib.contextmanager
def tf32_matmuls(on):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def make_case(shape, d, family, flag, seed):
    """float64 leaves q, k, v (and attn_bias), the call's keyword arguments and an upstream gradient."""
    b, h, hkv, i, j = shape
    _, takes_bias, prenormed = FAMILIES[family]
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float64)  # noqa: E731
    q, k, v = rand(b, h, i, d), rand(b, hkv, j, d), rand(b, hkv, j, d)
    if prenormed:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    kw, leaves = {}, [q, k, v]
    if flag in ("causal", "all"):
        kw["causal"] = True
    if flag in ("mask", "all"):
        mask = torch.rand(b, j, generator=g, device="cuda") > 0.3
        if b > 1:
            mask[-1] = False  # a batch row with no visible key: zeros, not NaN
        kw["mask"] = mask
    if flag in ("bias", "all") and takes_bias:
        kw["attn_bias"] = 2 * rand(h, i, j)  # (h, i, j): broadcast over the batch as a stride-0 view
        leaves.append(kw["attn_bias"])
    return leaves, kw, rand(b, h, i, d)


def run(call, leaves, kw, dout, dtype, backend):
    """Output and gradients w.r.t. every leaf, computed from copies of the leaves in `dtype`."""
    xs = [t.detach().to(dtype) for t in leaves]
    dout = dout.to(dtype)
    if dtype == torch.float32 and backend == "torch":
        xs[:3], dout = [round_to_tf32(t) for t in xs[:3]], round_to_tf32(dout)
    xs = [t.requires_grad_() for t in xs]
    call_kw = dict(kw, attn_bias=xs[3]) if len(xs) == 4 else kw
    if backend == "cuda":
        poison_allocator()
    with tf32_matmuls(dtype == torch.float32):
        out = call(*xs[:3], backend=backend, **call_kw)
        grads = torch.autograd.grad(out, xs, dout)
    return [out, *grads]


def compare(cases, call, dtype):
    """Check every case (leaves, kwargs, upstream gradient, label); report all violations at once."""
    problems = []
    for leaves, kw, dout, label in cases:
        ref, torch_dt, kernel = (run(call, leaves, kw, dout, dt, be)
                                 for dt, be in ((torch.float64, "torch"), (dtype, "torch"), (dtype, "cuda")))
        for name, k, t, r in zip(["out", "dq", "dk", "dv", "dbias"], kernel, torch_dt, ref):
            problem = rule_violation(k, t, r, dtype)
            if problem:
                problems.append(f"{label} {name}: {problem}")
    assert not problems, "\n".join(problems)


def test_the_extension_reports_the_build_lists_head_dims():
    """What the plan routes by (the ops' head-dim lists) is what build.py compiled: every head dim for every
    dtype; the linear form's sweep where build.py marks the dtype linear; the decode kernel at each of them."""
    reason = _extension.unavailable_reason()
    assert reason is None, reason
    for dt in DTYPES:
        assert _extension.compiled_head_dims(dt) == tuple(HEAD_DIMS), dt
        assert _extension.sweep_head_dims(dt) == (tuple(HEAD_DIMS) if dt in LINEAR_DTYPES else ()), dt
        assert _extension.decode_head_dims(dt) == tuple(HEAD_DIMS), dt
        assert set(_extension.chunked_head_dims(dt)) <= set(_extension.sweep_head_dims(dt)), dt


@pytest.mark.parametrize("family,flag", [(fam, flag) for fam in FAMILIES for flag in FLAGS
                                         if flag != "bias" or FAMILIES[fam][1]])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_kernel_matches_float64(dtype, d, family, flag):
    cases = [(*make_case(shape, d, family, flag, seed=n), str(shape)) for n, shape in enumerate(SHAPES)]
    compare(cases, FAMILIES[family][0], dtype)


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not HOPPER, reason="the portable (mma.sync) and Hopper (wgmma) kernels differ only on sm_90")
@pytest.mark.parametrize("portable", [True, False], ids=["mma_sync", "wgmma"])
@pytest.mark.parametrize("family,flag", [(fam, flag) for fam in FAMILIES for flag in FLAGS
                                         if flag != "bias" or FAMILIES[fam][1]])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda t: str(t).split(".")[-1])
def test_both_kernel_paths_on_hopper(monkeypatch, dtype, d, family, flag, portable):
    """On an H200 the grid above runs the wgmma kernels where they exist; here the mma.sync ones get the
    same cases at the head dims both cover, plus a longer one with many key blocks and query steps."""
    monkeypatch.setenv("ATTN_PORTABLE_KERNELS", "1" if portable else "0")
    shapes = [*SHAPES, (2, 4, 2, 700, 900)]
    cases = [(*make_case(shape, d, family, flag, seed=n), str(shape)) for n, shape in enumerate(shapes)]
    compare(cases, FAMILIES[family][0], dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_padding_masks(dtype, d, family, causal):
    """Key masks that keep a prefix of each batch row, as padding does: in the forward, tiles the mask
    keeps whole take the path that tests nothing per element, the tile holding the cut tests each pair
    (random masks, as in the grid above, leave no whole tile)."""
    cases = []
    for n, keep in enumerate([(700, 333, 129), (64, 640, 1)]):
        leaves, kw, dout = make_case((3, 4, 2, 300, 700), d, family, "causal" if causal else "none", seed=n)
        kw["mask"] = torch.arange(700, device="cuda") < torch.tensor(keep, device="cuda")[:, None]
        cases.append((leaves, kw, dout, f"keep {keep}"))
    compare(cases, FAMILIES[family][0], dtype)


@pytest.mark.parametrize("scale", [1.0, 20.0, 60.0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cosine_scales_past_the_no_max_bound(dtype, scale):
    """Large scales switch the kernel from the fixed shift to a running max (fp16 earliest)."""
    case = (*make_case((2, 2, 2, 130, 150), 64, "cosine", "causal", seed=1), f"scale={scale}")
    compare([case], lambda q, k, v, **kw: cosine_sim_attention(q, k, v, scale=scale, **kw), dtype)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda t: str(t).split(".")[-1])
def test_forward_over_split_keys_matches_float64(monkeypatch, dtype, family):
    """A forward-only call with few query rows and many keys runs split over the keys (plan path "split"),
    the parts merged by their row statistics: one batch row (parts folded into the batch, and a remainder),
    several batch rows with grouped heads, one and a few queries, a key mask as a decode cache has (parts
    it hides whole, a row that sees nothing, garbage behind it); the fixed shift (cosine), the running max
    (pre-normalised cosine) and unnormalised rows (exp) all merge. Cosine's calls with one query row take
    the decode kernel instead (path "decode"; its own tests below)."""
    import attention_cuda.functional as functional
    plans, run = [], functional._run
    monkeypatch.setattr(functional, "_run", lambda plan, *a, **kw: plans.append(plan) or run(plan, *a, **kw))
    call = FAMILIES[family][0]
    problems = []
    for n, (shape, flag) in enumerate([((1, 8, 8, 1, 20000), "none"), ((3, 4, 2, 3, 5000), "none"),
                                       ((1, 2, 1, 1, 1100), "none"), ((3, 4, 2, 1, 5000), "mask")]):
        leaves, kw, _ = make_case(shape, 64, family, flag, seed=n)
        if flag == "mask":  # a decode cache's: a prefix of each row (the last row sees none), garbage past it
            kw["mask"] = torch.arange(shape[-1], device="cuda") < torch.tensor([4321, 700, 0], device="cuda")[:, None]
            for t in leaves[1:3]:
                t.masked_fill_(~kw["mask"][:, None, :, None], float("nan"))
        with torch.no_grad():
            ref, torch_dt = (call(*(t.to(dt) for t in leaves), backend="torch", **kw)
                             for dt in (torch.float64, dtype))
            poison_allocator()
            kernel = call(*(t.to(dtype) for t in leaves), backend="cuda", **kw)
        if family.startswith("cosine") and shape[3] == 1:
            assert plans[-1].path == "decode", str(plans[-1])
        else:
            assert plans[-1].path == "split" and plans[-1].splits > 1, str(plans[-1])
        problem = rule_violation(kernel, torch_dt, ref, dtype)
        if problem:
            problems.append(f"{shape}: {problem}")
    assert not problems, "\n".join(problems)


DECODE_SHAPES = [  # (b, h, h_kv, j): one query row per head over j keys
    (1, 8, 8, 1000),   # the base model's heads, one batch row
    (3, 8, 2, 4097),   # four query heads a kv head, one block for all of them; j one past a power of two
    (2, 6, 2, 1000),   # three query heads a kv head: a block each, over the same keys
    (2, 16, 1, 4097),  # multi-query: 16 heads over one kv head, two blocks of eight
]


def decode_case(shape, d, prenormed, masked, seed):
    """float64 q (b, h, 1, d), k, v and a key mask (or None): single keys hidden, a run of a quarter of the
    keys (whole parts of the kernel's split), a last batch row that sees no key, NaN behind the mask."""
    b, h, hkv, j = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float64)  # noqa: E731
    q, k, v = rand(b, h, 1, d), rand(b, hkv, j, d), rand(b, hkv, j, d)
    if prenormed:  # a decode cache's unit keys and a query normalised as it reads them
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if not masked:
        return (q, k, v), None
    mask = torch.rand(b, j, generator=g, device="cuda") > 0.3
    mask[:, j // 4:j // 2] = False
    if b > 1:
        mask[-1] = False
    for t in (k, v):
        t.masked_fill_(~mask[:, None, :, None], float("nan"))
    return (q, k, v), mask


@pytest.mark.parametrize("masked", [False, True], ids=["all_keys", "mask"])
@pytest.mark.parametrize("prenormed", [False, True], ids=["l2norm", "unit_rows"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_decode_kernel_matches_float64(monkeypatch, dtype, d, prenormed, masked):
    """A forward-only cosine call with one query row per head (a decode step) runs on the decode kernel (plan
    path "decode"), which splits the keys itself: ungrouped, grouped and multi-query heads, one and several
    batch rows, key counts that are multiples of nothing; q and k normalised by the kernel or given as unit
    rows; without a mask, and with one that hides single keys, whole parts and a whole batch row (zeros),
    with NaN in the masked K and V slots, which must reach no output. Outputs start as NaN (the allocator's)."""
    import attention_cuda.functional as functional
    plans, run = [], functional._run
    monkeypatch.setattr(functional, "_run", lambda plan, *a, **kw: plans.append(plan) or run(plan, *a, **kw))
    call = lambda q, k, v, **kw: cosine_sim_attention(q, k, v, scale=10.0, l2norm_qk=not prenormed, **kw)  # noqa: E731
    problems = []
    for n, shape in enumerate(DECODE_SHAPES):
        leaves, mask = decode_case(shape, d, prenormed, masked, seed=n)
        with torch.no_grad():
            ref, torch_dt = (call(*(t.to(dt) for t in leaves), mask=mask, backend="torch")
                             for dt in (torch.float64, dtype))
            poison_allocator()
            kernel = call(*(t.to(dtype) for t in leaves), mask=mask, backend="cuda")
        assert plans[-1].path == "decode", str(plans[-1])
        problem = rule_violation(kernel, torch_dt, ref, dtype)
        if problem:
            problems.append(f"{shape}: {problem}")
        if mask is not None and shape[0] > 1 and not (kernel[-1] == 0).all():
            problems.append(f"{shape}: the batch row that sees no key is not zeros")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda t: str(t).split(".")[-1])
def test_decode_kernel_over_any_split_of_the_keys(dtype):
    """attn_cuda::decode with its parts given: one, a few, parts of a few keys, of one key, more parts than
    keys (as many as keys run), and its own choice (0) all meet the rule; the parts a cache's mask hides
    whole (its unwritten slots, NaN here) add nothing, and the batch row with no key written gives zeros.
    Strided inputs as a model holds them: q a view of a packed projection, k and v interleaved in one
    tensor. It refuses more than one query row, and a scale whose weights leave fp32's normal range."""
    reason = _extension.unavailable_reason()  # loads the ops
    assert reason is None, reason
    b, h, hkv, j, d = 2, 8, 2, 1000, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    qp = torch.randn(b, 1, h, 2 * d, generator=g, device="cuda", dtype=torch.float64)  # (b, t, h, 2d): q's half
    kv = torch.randn(b, hkv, j, 2, d, generator=g, device="cuda", dtype=torch.float64)
    mask = torch.arange(j, device="cuda") < torch.tensor([700, 0], device="cuda")[:, None]
    kv.masked_fill_(~mask[:, None, :, None, None], float("nan"))

    def views(qp, kv):
        return qp[..., :d].transpose(1, 2), kv[..., 0, :], kv[..., 1, :]

    ref, torch_dt = (cosine_sim_attention(*(t.to(dt) for t in views(qp, kv)), mask=mask, scale=10.0, backend="torch")
                     for dt in (torch.float64, dtype))
    qx, kx, vx = views(qp.to(dtype), kv.to(dtype))
    problems = []
    for splits in (0, 1, 3, 333, 999, 1000, 5000):
        poison_allocator()
        out = torch.ops.attn_cuda.decode(qx, kx, vx, mask, 10.0, 1.0, splits)
        problem = rule_violation(out, torch_dt, ref, dtype)
        if problem:
            problems.append(f"splits={splits}: {problem}")
        if not (out[-1] == 0).all():
            problems.append(f"splits={splits}: the batch row that sees no key is not zeros")
    assert not problems, "\n".join(problems)
    with pytest.raises(RuntimeError, match="one query row"):
        torch.ops.attn_cuda.decode(qx.expand(b, h, 2, d), kx, vx, mask, 10.0, 1.0, 0)
    with pytest.raises(RuntimeError, match="normal range"):
        torch.ops.attn_cuda.decode(qx, kx, vx, mask, 50.0, 1.0, 0)


def test_forward_bits_are_reproducible():
    leaves, kw, _ = make_case((2, 4, 2, 300, 300), 64, "cosine", "all", seed=3)
    q, k, v, bias = (t.to(torch.bfloat16) for t in leaves)
    runs = []
    for _ in range(2):
        poison_allocator()
        runs.append(cosine_sim_attention(q, k, v, attn_bias=bias, causal=True, mask=kw["mask"], backend="cuda"))
    assert torch.equal(runs[0], runs[1])


def test_layouts_give_the_same_bits():
    """Merged b*h, one shared kv head, strided views and a non-contiguous head dim: same forward bits."""
    g = torch.Generator(device="cuda").manual_seed(4)
    b, h, n, d = 2, 4, 150, 64
    qkv = torch.randn(b, n, 3, h, 2 * d, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i, :, :d].transpose(1, 2) for i in range(3))  # strided views of a packed tensor
    want = cosine_sim_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, backend="cuda")
    assert torch.equal(cosine_sim_attention(q, k, v, causal=True, backend="cuda"), want)
    wide = qkv[:, :, 0].transpose(1, 2)[..., ::2]  # head dim with stride 2: copied once, same result
    assert torch.equal(cosine_sim_attention(wide, k, v, backend="cuda"),
                       cosine_sim_attention(wide.contiguous(), k, v, backend="cuda"))
    merged = cosine_sim_attention(q.reshape(b * h, n, d), k.reshape(b * h, n, d), v.reshape(b * h, n, d),
                                  causal=True, backend="cuda")
    assert torch.equal(merged, want.reshape(b * h, n, d))
    shared = cosine_sim_attention(q, k[:, 0], v[:, 0], backend="cuda")
    assert torch.equal(shared, cosine_sim_attention(q, k[:, :1], v[:, :1], backend="cuda"))


@pytest.mark.parametrize("d", [64, 128])
def test_upstream_gradient_at_any_offset(d):
    """An upstream gradient that is a view one element into its storage (rows not 16-byte aligned, which
    the kernels' 16-byte loads need): the same gradients as its aligned copy (dQ, summed by atomics in
    any order, to its rounding)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 4, 150, d, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = cosine_sim_attention(q, k, v, causal=True, backend="cuda")
    dout = torch.randn(out.numel() + 1, generator=g, device="cuda", dtype=out.dtype)[1:].view_as(out)
    got = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    want = torch.autograd.grad(out, (q, k, v), dout.clone())
    torch.testing.assert_close(got[0], want[0], rtol=2**-7, atol=1e-3 * want[0].abs().max().item())
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def check_models_layout(out, leaves, g, exact=()):
    """out (B, H, T, D) of leaves (q, k, v) is laid out as (B, T, H, D), so the model's merge of the heads is a
    view; dO as the model hands it back (the merge's gradient), contiguous and heads-first give the same
    gradients: bit for bit at the indices in exact, the others (summed by atomics in any order) to their
    rounding."""
    b, h, n, d = out.shape
    assert out.transpose(1, 2).is_contiguous()
    merged = out.transpose(1, 2).reshape(b, n, h * d)
    assert merged.data_ptr() == out.data_ptr()  # a view: no copy of the output
    upstream = torch.randn(b, n, h * d, generator=g, device=out.device, dtype=out.dtype)
    want = torch.autograd.grad(merged, leaves, upstream, retain_graph=True)  # dO: the (B, T, H, D) order
    dout = upstream.view(b, n, h, d).transpose(1, 2)
    for other in (dout.contiguous(), dout.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)):
        got = torch.autograd.grad(out, leaves, other, retain_graph=True)
        for i, (x, y) in enumerate(zip(got, want)):
            if i in exact:
                assert torch.equal(x, y)
            else:
                torch.testing.assert_close(x, y, rtol=2**-7, atol=1e-3 * y.abs().max().item())


@pytest.mark.parametrize("portable", [True, False], ids=["mma_sync", "wgmma"])
@pytest.mark.parametrize("d", [64, 128])
def test_output_in_the_models_layout_and_any_upstream_order(monkeypatch, d, portable):
    """The forward writes its (B, H, T, D) output over (B, T, H, D) memory, so the model's merge of the
    heads is a view; the backward reads dO and O in any order of their rows. dO as the model hands it back
    (its reshape's gradient), contiguous and heads-first give the same gradients (dQ, summed by atomics in
    any order, to its rounding)."""
    monkeypatch.setenv("ATTN_PORTABLE_KERNELS", "1" if portable else "0")
    g = torch.Generator(device="cuda").manual_seed(8)
    b, h, n = 2, 4, 300
    q, k, v = (torch.randn(b, h, n, d, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    poison_allocator()
    out = cosine_sim_attention(q, k, v, causal=True, backend="cuda")
    assert out.shape == (b, h, n, d)
    assert torch.equal(out, cosine_sim_attention(q, k, v, causal=True, backend="cuda").contiguous())
    check_models_layout(out, (q, k, v), g, exact=(1, 2))


@pytest.mark.parametrize("portable", [True, False], ids=["mma_sync", "wgmma"])
def test_causal_sections_of_heads(monkeypatch, portable):
    """Long causal grids run in sections of a few heads (quadratic/block.cuh's block_slot; at n16384 d128 bf16:
    four heads per forward section, two per backward one), so five heads end on a short section. Every
    block must run once: each head's output and dK, dV are the bits of that head run alone, whose grid
    is one section, and dQ (summed across blocks in another order) agrees to its rounding."""
    monkeypatch.setenv("ATTN_PORTABLE_KERNELS", "1" if portable else "0")
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v, dout = (torch.randn(1, 5, 16384, 128, generator=g, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))

    def run(*heads):
        leaves = [t[:, list(heads)].requires_grad_() for t in (q, k, v)]
        poison_allocator()
        out = cosine_sim_attention(*leaves, causal=True, backend="cuda")
        return (out, *torch.autograd.grad(out, leaves, dout[:, list(heads)]))

    together = run(*range(5))
    for h in range(5):
        out, dq, dk, dv = run(h)
        for name, got, want in [("out", together[0], out), ("dk", together[2], dk), ("dv", together[3], dv)]:
            assert torch.equal(got[:, h:h + 1], want), f"head {h}: {name}"
        torch.testing.assert_close(together[1][:, h:h + 1], dq, rtol=2**-7, atol=1e-3 * dq.abs().max().item())


def test_long_sequence_stays_finite():
    g = torch.Generator(device="cuda").manual_seed(5)
    n = 65536
    q, k, v = (torch.randn(1, 1, n, 64, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    for causal in (False, True):
        out = cosine_sim_attention(q, k, v, causal=causal, backend="cuda")
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        for t in (out, *grads):
            assert torch.isfinite(t).all()
        out = fastmax_attention(q, k, v, causal=causal, normalize=True, form="quadratic", backend="cuda")
        assert torch.isfinite(out).all()


def peak_extra_bytes(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_peak_memory_within_sdpa_flash():
    b, h, n, d = 4, 8, 16384, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)

    def ours():
        torch.autograd.grad(cosine_sim_attention(q, k, v, backend="cuda"), (q, k, v), dout)

    def sdpa():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, scale=10.0)
            torch.autograd.grad(out, (q, k, v), dout)

    ours(), sdpa()  # warm-up: workspaces, the allocator's first segments
    mine, theirs = peak_extra_bytes(ours), peak_extra_bytes(sdpa)
    assert mine <= 1.2 * theirs, f"peak extra memory {mine / 2**20:.0f} MiB vs SDPA flash {theirs / 2**20:.0f} MiB"


def test_autocast_runs_in_the_autocast_dtype():
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (torch.randn(2, 2, 100, 64, generator=g, device="cuda", requires_grad=True) for _ in range(3))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = cosine_sim_attention(q, k, v, causal=True, backend="cuda")
    assert out.dtype == torch.bfloat16
    want = cosine_sim_attention(*(t.detach().bfloat16() for t in (q, k, v)), causal=True, backend="cuda")
    assert torch.equal(out, want)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(gr.dtype == torch.float32 and torch.isfinite(gr).all() for gr in grads)


def test_torch_compile_traces_without_graph_breaks():
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 4, 96, 64, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    bias = torch.randn(4, 96, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(q, k, v, bias):
        return cosine_sim_attention(q, k, v, attn_bias=bias, causal=True, backend="cuda").float().square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, bias), (q, k, v, bias))
    want = torch.autograd.grad(f(q, k, v, bias), (q, k, v, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("make,match", [
    (lambda: torch.randn(1, 2, 8, 48, device="cuda", dtype=torch.bfloat16), "head dim 48"),
    (lambda: torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.float64), "float64"),
])
def test_unsupported_inputs_raise_clearly(make, match):
    q = make()
    with pytest.raises(NotImplementedError, match=match):
        cosine_sim_attention(q, q, q, backend="cuda")
