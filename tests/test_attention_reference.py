"""The pure-PyTorch references against a float64 brute-force loop written from the DESIGN.md math."""
import importlib
import itertools
import math
import zlib

import pytest
import torch

import attention_cuda
from attention_cuda import FastMultiHeadAttention, cosine_sim_attention, exp_attention, fastmax_attention
from attention_cuda.crossovers import FROM_KEYS

F64 = torch.float64
TRAINING = {path: FROM_KEYS[path]["fwd+bwd"] for path in FROM_KEYS}  # the crossovers of differentiated calls

FAMILIES = {
    # name: (call, brute-force weight function f(x), logit scale, row norm or None, normalise rows)
    "cosine": (lambda q, k, v, **kw: cosine_sim_attention(q, k, v, scale=10.0, **kw),
               lambda x: math.exp(x - 10.0), 10.0, 1.0, True),
    "exp": (lambda q, k, v, **kw: exp_attention(q, k, v, scale=0.5, **kw),
            math.exp, 0.5, None, False),
    "fastmax2": (lambda q, k, v, **kw: fastmax_attention(q, k, v, temperature=2.0, **kw),
                 lambda x: 1 + x + 0.5 * x * x, 0.5, None, True),
    "fastmax2_norm": (lambda q, k, v, **kw: fastmax_attention(q, k, v, normalize=True, lim=1.5, **kw),
                      lambda x: 1 + x + 0.5 * x * x, 1.0, 1.5, True),
    "fastmax1_norm": (lambda q, k, v, **kw: fastmax_attention(q, k, v, p=1, normalize=True, a1=0.8, **kw),
                      lambda x: 1 + 0.8 * x, 1.0, 1.0, True),
}


def brute_force(family, q, k, v, causal=False, mask=None, bias=None):
    """One query row at a time, one key at a time: O_t = sum_s f(x_ts) v_s [/ sum_s f(x_ts)]."""
    _, f, scale, norm, normalise = FAMILIES[family]
    b, h, i, d = q.shape
    hkv, j = k.shape[1], k.shape[2]
    rows = []
    for bi, hi, t in itertools.product(range(b), range(h), range(i)):
        kh = hi // (h // hkv)
        qt = q[bi, hi, t]
        if norm is not None:
            qt = qt * norm / torch.clamp(qt.norm(), min=1e-12)
        num, den = torch.zeros(d, dtype=F64), torch.zeros((), dtype=F64)
        for s in range(j):
            if (causal and s > t + j - i) or (mask is not None and not mask[bi, s]):
                continue
            ks = k[bi, kh, s]
            if norm is not None:
                ks = ks * norm / torch.clamp(ks.norm(), min=1e-12)
            x = scale * (qt @ ks) + (bias[bi, hi, t, s] if bias is not None else 0)
            w = torch.exp(x - 10.0) if family == "cosine" else (torch.exp(x) if family == "exp" else f(x))
            num, den = num + w * v[bi, kh, s], den + w
        rows.append(num / den if normalise and den > 0 else (num if not normalise else num * 0))
    return torch.stack(rows).reshape(b, h, i, d)


def rand(*shape, grad=True):
    return torch.randn(*shape, dtype=F64, requires_grad=grad)


def grads(out, inputs, seed=0):
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


def assert_close_all(xs, ys, tol=1e-9):
    for x, y in zip(xs, ys):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("i,j", [(6, 6), (4, 7), (7, 4), (1, 5)])
