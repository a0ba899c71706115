"""Bad settings name the parameter at fault and say what was expected (issue 56, item 6): score options of
the wrong type or value, exp weights that overflow on the data, and plan()'s options and their defaults."""
import math
import re

import pytest
import torch

import attention_cuda
from attention_cuda import (cosine_sim_attention, exp_attention, fastmax_attention, fastmax_moments, functional,
                            reference)
from attention_cuda.score import exp_policy

F64 = torch.float64
X = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(0))

# (call, the error's pattern): each message starts with the parameter's name
BAD_OPTIONS = [
    (lambda: cosine_sim_attention(X, X, X, scale="ten"), r"^scale: expected a finite real number, got 'ten'$"),
    (lambda: cosine_sim_attention(X, X, X, scale=True), r"^scale: expected a finite real number, got True$"),
    (lambda: cosine_sim_attention(X, X, X, scale=math.nan), r"^scale: expected a finite real number, got nan$"),
    (lambda: cosine_sim_attention(X, X, X, scale=None), r"^scale: expected a finite real number, got None$"),
    (lambda: cosine_sim_attention(X, X, X, l2norm_qk="yes"), r"^l2norm_qk: expected True or False, got 'yes'$"),
    (lambda: cosine_sim_attention(X, X, X, l2norm_qk=1), r"^l2norm_qk: expected True or False, got 1$"),
    (lambda: exp_attention(X, X, X, scale="ten"), r"^scale: expected a finite real number, got 'ten'$"),
    (lambda: exp_attention(X, X, X, scale=False), r"^scale: expected a finite real number, got False$"),
    (lambda: exp_attention(X, X, X, scale=-math.inf), r"^scale: expected a finite real number, got -inf$"),
    (lambda: fastmax_attention(X, X, X, p=True), r"^p: expected 1 or 2, got True$"),
    (lambda: fastmax_attention(X, X, X, p="2"), r"^p: expected 1 or 2, got '2'$"),
    (lambda: fastmax_attention(X, X, X, a0="1"), r"^a0: expected a finite real number, got '1'$"),
    (lambda: fastmax_attention(X, X, X, a1=True), r"^a1: expected a finite real number, got True$"),
    (lambda: fastmax_attention(X, X, X, a2=None), r"^a2: expected a finite real number, got None$"),
    (lambda: fastmax_attention(X, X, X, temperature="hot"), r"^temperature: expected a finite real number, got 'hot'$"),
    (lambda: fastmax_attention(X, X, X, temperature=5e-324), r"^temperature: expected > 0 with a finite 1/temperature"),
    (lambda: fastmax_attention(X, X, X, normalize="yes"), r"^normalize: expected True or False, got 'yes'$"),
    (lambda: fastmax_attention(X, X, X, normalize=1, lim=2.0), r"^normalize: expected True or False, got 1$"),
    (lambda: fastmax_attention(X, X, X, normalize=True, lim=True), r"^lim: expected a finite real number, got True$"),
    (lambda: fastmax_moments(X, X, lim="1"), r"^lim: expected a finite real number, got '1'$"),
    (lambda: attention_cuda.plan("exp", device="cpu", dtype=torch.float32, head_dim=8, keys=5, scale="ten"),
     r"^scale: expected a finite real number, got 'ten'$"),
]


@pytest.mark.parametrize("call,match", BAD_OPTIONS)
def test_a_bad_score_option_names_itself(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_numbers_of_other_real_types_are_taken():
    """An int where a float is meant is fine, and gives the same output as the float."""
    torch.testing.assert_close(cosine_sim_attention(X, X, X, scale=3), cosine_sim_attention(X, X, X, scale=3.0))
    torch.testing.assert_close(fastmax_attention(X, X, X, a0=1, temperature=2),
                               fastmax_attention(X, X, X, a0=1.0, temperature=2.0))


# --- exp: weights that overflow on the data ---------------------------------------------------------------

def randn(*shape, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=gen, dtype=F64).to(dtype) for _ in range(3))


