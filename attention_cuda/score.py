"""Score policies: the one thing that differs between the attention families.

Every family computes, per query row t, ``O_t = sum_s A_ts v_s / l_t`` with ``l_t = sum_s A_ts``
(or no division, for ``exp``), where ``A = f(x)`` of a logit ``x``. The references and the CUDA
kernels share this description, so a family is a policy, not a copy of the attention code.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

KINDS = ("cosine", "exp", "fastmax")


@dataclass(frozen=True)
class ScorePolicy:
    """How logits become weights.

    kind:        "cosine": A = exp(x - scale) (bounded by 1 when q, k are unit rows and there is no bias)
                 "exp":    A = exp(x), no division by l
                 "fastmax": A = a0 + a1 x + a2 x^2 (a2 = 0 for p = 1)
    scale:       x = scale * (q . k) [+ bias]; q and k are first scaled to norm ``qk_norm`` when it is set.
    qk_norm:     None, or the norm each q and k row is scaled to before the dot product (cosine: 1,
                 fastmax ``normalize``: ``lim``). Zero rows stay zero (``x / max(|x|, eps)``).
    normalize_rows: divide by l (False only for "exp").
    """

    kind: str
    scale: float
    qk_norm: float | None = None
    a0: float = 0.0
    a1: float = 0.0
    a2: float = 0.0
    normalize_rows: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"ScorePolicy.kind: expected one of {KINDS}, got {self.kind!r}")
        if not math.isfinite(self.scale):
            raise ValueError(f"scale: expected a finite number, got {self.scale}")

    def check_range(self, dtype: torch.dtype) -> None:
        """Refuse, before any work, a policy whose logits or weights overflow ``dtype``, the dtype they
        are computed in (an overflow there makes every output NaN).

        The logit checked is the largest reachable one where rows have a fixed norm: |scale| for cosine
        (unit rows: l2norm_qk, or the caller's promise without it), lim**2 / temperature for fastmax with
        normalize. Where nothing bounds the logits (fastmax without normalize, exp) it is the logit of
        |q.k| = 1, |scale|: a setting that overflows there overflows at any useful input. Both that
        logit and the largest weight it gives (cosine: 1; exp: e^x; fastmax: |a0| + |a1| x + |a2| x^2,
        which bounds |f| on [-x, x]) must be at most the dtype's max. attn_bias is the caller's.
        """
        limit = torch.finfo(dtype).max
        x = abs(self.scale) * (1.0 if self.qk_norm is None else self.qk_norm ** 2)
        if self.kind == "fastmax":
            weight = abs(self.a0) + abs(self.a1) * x + abs(self.a2) * x * x
            if x <= limit and weight <= limit:
                return
            logit = (f"the largest reachable logit, {x:g} (= lim**2/temperature, lim={self.qk_norm:g})"
                     if self.qk_norm is not None else
                     f"the logit of |q.k| = 1, {x:g} (= 1/temperature; without normalize no bound exists)")
            raise ValueError(f"temperature: {1 / self.scale:g} overflows {dtype}: {logit} has weight "
                             f"f = {weight:g}, above the dtype's max {limit:g}")
        if self.kind == "cosine" and x > limit:
            raise ValueError(f"scale: {self.scale:g} overflows {dtype}: logits of unit rows reach +-scale, "
                             f"above the dtype's max {limit:g}")
        if self.kind == "exp" and x > math.log(limit):
            raise ValueError(f"scale: {self.scale:g} overflows {dtype}: the weight exp(scale) of q.k = 1 is "
                             f"above the dtype's max {limit:g}")

    @property
    def coef(self) -> tuple[float, ...]:
        """The score function's coefficients as the kernels take them (attn_cuda::fwd's coef)."""
        return (self.a0, self.a1, self.a2)

    @property
    def bounded(self) -> bool:
        """True when every weight is known to lie in (0, 1] without a running row max."""
        return self.kind == "cosine" and self.qk_norm == 1.0


NORM_EPS = 1e-12  # same clamp as torch.nn.functional.normalize, so a zero row maps to zero, not NaN


def real(name: str, value) -> float:
    """``value`` as a float, or a ValueError naming the parameter. A bool is a real number to Python but a
    mistake here, and a string must not reach float(), whose error names no parameter."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite real number, got {value!r}")
    return float(value)


def flag(name: str, value) -> bool:
    """``value`` if it is a bool, else a ValueError naming the parameter: any object is truthy or not, so a
    string such as "no" would silently mean True."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")
    return value


def cosine_policy(scale: float, l2norm_qk: bool) -> ScorePolicy:
    return ScorePolicy("cosine", real("scale", scale), 1.0 if flag("l2norm_qk", l2norm_qk) else None)


def exp_policy(scale: float) -> ScorePolicy:
    return ScorePolicy("exp", real("scale", scale), normalize_rows=False)


def fastmax_policy(p: int, a0: float, a1: float, a2: float, temperature: float,
                   normalize: bool, lim: float) -> ScorePolicy:
    check_fastmax_coefficients(p, a0, a1, a2, temperature, normalize, lim)
    return ScorePolicy("fastmax", 1.0 / temperature, float(lim) if normalize else None,
                       float(a0), float(a1), float(a2) if p == 2 else 0.0)


def check_fastmax_coefficients(p, a0, a1, a2, temperature, normalize, lim):
    """Reject fastmax settings whose weights could go negative (or are all zero) on reachable logits.

    Negative weights make ``l`` cross zero and the output blow up; we refuse them up front rather
    than return garbage. With ``normalize`` the logits are bounded by ``lim**2 / temperature``.
    """
    if isinstance(p, bool) or p not in (1, 2):  # True == 1, but a bool here is a mistake
        raise ValueError(f"p: expected 1 or 2, got {p!r}")
    a0, a1, a2, temperature, lim = (real(name, val) for name, val in (
        ("a0", a0), ("a1", a1), ("a2", a2), ("temperature", temperature), ("lim", lim)))
    flag("normalize", normalize)
    # 1 / temperature is the policy's scale: a subnormal temperature would make it inf.
    if not temperature > 0 or math.isinf(1 / temperature):
        raise ValueError(f"temperature: expected > 0 with a finite 1/temperature, got {temperature}")
    if normalize and lim <= 0:
        raise ValueError(f"lim: expected > 0 with normalize=True, got {lim}")
    c2 = a2 if p == 2 else 0.0
    if a0 == 0 and a1 == 0 and c2 == 0:
        raise ValueError("a0, a1, a2: f(x) is identically zero; every output would be zero")
    bound = lim * lim / temperature if normalize else math.inf
    f = lambda x: a0 + a1 * x + c2 * x * x  # noqa: E731
    if math.isinf(bound):
        ok = (c2 > 0 and a1 * a1 <= 4 * a0 * c2) or (c2 == 0 and a1 == 0 and a0 >= 0)
        where = "for some logit (pass normalize=True to bound the logits, or pick a1**2 <= 4*a0*a2)"
    else:
        points = [-bound, bound]
        if c2 != 0 and -bound < -a1 / (2 * c2) < bound:
            points.append(-a1 / (2 * c2))
        ok = min(f(x) for x in points) >= 0
        where = f"for some logit in [-{bound:g}, {bound:g}] (= lim**2/temperature)"
    if not ok:
        raise ValueError(f"a0, a1, a2: f(x) = {a0} + {a1}*x" + (f" + {c2}*x^2" if p == 2 else "")
                         + f" goes negative {where}; fastmax needs f >= 0")