@pytest.mark.parametrize("kv", ["mha", "grouped", "shared"])
def test_reference_matches_brute_force(family, causal, masked, i, j, kv):
    # A seed of its own per case, the same in every process (str hashes are salted per process).
    torch.manual_seed(zlib.crc32(repr((family, causal, masked, i, j, kv)).encode()))
    b, h, d = 2, 4, 8
    hkv = {"mha": 4, "grouped": 2, "shared": 1}[kv]
    q = rand(b, h, i, d)
    k, v = rand(b, hkv, j, d), rand(b, hkv, j, d)
    if family == "exp":  # keep exp(x) in a sane range
        q, k = (q * 0.5).detach().requires_grad_(), (k * 0.5).detach().requires_grad_()
    mask = torch.rand(b, j) > 0.4 if masked else None
    if masked:  # at least one kept key per batch, so that the brute force's output has a graph
        mask[:, -1] = True
    call = FAMILIES[family][0]
    kk, vv = (k[:, 0], v[:, 0]) if kv == "shared" else (k, v)  # (b, j, d): one shared kv head
    out = call(q, kk, vv, causal=causal, mask=mask, backend="torch")
    ref = brute_force(family, q, k, v, causal, mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    assert_close_all(grads(out, (q, k, v)), grads(ref, (q, k, v)))


@pytest.mark.parametrize("bias_shape", ["hij", "bhij", "b1ij"])
@pytest.mark.parametrize("causal", [False, True])
def test_cosine_bias_and_its_gradient(bias_shape, causal):
    torch.manual_seed(1)
    b, h, i, j, d = 2, 3, 5, 6, 8
    q, k, v = rand(b, h, i, d), rand(b, h, j, d), rand(b, h, j, d)
    shape = {"hij": (h, i, j), "bhij": (b, h, i, j), "b1ij": (b, 1, i, j)}[bias_shape]
    bias = (torch.randn(*shape, dtype=F64) * 20).requires_grad_()  # large: breaks the logit bound
    out = cosine_sim_attention(q, k, v, causal=causal, attn_bias=bias, backend="torch")
    ref = brute_force("cosine", q, k, v, causal, bias=bias.expand(b, h, i, j))
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    assert_close_all(grads(out, (q, k, v, bias)), grads(ref, (q, k, v, bias)))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merged_batch_heads_equal_4d(family):
    torch.manual_seed(2)
    q, k, v = rand(2, 3, 5, 8), rand(2, 3, 5, 8), rand(2, 3, 5, 8)
    call = FAMILIES[family][0]
    out4 = call(q, k, v, causal=True, backend="torch")
    out3 = call(q.reshape(6, 5, 8), k.reshape(6, 5, 8), v.reshape(6, 5, 8), causal=True, backend="torch")
    assert out3.shape == (6, 5, 8)
    torch.testing.assert_close(out3.reshape(2, 3, 5, 8), out4)


def test_merged_mask_and_bias_are_per_batch_head():
    torch.manual_seed(3)
    q, k, v = rand(6, 4, 8), rand(6, 5, 8), rand(6, 5, 8)
    mask, bias = torch.rand(6, 5) > 0.3, torch.randn(6, 4, 5, dtype=F64)
    out = cosine_sim_attention(q, k, v, mask=mask, attn_bias=bias, backend="torch")
    ref = brute_force("cosine", q[:, None], k[:, None], v[:, None], mask=mask, bias=bias[:, None])
    torch.testing.assert_close(out, ref[:, 0])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_without_visible_keys_are_zero_not_nan(family):
    q, k, v = rand(2, 2, 4, 8), rand(2, 2, 6, 8), rand(2, 2, 6, 8)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1] = False  # batch 1 sees nothing
    out = FAMILIES[family][0](q, k, v, mask=mask, backend="torch")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert all(torch.isfinite(g).all() for g in grads(out, (q, k, v)))
    # causal with i > j: the first i - j queries see no key (bottom-right alignment)
    out = FAMILIES[family][0](rand(1, 1, 7, 8), k[:1, :1, :3], v[:1, :1, :3], causal=True, backend="torch")
    assert torch.equal(out[0, 0, :4], torch.zeros(4, 8, dtype=F64)) and out[0, 0, 4:].abs().sum() > 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("i,j", [(1, 1), (9, 9), (37, 37), (11, 30), (30, 11)])
