// Score functions: how a logit becomes a weight, for every family the kernels run. Everything about a
// family lives here: the host's choice of variant and its constants (plain C++, also compiled into the
// binding), and the device policies that the quadratic kernels' shared skeletons (quadratic/) call.
// Adding a score function (a new polynomial, say) means a Score value, its case in choose_score and
// with_policy, and a policy struct with the members below; the skeletons stay as they are.
#pragma once
#include <cmath>
#include <string_view>

namespace attn {

// The variant a call runs, chosen per call on the host (choose_score).
enum class Score {
  kExpFixed,   // A = exp2(y - shift) with a fixed shift: bounded logits (unit q, k, no bias) or unnormalised
  kExpRowMax,  // A = exp2(y - running row max): logits with no known bound (attn_bias, raw q/k)
  kPoly,       // A = a0 + a1 x + a2 x^2
};

// What the kernels read about the score (Params::score). Logit y = alpha * (q.k) * rq + beta * bias, k the
// unit rows under the qk norm (log2 domain for the exp family: alpha, beta carry log2(e)); exp family:
// A = exp2(y - shift); poly: A = a0 + a1 y + a2 y^2. The backward's dS~ = dL/dx * d(y)/d(q.k) carries
// alpha; grad_scale = d(x)/d(q_n.k_n) / alpha turns it into natural units once, in the dq/dk epilogues.
struct ScoreParams {
  float alpha, beta, shift, a0, a1, a2;
  float grad_scale;
};

struct ScoreChoice {
  Score score;
  ScoreParams params;
};

// The variant and constants for a call of score.py's ScorePolicy: kind "cosine", "exp" or "fastmax", x =
// scale * (q.k) with q and k scaled to norm qk_norm first (has_qk_norm), coef = the polynomial's (a0, a1, a2).
// False for an unknown kind or coefficient count.
//
// Logit y = alpha (q.k) rq rk + beta bias, in log2 units for the exp family. Weights A = exp2(y - shift)
// need no running max when every y lies within `bound` of zero and the smallest weight stays a normal
// number of the type P is rounded to for P V: unit-norm q and k without bias give |x| <= |scale| n^2.
// fp16 weights are shifted up by 2^15 so that [2^-2bound, 1] lands in fp16's normal range.
inline bool choose_score(std::string_view kind, double scale, bool has_qk_norm, double qk_norm, const double* coef,
                         int n_coef, bool normalize, bool has_bias, bool fp16, ScoreChoice* out) {
  if (n_coef != 3) return false;
  const double n2 = has_qk_norm ? qk_norm * qk_norm : 1.0, c = scale * n2;
  ScoreChoice& ch = *out;
  ch.params.a0 = coef[0], ch.params.a1 = coef[1], ch.params.a2 = coef[2];
  if (kind == "fastmax") {
    ch.score = Score::kPoly, ch.params.alpha = c, ch.params.beta = 1.f, ch.params.shift = 0.f;
    ch.params.grad_scale = 1.f;
    return true;
  }
  if (kind != "cosine" && kind != "exp") return false;
  constexpr double kLog2e = 1.4426950408889634;
  ch.params.alpha = c * kLog2e, ch.params.beta = kLog2e, ch.params.grad_scale = 1.0 / kLog2e;
  if (!normalize) {  // weights are taken literally: cosine exp(x - scale), exp exp(x)
    ch.score = Score::kExpFixed, ch.params.shift = kind == "cosine" ? scale * kLog2e : 0.0;
    return true;
  }
  const double bound = std::abs(c) * kLog2e;
  if (has_qk_norm && !has_bias && 2 * bound <= (fp16 ? 29.0 : 100.0)) {
    ch.score = Score::kExpFixed, ch.params.shift = fp16 ? bound - 15.0 : bound;
  } else {
    ch.score = Score::kExpRowMax, ch.params.shift = 0.f;
  }
  return true;
}

}  // namespace attn

#if defined(__CUDACC__)
#include "../common/mma.cuh"