@pytest.mark.parametrize("dtype,limit", [(torch.float32, "3.40282e+38"), (torch.float16, "65504")])
def test_exp_refuses_an_output_that_overflowed_on_finite_inputs(dtype, limit):
    """At the default scale (8) randn rows of head dim 16 reach logits past ~88, where exp(x) is inf in fp32;
    the error names scale, the dtype the weights were computed in, how many outputs overflowed and the way out."""
    q, k, v = randn(1, 1, 64, 16, dtype=dtype)
    unchecked = reference.quadratic(q, k, v, None, None, False, exp_policy(8.0))
    overflowed = int((~torch.isfinite(unchecked)).sum())
    assert overflowed > 0
    match = (rf"^scale: 8 overflows {dtype} on these inputs: {overflowed} of 1024 outputs are not finite, .*"
             rf"max {re.escape(limit)} .*a smaller scale, or l2-normalise q and k")
    with pytest.raises(ValueError, match=match):
        exp_attention(q, k, v)


def test_exp_on_moderate_logits_matches_float64():
    q, k, v = (t * 0.1 for t in randn(2, 3, 20, 16, seed=1))
    out = exp_attention(q, k, v, scale=1.0)
    want = torch.exp(q.double() @ k.double().transpose(-1, -2)) @ v.double()
    torch.testing.assert_close(out, want.float())


def test_exp_passes_non_finite_inputs_through():
    """A NaN in v is the caller's garbage, not an overflow: the rows that read it are NaN, as before, even where
    other outputs overflowed."""
    q, k, v = randn(1, 1, 64, 16)
    v[0, 0, 3, 0] = math.nan
    out = exp_attention(q, k, v)
    assert torch.isnan(out[..., 0]).all()


def test_exp_under_torch_compile_is_not_checked():
    """The check reads the output back to the host; in a compiled graph it is skipped, so the call traces whole."""
    def moderate(q, k, v):
        return exp_attention(q, k, v, scale=1.0)

    def overflowing(q, k, v):
        return exp_attention(q, k, v)

    q, k, v = (t * 0.1 for t in randn(1, 2, 8, 16, seed=2))
    torch.testing.assert_close(torch.compile(moderate, fullgraph=True, backend="eager")(q, k, v), moderate(q, k, v))
    out = torch.compile(overflowing, fullgraph=True, backend="eager")(*randn(1, 1, 64, 16))
    assert not torch.isfinite(out).all()


# --- plan(): score options and their defaults ------------------------------------------------------------

PLAN_INPUTS = dict(device="cpu", dtype=torch.float32, head_dim=8, keys=5)
DEFAULTS = {  # as the public functions document them
    "cosine": dict(scale=10.0, l2norm_qk=True),
    "exp": dict(scale=8.0),
    "fastmax": dict(p=2, a0=1.0, a1=1.0, a2=0.5, temperature=1.0, normalize=False, lim=1.0),
}
CALLS = {"cosine": cosine_sim_attention, "exp": exp_attention, "fastmax": fastmax_attention}


@pytest.mark.parametrize("family", list(DEFAULTS))
def test_plan_takes_the_functions_defaults(monkeypatch, family):
    """plan() without options plans the policy that the function builds without them, which is the one its
    documented defaults give."""
    policies = []

    def resolve(**kwargs):
        policies.append(kwargs["policy"])
        return real_resolve(**kwargs)

    real_resolve = functional.resolve
    monkeypatch.setattr(functional, "resolve", resolve)
    implicit = attention_cuda.plan(family, **PLAN_INPUTS)
    explicit = attention_cuda.plan(family, **PLAN_INPUTS, **DEFAULTS[family])
    x = torch.zeros(1, 1, 5, 8)  # zero logits: no family's weights overflow
    CALLS[family](x, x, x, backend="torch")
    assert implicit == explicit
    assert policies[0] == policies[1] == policies[2]


@pytest.mark.parametrize("family,option,options", [
    ("cosine", "temperatur", "scale, l2norm_qk"),
    ("exp", "l2norm_qk", "scale"),
    ("fastmax", "scale", "p, a0, a1, a2, temperature, normalize, lim"),
])
def test_plan_names_an_option_the_family_lacks(family, option, options):
    with pytest.raises(ValueError, match=rf"^{option}: not a score option of '{family}'; its options are {options}$"):
        attention_cuda.plan(family, **PLAN_INPUTS, **{option: 2})