@pytest.mark.parametrize("p,normalize", [(2, False), (2, True), (1, True)])
def test_fastmax_linear_form_equals_quadratic(causal, masked, i, j, p, normalize):
    torch.manual_seed(4)
    q, k, v = rand(2, 4, i, 8), rand(2, 2, j, 8), rand(2, 2, j, 8)
    mask = torch.rand(2, j) > 0.3 if masked else None
    kw = dict(causal=causal, mask=mask, p=p, normalize=normalize, temperature=1.5, backend="torch")
    quad = fastmax_attention(q, k, v, form="quadratic", **kw)
    lin = fastmax_attention(q, k, v, form="linear", **kw)
    torch.testing.assert_close(lin, quad, rtol=1e-10, atol=1e-10)
    assert_close_all(grads(lin, (q, k, v)), grads(quad, (q, k, v)), tol=1e-9)


def test_fastmax_linear_form_chunks_and_fp32_state():
    """Many chunks at a length that is no chunk multiple; bf16 inputs keep fp32 moments."""
    from attention_cuda import reference
    from attention_cuda.score import fastmax_policy
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 203, 16) for _ in range(3))
    pol = fastmax_policy(2, 1.0, 1.0, 0.5, 4.0, False, 1.0)
    ref = reference.quadratic(q.double(), k.double(), v.double(), None, None, True, pol)
    lin = reference.fastmax_linear(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, True, pol, chunk=16)
    assert lin.dtype == torch.bfloat16
    err = (lin.double() - ref).norm() / ref.norm()
    assert err < 1e-2, err


def test_fastmax_auto_form_picks_linear_for_long_sequences(monkeypatch):
    from attention_cuda import reference
    from attention_cuda.plan import fastmax_features
    picked = []
    monkeypatch.setattr(reference, "fastmax_linear", lambda *a, **kw: picked.append("linear") or a[0])
    monkeypatch.setattr(reference, "quadratic", lambda *a, **kw: picked.append("quadratic") or a[0])
    d = 4
    cross = fastmax_features(d, 2)
    for n in (cross, cross + 1):
        x = torch.randn(1, 1, n, d)
        fastmax_attention(x, x, x, backend="torch")
        fastmax_attention(x, x, x, backend="torch", dropout=0.1)  # dropout forces the quadratic form
    assert picked == ["quadratic", "quadratic", "linear", "quadratic"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["cosine", "fastmax2"])
def test_low_precision_inputs_stay_close(dtype, family):
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 2, 33, 16) for _ in range(3))
    call = FAMILIES[family][0]
    ref = call(q.double(), k.double(), v.double(), causal=True, backend="torch")
    out = call(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, backend="torch")
    assert out.dtype == dtype
    assert (out.double() - ref).norm() / ref.norm() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_fastmax_dropout_drops_weights():
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 1, 16, 8) for _ in range(3))
    plain = fastmax_attention(q, k, v, form="quadratic", backend="torch")
    torch.manual_seed(0)
    a = fastmax_attention(q, k, v, dropout=0.5, form="quadratic", backend="torch")
    torch.manual_seed(0)
    b = fastmax_attention(q, k, v, dropout=0.5, form="quadratic", backend="torch")
    assert torch.equal(a, b) and not torch.allclose(a, plain)
    with pytest.raises(NotImplementedError, match="dropout"):
        fastmax_attention(q, k, v, dropout=0.1, form="linear", backend="torch")