namespace attn {

// Score policies: all that the forward and backward skeletons (quadratic/fwd_sm80.cuh, bwd_sm80.cuh and
// their sm_90a twins) know about a family. The skeletons name no family: they call the members below
// and test only the properties (kRowMax, kZeroAtHidden, kBwdOffset). A policy is built from the call's
// ScoreParams. The forward computes weights A(y) of logits y and sums them as rounded for the P V
// product into l; the backward recomputes P = A(y) / l from the saved per-row stat.
//
//   kRowMax         false: the weights are taken as they come (a fixed shift, no rescaling), stat = 1 / l,
//                   and the backward's P = round(A(y)) * stat: exactly the normalised weights the forward
//                   multiplied V with. true: the weights are rebase(y, m) = exp2(y - m) for the running row
//                   max m; the forward rescales O by rebase(m_old, m_new) as m grows, stat = m + log2(l),
//                   and the backward's P = bwd_weight(y, stat) needs no l.
//   kZeroAtHidden   weight(-inf) = 0 and dlogit is 0 there, so hidden pairs (logit -inf) need no mask.
// The forward:
//   Row, row(c), fused(s, row)  (!kRowMax) on tiles with no hidden pair and no bias: the weight of the
//                   raw product s = q.k for the logit y = c s, with per-row constants row(c) computed once
//                   per tile.
//   weight(y)       the weight of a logit elsewhere (-inf, a hidden pair, only where kZeroAtHidden).
//   rebase(y, m)    (kRowMax) exp2(y - m).
//   row_stat(l, inv, m)  the per-row statistic the backward reads (inv = 1 / l, or 1 where the rows are
//                   not normalised; m the row max).
// The backward:
//   kBwdOffset, bwd_offset(params)  the backward works on y - offset (bwd_offset's constant, read from
//                   the kernel's parameters where it is used, so that it stays a constant-bank operand):
//                   on tiles with no edge and no bias it rides in the logit scaling's FMA, elsewhere it
//                   comes off once the skeleton has marked hidden pairs -inf and added the bias.
//   bwd_weight(y, stat)  A(y) before the skeleton's rounding and 1 / l (!kRowMax), or P itself (kRowMax);
//                   y less the offset where kBwdOffset.
//   dlogit(P, y, dp_minus_delta, stat)  dL/dx from P, the logit and dP - delta (delta = rowsum(dO * O), 0
//                   without normalisation). It must be linear in dp_minus_delta: the skeleton passes it
//                   times the query's logit scale, to get that scale's product with dL/dx (dS~) in one
//                   FMA (dp_scale and dp_offset, quadratic/params.h).

// A = exp2(y - shift), y in log2 units (alpha and beta carry log2(e)); dL/dx = P (dP - delta).
template <bool kRowMax_>
struct ExpScore {
  static constexpr bool kRowMax = kRowMax_, kZeroAtHidden = true, kBwdOffset = !kRowMax_;
  float shift;
  __device__ explicit ExpScore(const ScoreParams& p) : shift(p.shift) {}

  struct Row {
    float c;
  };
  __device__ Row row(float c) const { return {c}; }
  __device__ float fused(float s, Row r) const { return ex2(fmaf(s, r.c, -shift)); }
  __device__ float weight(float y) const { return ex2(y - shift); }
  __device__ static float rebase(float y, float m) { return ex2(y - m); }
  __device__ static float row_stat(float l, float inv, float m) {
    if constexpr (kRowMax) return l > 0.f ? m + log2f(l) : INFINITY;
    return inv;
  }

  // With a fixed shift the backward works on y - shift.
  __device__ static float bwd_offset(const ScoreParams& p) { return p.shift; }
  __device__ float bwd_weight(float y, float stat) const {
    if constexpr (kRowMax) return ex2(y - stat);
    return ex2(y);  // y - shift already
  }
  __device__ float dlogit(float P, float, float dp_minus_delta, float) const { return P * dp_minus_delta; }
};

// Fastmax: A = a0 + a1 y + a2 y^2 (y in natural units), dL/dx = (dP - delta) / l * f'(y). Unlike exp2 it
// has no zero at -inf.
struct PolyScore {
  static constexpr bool kRowMax = false, kZeroAtHidden = false, kBwdOffset = false;
  float a0, a1, a2;
  __device__ explicit PolyScore(const ScoreParams& p) : a0(p.a0), a1(p.a1), a2(p.a2) {}

  // One scale c per row: a0 + a1 (c s) + a2 (c s)^2 = a0 + s (a1 c + a2 c^2 s), two FMAs per score with
  // the row's coefficients.
  struct Row {
    float b1, b2;
  };
  __device__ Row row(float c) const { return {a1 * c, a2 * c * c}; }
  __device__ float fused(float s, Row r) const { return fmaf(s, fmaf(r.b2, s, r.b1), a0); }
  __device__ float weight(float y) const { return fmaf(y, fmaf(a2, y, a1), a0); }
  __device__ static float row_stat(float, float inv, float) { return inv; }

  __device__ static float bwd_offset(const ScoreParams&) { return 0.f; }  // none (kBwdOffset false)
  __device__ float bwd_weight(float y, float) const { return weight(y); }
  __device__ float dlogit(float, float y, float dp_minus_delta, float stat) const {
    return dp_minus_delta * stat * fmaf(2.f * a2, y, a1);
  }
};

// ---------------------------------------------------------------------------------------------------
// Host side. f(PolicyTag<P>{}) for the score policy P that `score` names: the forward and the backward
// pick their kernel instantiation the same way.
template <class P>
struct PolicyTag {
  using type = P;
};
template <class F>
cudaError_t with_policy(Score score, F&& f) {
  switch (score) {
    case Score::kExpFixed: return f(PolicyTag<ExpScore<false>>{});
    case Score::kExpRowMax: return f(PolicyTag<ExpScore<true>>{});
    case Score::kPoly: return f(PolicyTag<PolyScore>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace attn
#endif  // __CUDACC__