def test_fast_multihead_attention_accepts_the_original_call():
    torch.manual_seed(8)
    b, h, n, d = 2, 3, 10, 8
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    fm = FastMultiHeadAttention(use_custom_gradient=True)
    rpe = torch.zeros(2 * n - 1, d)
    noise = torch.randn(b, h, n, d)
    out4 = fm(q, k, v, noise, rpe, True, 0.0, True, 1.0, 1.0, 1.0, 0.5, 1.0, 2)
    out3 = fm(q.reshape(b * h, n, d), k.reshape(b * h, n, d), v.reshape(b * h, n, d), noise, rpe, mask=True,
              normalize=True)
    assert out4.shape == (b, h, n, d) and out3.shape == (b * h, n, d)
    torch.testing.assert_close(out3.reshape(b, h, n, d), out4)
    ref = fastmax_attention(q, k, v, causal=True, normalize=True, backend="torch")
    torch.testing.assert_close(out4, ref)
    torch.testing.assert_close(FastMultiHeadAttention(False)(q, k, v, mask=False, p=1, normalize=True),
                               fastmax_attention(q, k, v, p=1, normalize=True, backend="torch"))
    with pytest.raises(NotImplementedError, match="rpe_matrix"):
        fm(q, k, v, noise, torch.ones(2 * n - 1, d), True)
    with pytest.raises(ValueError, match="mask"):
        fm(q, k, v, mask=torch.ones(b, n, dtype=torch.bool))
    with pytest.warns(UserWarning, match="drop_noise"):
        fm(q, k, v, noise, None, False, 0.1)


BAD_CALLS = [
    (dict(q=torch.randn(2, 4, 8)), "k"),                                     # merged q, 4d k
    (dict(q=torch.randn(4, 8)), "q"),
    (dict(k=torch.randn(2, 3, 5, 8), v=torch.randn(2, 3, 5, 8)), "h_kv"),    # 3 does not divide 4
    (dict(k=torch.randn(3, 4, 5, 8), v=torch.randn(3, 4, 5, 8)), "batch"),
    (dict(k=torch.randn(2, 4, 5, 4), v=torch.randn(2, 4, 5, 4)), "head dim"),
    (dict(v=torch.randn(2, 4, 6, 8)), "same shape"),
    (dict(q=torch.randn(2, 4, 5, 8, dtype=torch.float64)), "one dtype"),
    (dict(q=torch.randint(0, 3, (2, 4, 5, 8))), "dtype"),
    (dict(q=torch.randn(2, 4, 0, 8)), "non-empty"),
    (dict(mask=torch.ones(2, 5)), "bool"),
    (dict(mask=torch.ones(2, 4, dtype=torch.bool)), "mask"),
    (dict(backend="triton"), "backend"),
]


@pytest.mark.parametrize("kwargs,match", BAD_CALLS)
def test_bad_inputs_name_the_problem(kwargs, match):
    args = dict(q=torch.randn(2, 4, 5, 8), k=torch.randn(2, 4, 5, 8), v=torch.randn(2, 4, 5, 8))
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        cosine_sim_attention(**args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(p=3), "p"),
    (dict(temperature=0.0), "temperature"),
    (dict(a0=0.1), "a0, a1, a2"),                       # 1 - 4*0.1*0.5 > 0: f dips below zero
    (dict(p=1), "normalize"),                           # a linear f is negative somewhere on R
    (dict(p=1, normalize=True, lim=2.0), "a0, a1, a2"),  # |x| <= 4 > a0/a1
    (dict(a0=0.0, a1=0.0, a2=0.0), "identically zero"),
    (dict(dropout=1.0), "dropout"),
    (dict(form="cubic"), "form"),
])
def test_fastmax_rejects_bad_settings(kwargs, match):
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match=match):
        fastmax_attention(x, x, x, backend="torch", **kwargs)


def test_bias_shape_and_backend_errors():
    x = torch.randn(2, 4, 5, 8)
    with pytest.raises(ValueError, match="attn_bias"):
        cosine_sim_attention(x, x, x, attn_bias=torch.randn(3, 5, 5), backend="torch")
    with pytest.raises(NotImplementedError, match='backend="cuda"'):
        cosine_sim_attention(x, x, x, backend="cuda")
    # "auto" on CPU tensors runs the reference
    torch.testing.assert_close(cosine_sim_attention(x, x, x), cosine_sim_attention(x, x, x, backend="torch"))


def test_fastmax_crossover_is_the_chunked_kernels_where_they_run(fake_kernels):
    """The key count from which "auto" takes the linear form: the chunked kernels' own crossover where
    they run (Hopper, d64 and d128), the sweep's elsewhere; p = 1 never; the FLOPs crossover without them."""
    from attention_cuda.plan import fastmax_features, linear_from_keys
    bf16 = torch.bfloat16
    assert linear_from_keys(64, 2, bf16, True)[0] == TRAINING["chunked"][64] < TRAINING["sweep"][64]
    assert linear_from_keys(32, 2, bf16, True)[0] == TRAINING["sweep"][32]
    assert linear_from_keys(64, 1, bf16, True)[0] == math.inf
    assert linear_from_keys(64, 2, bf16, False)[0] == fastmax_features(64, 2) + 1
    # A forward-only call (an evaluation, a prefill) skips the backward that the linear form wins most on.
    assert linear_from_keys(64, 2, bf16, True, forward_only=True)[0] == FROM_KEYS["chunked"]["fwd"][64] > TRAINING["chunked"][64]
    fake_kernels.chunked = ()  # an sm_80 GPU
    assert linear_from_keys(128, 2, bf16, True)[0] == TRAINING["sweep"][128]


def test_a_forward_only_call_takes_the_forward_crossover(fake_kernels, monkeypatch):
    """A call that will not be differentiated (no_grad, or no input asks for a gradient) is planned as
    forward-only; between the training and the forward crossovers "auto" then keeps the tiled quadratic
    form, which is faster there without the backward that the linear form wins most on."""
    from attention_cuda import functional
    from attention_cuda.score import fastmax_policy
    plans = importlib.import_module("attention_cuda.plan")  # the module, which the package's plan() shadows
    asked = []
    monkeypatch.setattr(functional, "resolve", lambda **kw: asked.append(kw["forward_only"]) or plans.resolve(**kw))
    q = torch.zeros(1, 1, 8, 16, requires_grad=True)
    fastmax_attention(q, q, q, causal=True)
    with torch.no_grad():
        fastmax_attention(q, q, q, causal=True)
    fastmax_attention(q.detach(), q.detach(), q.detach(), causal=True)
    assert asked == [False, True, True]
    keys = TRAINING["chunked"][64]
    forms = [plans.resolve(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=64, keys=keys,
                           policy=fastmax_policy(**FASTMAX), form="auto", forward_only=forward_only)
             for forward_only in (False, True)]
    assert [p.form for p in forms] == ["linear", "quadratic"] and "fwd crossover" in str(forms[1])
    assert plans.TUNING.from_keys is FROM_KEYS


FASTMAX = dict(p=2, a0=1.0, a1=1.0, a2=0.5, temperature=1.0, normalize=False, lim=1.0)


def fastmax_plan(keys, head_dim=16, dtype=torch.bfloat16, **kwargs):
    return attention_cuda.plan("fastmax", device="cuda", dtype=dtype, head_dim=head_dim, keys=keys,
                               **{"form": "auto", **FASTMAX, **kwargs})


@pytest.mark.parametrize("options", [dict(), dict(p=1, a2=0.0, normalize=True, lim=2.0), dict(normalize=True)])
def test_fastmax_moments_add_up_and_read_as_attention_over_their_keys(options):
    """fastmax_read over fastmax_moments is fastmax_attention with every query seeing every key (grouped
    heads), and the moments of two runs of keys add up to those of both."""
    from attention_cuda import fastmax_moments, fastmax_read
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 3, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 50, 16, generator=g, dtype=torch.float64) for _ in range(2))
    options = {"temperature": 4.0, **options}
    state = fastmax_moments(k, v, **options)
    assert state.dtype == torch.float32
    want = fastmax_attention(q, k, v, form="quadratic", **options)
    torch.testing.assert_close(fastmax_read(q, state, **options), want, rtol=1e-5, atol=1e-5)
    halves = fastmax_moments(k[:, :, :20], v[:, :, :20], **options) + fastmax_moments(k[:, :, 20:], v[:, :, 20:], **options)
    torch.testing.assert_close(halves, state, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="state: expected"):
        fastmax_read(q[..., :8], state, **options)
    with pytest.raises(ValueError, match="k, v: expected"):
        fastmax_moments(k, v[:, :, :10], **options)


def test_fastmax_moments_stay_fp32_under_autocast_and_over_long_prefills():
    """A decoder's state is summed in fp32 whatever autocast says (bf16 products would round the sums a
    read divides), over runs of MOMENT_KEYS keys: the same state as the keys' features taken at once."""
    from attention_cuda import fastmax_moments, fastmax_read, reference
    from attention_cuda.score import fastmax_policy
    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(1, 2, 2 * reference.MOMENT_KEYS + 300, 8, generator=g) for _ in range(2))
    q = torch.randn(1, 2, 1, 8, generator=g)
    with torch.autocast("cpu", torch.bfloat16):
        state = fastmax_moments(k, v, temperature=4.0)
        out = fastmax_read(q, state, temperature=4.0)
    assert state.dtype == out.dtype == torch.float32
    whole = reference.key_moment(k, v, torch.ones_like(k[..., :1], dtype=torch.bool),
                                  fastmax_policy(2, 1.0, 1.0, 0.5, 4.0, False, 1.0))
    torch.testing.assert_close(state, whole, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(out, fastmax_read(q, whole, temperature=4.0), rtol=1e-5, atol=1e-6)


def test_the_plan_traces_with_a_symbolic_key_count():
    """Under torch.compile with a dynamic sequence length the plan's key count is symbolic: it is kept in
    the plan's reasons as it is (formatted only when read), so the call traces as one graph."""
    def f(q, k, v):
        return fastmax_attention(q, k, v, causal=True, form="auto", temperature=4.0).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    for n in (40, 56):
        q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v))


def test_fastmax_auto_form_on_the_kernels_follows_the_measured_crossover(fake_kernels):
    """Where the kernels run, "auto" takes their linear form from the key count measured per head dim
    (p = 2, fp16/bf16), else their tiled quadratic form; form="linear" reaches the linear-form kernels,
    whose limits raise; keys that fit one chunk run as one tiled block. Each decision says why."""
    from attention_cuda import build
    from attention_cuda.plan import TUNING
    cross = TRAINING["sweep"][16]
    assert fastmax_plan(cross - 1).form == "quadratic"
    linear = fastmax_plan(cross)
    assert (linear.backend, linear.form, linear.path, linear.chunk) == ("cuda", "linear", "sweep", build.LINEAR_CHUNK)
    assert "measured fwd+bwd crossover" in str(linear) and "bench/" in str(linear)
    assert fastmax_plan(cross, backend="cuda").form == "linear"
    assert fastmax_plan(cross, p=1, a2=0.0, normalize=True).form == "quadratic"  # p = 1: not measured
    assert fastmax_plan(cross, dtype=torch.float32).form == "quadratic"  # no fp32 linear kernel
    chunked = fastmax_plan(2 * TRAINING["chunked"][64], head_dim=64)
    assert (chunked.path, chunked.chunk) == ("chunked", TUNING.chunked_rows)
    small = fastmax_plan(100, backend="cuda", form="linear")
    assert (small.form, small.path) == ("quadratic", "tiled") and "fit one sweep chunk" in str(small)
    tuned = fastmax_plan(2 * TRAINING["chunked"][64], head_dim=64, tuning=attention_cuda.Tuning(chunked_rows=0))
    assert tuned.path == "sweep"
    with pytest.raises(NotImplementedError, match="float16 and bfloat16"):
        fastmax_plan(cross, dtype=torch.float32, backend="cuda", form="linear")
    with pytest.raises(NotImplementedError, match="dropout"):
        fastmax_plan(cross, backend="cuda", dropout=0.1)
    assert fastmax_plan(cross, dropout=0.1).backend == "torch"


def test_forward_only_calls_with_few_query_blocks_split_their_keys(fake_kernels, monkeypatch):
    """A forward-only call's few query blocks would leave most SMs idle: its keys go in parts (flash-decoding),
    enough for two blocks an SM, each of at least SPLIT_MIN_KEYS keys; a call whose blocks fill half the
    GPU, that has few keys, or needs the backward (splittable None: functional._plan's decision) runs whole.
    (Cosine's one-row calls take the decode kernel instead: the test below.)"""
    plans = importlib.import_module("attention_cuda.plan")  # the module, which the package's plan() shadows
    from attention_cuda.score import cosine_policy, exp_policy
    assert plans.key_splits(132, 8, 131072) == 33
    assert plans.key_splits(132, 40, 131072) == 7
    assert plans.key_splits(132, 66, 131072) == 1
    assert plans.key_splits(132, 8, 1500) == 2 and plans.key_splits(132, 8, 1000) == 1
    monkeypatch.setattr(plans, "_sm_count", lambda device: 132)

    def resolve(splittable, keys=131072, policy=exp_policy(0.5)):
        return plans.resolve(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=64, keys=keys,
                             policy=policy, splittable=splittable)

    step = resolve((8, 1))
    assert (step.path, step.splits) == ("split", 33) and "keys in 33 parts" in str(step)
    assert resolve((8, 300), policy=cosine_policy(10.0, True)).splits == 11  # 8 heads x 3 query tiles: 264 / 24
    for whole in (resolve(None), resolve((66, 1)), resolve((8, 1), keys=900)):
        assert (whole.path, whole.splits) == ("tiled", 1)


def test_cosine_calls_with_one_query_row_take_the_decode_kernel(fake_kernels, monkeypatch):
    """A forward-only cosine call with one query row per head (a decode step) runs on the decode kernel at any
    batch, head and key count, its q and k normalised by it or given as unit rows, and splits its keys itself
    (plan.splits stays 1). More query rows, a gradient to come (splittable None), another family, or a scale
    whose smallest weight of unit rows, e^(-2 |scale|), is no normal fp32 number keep the split or tiled path."""
    plans = importlib.import_module("attention_cuda.plan")
    from attention_cuda.score import cosine_policy, exp_policy, fastmax_policy
    monkeypatch.setattr(plans, "_sm_count", lambda device: 132)

    def resolve(policy, splittable, keys=131072):
        return plans.resolve(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=64, keys=keys,
                             policy=policy, splittable=splittable)

    assert plans.DECODE_MAX_BOUND == pytest.approx(63 * math.log(2))  # fp32's smallest normal, 2^-126
    for policy in (cosine_policy(10.0, True), cosine_policy(10.0, False), cosine_policy(-43.0, True)):
        for splittable, keys in (((8, 1), 131072), ((128, 1), 131072), ((8, 1), 100)):
            step = resolve(policy, splittable, keys)
            assert (step.path, step.splits) == ("decode", 1) and "the decode kernel" in str(step), str(step)
    assert resolve(cosine_policy(10.0, True), (8, 2)).path == "split"
    assert resolve(cosine_policy(10.0, True), None).path == "tiled"
    assert resolve(cosine_policy(1.01 * plans.DECODE_MAX_BOUND, False), (8, 1)).path == "split"
    assert resolve(exp_policy(0.5), (8, 1)).path == "split"
    assert resolve(fastmax_policy(2, 1.0, 1.0, 0.5, 1.0, False, 1.0), (8, 1)).path == "split"


def test_a_head_dim_a_path_lacks_is_refused_at_plan_time(fake_kernels, monkeypatch):
    """A head dim that the build compiles but a path's kernels do not run (d256, as adding it to build.py's
    HEAD_DIMS with a row in quadratic/tiles.h that has no sweep or chunked kernels would build it; the decode
    kernel takes up to 128) never reaches them: the extension leaves it out of that path's head dims, and the
    plan refuses the linear form with the reason (backend="cuda" raises it, "auto" runs the reference, form="auto"
    stays quadratic on the kernels) and sends a decode step down the split path."""
    from attention_cuda import _extension
    from attention_cuda.score import cosine_policy, fastmax_policy
    plans = importlib.import_module("attention_cuda.plan")
    monkeypatch.setattr(plans, "_sm_count", lambda device: 132)
    monkeypatch.setattr(_extension, "HEAD_DIMS", (*_extension.HEAD_DIMS, 256))
    fake_kernels.compiled = _extension.HEAD_DIMS

    def resolve(head_dim, policy=fastmax_policy(**FASTMAX), **kw):
        return plans.resolve(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=head_dim, keys=131072,
                             policy=policy, **kw)

    why = "no linear-form kernel runs head dim 256 here"
    with pytest.raises(NotImplementedError, match=why):
        resolve(256, form="linear", backend="cuda")
    assert resolve(256, form="linear").backend == "torch" and why in str(resolve(256, form="linear"))
    auto = resolve(256, form="auto")
    assert (auto.backend, auto.form, auto.path) == ("cuda", "quadratic", "tiled") and why in str(auto)
    assert [resolve(d, form="linear").path for d in (128, 96)] == ["chunked", "sweep"]
    fake_kernels.sweep = (16, 32, 64, 96)  # a chunked head dim runs the linear form without a sweep
    assert resolve(128, form="linear").path == "chunked"
    with pytest.raises(NotImplementedError, match="no linear-form kernel runs head dim 128"):
        resolve(128, form="linear", backend="cuda", tuning=plans.Tuning(chunked_rows=0))

    step = cosine_policy(10.0, True)
    assert resolve(128, step, splittable=(8, 1)).path == "decode"
    assert resolve(256, step, splittable=(8, 1)).path == "split"


def test_a_decode_step_on_the_kernels_reaches_the_decode_op(fake_kernels, monkeypatch):
    """functional's glue to attn_cuda::decode (kernel_standins' stand-in, on a CPU, with the plan told that the
    kernels run): a forward-only cosine call with one query row per head, grouped kv heads and a key mask, runs
    it in the plan's dtype with the call's scale and qk norm, its q and k normalised there or given as unit rows,
    and NaN behind the mask reaches no output; with a gradient to come the same call takes the tiled kernels."""
    import functools

    import kernel_standins
    from attention_cuda import functional
    from attention_cuda.score import cosine_policy
    plans = importlib.import_module("attention_cuda.plan")
    monkeypatch.setattr(plans, "kernels_reason", lambda device, dtype, head_dim: None)
    kernel_standins.install(functools.partial(monkeypatch.setattr, raising=False))
    seen, run = [], functional._run
    monkeypatch.setattr(functional, "_run", lambda plan, *a, **kw: seen.append(plan) or run(plan, *a, **kw))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 16, generator=gen)
    k, v = (torch.randn(3, 2, 50, 16, generator=gen) for _ in range(2))
    mask = torch.rand(3, 50, generator=gen) > 0.3
    mask[-1] = False  # a batch row that sees no key: zeros
    for x in (k, v):
        x.masked_fill_(~mask[:, None, :, None], float("nan"))
    unit = functools.partial(torch.nn.functional.normalize, dim=-1)
    for l2norm, (qs, ks) in ((True, (q, k)), (False, (unit(q), unit(k)))):
        want = cosine_sim_attention(qs.double(), ks.double(), v.double(), mask=mask, scale=7.0, l2norm_qk=l2norm,
                                    backend="torch")
        with torch.no_grad():
            got = cosine_sim_attention(qs, ks, v, mask=mask, scale=7.0, l2norm_qk=l2norm, backend="cuda")
        assert seen[-1].path == "decode" and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        assert (got[-1] == 0).all()
    call = functional._canonicalize(q.clone().requires_grad_(), k, v, mask)
    assert functional._plan(call, False, cosine_policy(7.0, True), "cuda").path == "tiled"
