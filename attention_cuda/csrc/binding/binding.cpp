// Torch ops over the kernels: attn_cuda::fwd, attn_cuda::bwd, cosine's attn_cuda::decode, the linear form's, RoPE's
// rope_split and rope_merge, and
// what the Python side asks of the build (attn_cuda::head_dims, ...).
// They run on the current stream, never synchronise the host, and check their inputs with TORCH_CHECK
// (the Python layer validates first and raises ValueError/NotImplementedError with argument names).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "../decode/params.h"
#include "../rope/rope.h"
#include "registry.h"

namespace attn {
namespace {
std::map<std::pair<int, int>, Kernels>& registry() {
  static std::map<std::pair<int, int>, Kernels> r;
  return r;
}
}  // namespace

bool register_kernels(Dtype dtype, int head_dim, const Kernels& kernels) {
  registry()[{static_cast<int>(dtype), head_dim}] = kernels;
  return true;
}

bool find_kernels(Dtype dtype, int head_dim, FwdFn* fwd, BwdFn* bwd, LinFn* lin) {
  auto it = registry().find({static_cast<int>(dtype), head_dim});
  if (it == registry().end()) return false;
  *fwd = it->second.fwd, *bwd = it->second.bwd;
  if (lin) *lin = it->second.lin;
  return true;
}

bool find_chunked(Dtype dtype, int head_dim, LinStateFn* state, LinReadFn* read) {
  auto it = registry().find({static_cast<int>(dtype), head_dim});
  if (it == registry().end() || !it->second.state || !use_sm90()) return false;
  *state = it->second.state, *read = it->second.read;
  return true;
}

bool use_sm90() {
  const char* portable = std::getenv("ATTN_PORTABLE_KERNELS");  // read per call: tests flip it in-process
  if (portable && *portable && std::string(portable) != "0") return false;
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev))
    return false;
  return major == 9 && minor == 0;
}

std::vector<int64_t> compiled_head_dims(Dtype dtype) {
  std::vector<int64_t> dims;
  for (const auto& kv : registry())
    if (kv.first.first == static_cast<int>(dtype)) dims.push_back(kv.first.second);
  return dims;
}

}  // namespace attn

namespace {

using at::Tensor;
using c10::optional;

bool kernel_dtype(at::ScalarType t, attn::Dtype* out) {
  switch (t) {
    case at::kHalf: *out = attn::Dtype::kF16; return true;
    case at::kBFloat16: *out = attn::Dtype::kBF16; return true;
    case at::kFloat: *out = attn::Dtype::kF32; return true;
    default: return false;
  }
}

void check_ok(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "attn_cuda: ", what, " failed: ", cudaGetErrorString(err));
}

// The kernels read rows with 16-byte cp.async: the head dim must be contiguous and every row start
// 16-byte aligned. Anything else is copied once (never needlessly).
Tensor rows_aligned(const Tensor& t) {
  const int64_t es = t.element_size();
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim() && ok; ++d) ok = t.size(d) == 1 || (t.stride(d) * es) % 16 == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

struct Call {
  Tensor q, k, v, mask, bias;
  int B, H, Hkv, I, J, D;
  attn::Dtype dtype;
  attn::FwdFn fwd;
  attn::BwdFn bwd;
};

Call check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                  const optional<Tensor>& bias) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "attn_cuda: q, k, v must be CUDA tensors");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), "attn_cuda: q, k, v must share a device");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attn_cuda: expected q (B,H,I,D), k and v (B,Hkv,J,D)");
  TORCH_CHECK(k.sizes() == v.sizes(), "attn_cuda: k and v must have the same shape");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), "attn_cuda: k does not match q's batch or head dim");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "attn_cuda: kv heads must divide query heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "attn_cuda: q, k, v must share a dtype");
  Call c;
  TORCH_CHECK(kernel_dtype(q.scalar_type(), &c.dtype), "attn_cuda: dtype ", q.scalar_type(),
              " not supported (float16, bfloat16, float32)");
  c.B = q.size(0), c.H = q.size(1), c.I = q.size(2), c.D = q.size(3), c.Hkv = k.size(1), c.J = k.size(2);
  TORCH_CHECK(attn::find_kernels(c.dtype, c.D, &c.fwd, &c.bwd), "attn_cuda: head dim ", c.D,
              " is not compiled for ", q.scalar_type());
  c.q = rows_aligned(q), c.k = rows_aligned(k), c.v = rows_aligned(v);
  if (mask) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == c.B && mask->size(1) == c.J,
                "attn_cuda: mask must be bool (B, J)");
    TORCH_CHECK(mask->device() == q.device(), "attn_cuda: mask must be on q's device");
    c.mask = mask->stride(1) == 1 ? *mask : mask->contiguous();
  }
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == q.scalar_type(), "attn_cuda: bias must have q's dtype");
    TORCH_CHECK(bias->dim() == 4 && bias->size(0) == c.B && bias->size(1) == c.H && bias->size(2) == c.I &&
                    bias->size(3) == c.J,
                "attn_cuda: bias must be (B, H, I, J) (an expanded view is fine)");
    TORCH_CHECK(bias->device() == q.device(), "attn_cuda: bias must be on q's device");
    c.bias = *bias;
  }
  return c;
}

// The score function's variant and constants for a call (score/score.cuh).
attn::ScoreChoice make_score(c10::string_view kind, double scale, optional<double> qk_norm, at::ArrayRef<double> coef,
                             bool normalize, bool has_bias, at::ScalarType dtype) {
  attn::ScoreChoice choice;
  TORCH_CHECK(attn::choose_score(std::string_view(kind.data(), kind.size()), scale, qk_norm.has_value(),
                                 qk_norm.value_or(0.0), coef.data(), static_cast<int>(coef.size()), normalize,
                                 has_bias, dtype == at::kHalf, &choice),
              "attn_cuda: unknown score kind '", std::string(kind), "'");
  return choice;
}

// Element strides of batch, head and row of a (B, H, n, D) tensor whose head dim is contiguous.
attn::RowStrides row_strides(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

attn::Params make_params(const Call& c, const attn::ScoreChoice& score, bool causal, bool normalize) {
  attn::Params p{};
  p.B = c.B, p.H = c.H, p.Hkv = c.Hkv, p.I = c.I, p.J = c.J, p.group = c.H / c.Hkv;
  p.q = c.q.data_ptr(), p.k = c.k.data_ptr(), p.v = c.v.data_ptr();
  p.qs = row_strides(c.q), p.ks = row_strides(c.k), p.vs = row_strides(c.v);
  if (c.mask.defined()) p.mask = reinterpret_cast<const uint8_t*>(c.mask.data_ptr<bool>()), p.mask_sb = c.mask.stride(0);
  if (c.bias.defined()) {
    p.bias = c.bias.data_ptr();
    p.bias_sb = c.bias.stride(0), p.bias_sh = c.bias.stride(1), p.bias_si = c.bias.stride(2), p.bias_sj = c.bias.stride(3);
  }
  p.i_pad = attn::pad4(c.I), p.j_pad = attn::pad4(c.J);
  p.causal = causal, p.normalize = normalize;
  p.score = score.params;
  return p;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> attn_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                    const optional<Tensor>& mask, const optional<Tensor>& bias,
                                                    bool causal, c10::string_view kind, double scale,
                                                    optional<double> qk_norm, at::ArrayRef<double> coef,
                                                    bool normalize) {
  const Call c = check_inputs(q, k, v, mask, bias);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const attn::ScoreChoice score = make_score(kind, scale, qk_norm, coef, normalize, bias.has_value(),
                                             q.scalar_type());
  attn::Params p = make_params(c, score, causal, normalize);
  const auto f32 = q.options().dtype(at::kFloat);
  // (B, H, I, D) over (B, I, H, D) memory: the rows of a position's heads side by side, as the model's
  // output projection reads them, so that its reshape is a view (FlashAttention returns the same layout).
  Tensor out = at::empty({c.B, c.I, c.H, c.D}, q.options()).transpose(1, 2);
  Tensor stat = at::empty({c.B, c.H, p.i_pad}, f32);
  // Stay empty without qk norm.
  Tensor rq = at::empty({0}, f32), rk = at::empty({0}, f32), kn = at::empty({0}, q.options());
  if (qk_norm) {
    // 1/|q| comes from the forward's own Q tiles. The keys are normalised once, by a row pass, into
    // unit rows kn in the inputs' dtype (as SDPA users and the reference normalise them), which the
    // kernels then read as K: a logit's scale is its query's alone, one FMA per weight rather than an
    // FMUL and an FMA, and no query block reads 1/|k| with its tiles. rk stays for dK's epilogue. The
    // backward takes kn as its k.
    rq = at::empty({c.B, c.H, p.i_pad}, f32), rk = at::empty({c.B, c.Hkv, p.j_pad}, f32);
    kn = at::empty({c.B, c.Hkv, c.J, c.D}, q.options());
    check_ok(attn::run_row_rnorm(c.dtype, p.k, p.ks, c.B, c.Hkv, c.J, c.D, p.j_pad, rk.data_ptr<float>(),
                                 kn.data_ptr(), stream), "k norms");
    p.rq = rq.data_ptr<float>(), p.rk = rk.data_ptr<float>();
    p.k = kn.data_ptr(), p.ks = row_strides(kn);
  }
  p.o = out.data_ptr(), p.os = row_strides(out);
  p.stat = stat.data_ptr<float>();
  // A forward block streams its kv head's K and V, which the group's adjacent query heads share.
  p.section = causal ? attn::section_heads(c.B * c.H, 2 * int64_t{c.J} * c.D * q.element_size() / p.group) : 1;
  check_ok(c.fwd(p, score.score, stream), "forward kernel");
  return {out, stat, rq, rk, kn};
}

// Cosine's decode step (decode/decode.cu): out (B, H, 1, D) = softmax(scale q.k) v over the keys mask keeps, each
// query's one row, q and k scaled to norm qk_norm first (None: they are unit rows already, the caller says, as
// attention_cuda's l2norm_qk=False does). The weights are exp(x - |scale| n^2) in fp32 with no running max,
// so |scale| n^2 must leave the smallest, e^(-2 |scale| n^2), a normal fp32 number. splits: parts of each
// (batch, kv head)'s keys, one block each; 0: as many as fill one wave of the GPU (decode_splits).
Tensor attn_decode(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask, double scale,
                   optional<double> qk_norm, int64_t splits) {
  const Call c = check_inputs(q, k, v, mask, c10::nullopt);
  TORCH_CHECK(c.I == 1, "attn_cuda: decode: q must hold one query row (B, H, 1, D), got ", c.I, " rows");
  TORCH_CHECK(attn::decode_takes(c.D), "attn_cuda: decode: head dim ", c.D, " must be a multiple of 8 up to ",
              attn::kDecodeMaxDim);
  TORCH_CHECK(splits >= 0, "attn_cuda: decode: splits must be >= 0 (0: the kernel's choice), got ", splits);
  constexpr double kLog2e = 1.4426950408889634;
  const double alpha = scale * (qk_norm ? *qk_norm * *qk_norm : 1.0) * kLog2e;
  TORCH_CHECK(2 * std::abs(alpha) <= 126.0, "attn_cuda: decode: scale ", scale, " puts the smallest weight of unit ",
              "rows, 2^(-2 |alpha|) with |alpha| = ", std::abs(alpha), ", below fp32's normal range");
  const c10::cuda::CUDAGuard guard(q.device());
  attn::DecodeParams p{};
  p.B = c.B, p.H = c.H, p.Hkv = c.Hkv, p.J = c.J, p.D = c.D, p.group = c.H / c.Hkv;
  p.q = c.q.data_ptr(), p.k = c.k.data_ptr(), p.v = c.v.data_ptr();
  p.qs = row_strides(c.q), p.ks = row_strides(c.k), p.vs = row_strides(c.v);
  if (c.mask.defined()) p.mask = reinterpret_cast<const uint8_t*>(c.mask.data_ptr<bool>()), p.mask_sb = c.mask.stride(0);
  p.alpha = static_cast<float>(alpha), p.shift = static_cast<float>(std::abs(alpha)), p.qk_norm = qk_norm.has_value();
  int parts = static_cast<int>(std::min<int64_t>(splits, c.J));
  if (parts == 0) check_ok(attn::decode_splits(c.dtype, p, &parts), "decode_splits");
  p.splits = parts, p.split_keys = (c.J + parts - 1) / parts;
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor num = at::empty({c.B, c.H, parts, c.D}, f32), den = at::empty({c.B, c.H, parts}, f32);
  Tensor out = at::empty({c.B, c.H, 1, c.D}, q.options());
  p.num = num.data_ptr<float>(), p.den = den.data_ptr<float>(), p.out = out.data_ptr();
  check_ok(attn::run_decode(c.dtype, p, c10::cuda::getCurrentCUDAStream()), "decode kernel");
  return out;
}

// k: the keys the forward ran on, its kn under the qk norm (attn_fwd).
std::tuple<Tensor, Tensor, Tensor, Tensor> attn_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                    const Tensor& v, const optional<Tensor>& mask,
                                                    const optional<Tensor>& bias, const Tensor& out,
                                                    const Tensor& stat, const Tensor& rq, const Tensor& rk,
                                                    bool causal, c10::string_view kind, double scale,
                                                    optional<double> qk_norm, at::ArrayRef<double> coef,
                                                    bool normalize, bool bias_grad) {
  const Call c = check_inputs(q, k, v, mask, bias);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "attn_cuda: dout and out must have q's shape");
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "attn_cuda: dout and out must have q's dtype");
  TORCH_CHECK(stat.scalar_type() == at::kFloat && stat.numel() == int64_t{c.B} * c.H * attn::pad4(c.I),
              "attn_cuda: stat does not come from attn_cuda::fwd on these inputs");
  TORCH_CHECK(!qk_norm || (rq.numel() == int64_t{c.B} * c.H * attn::pad4(c.I) &&
                           rk.numel() == int64_t{c.B} * c.Hkv * attn::pad4(c.J)),
              "attn_cuda: rq/rk do not come from attn_cuda::fwd on these inputs");
  TORCH_CHECK(!bias_grad || bias, "attn_cuda: bias_grad needs a bias");
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const attn::ScoreChoice score = make_score(kind, scale, qk_norm, coef, normalize, bias.has_value(),
                                             q.scalar_type());
  attn::Params p = make_params(c, score, causal, normalize);
  // Rows 16-byte aligned like q, k, v, in any order (the model's dO is the forward's layout): an upstream
  // gradient can be a view at any offset.
  const Tensor dout_c = rows_aligned(dout), out_c = rows_aligned(out);
  const Tensor stat_c = rows_aligned(stat.contiguous());
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor rows = at::empty({3, c.B, c.H, p.i_pad}, f32);  // qscale, dp_scale, dp_offset (run_delta)
  Tensor dq_accum = at::zeros({attn::dq_accum_size(c.B, c.H, c.I, c.D)}, f32);
  Tensor dq = at::empty({c.B, c.H, c.I, c.D}, q.options());
  Tensor dk = at::empty({c.B, c.Hkv, c.J, c.D}, q.options());
  Tensor dv = at::empty({c.B, c.Hkv, c.J, c.D}, q.options());
  Tensor dbias = bias_grad ? at::zeros({c.B, c.H, c.I, c.J}, q.options()) : at::empty({0}, q.options());
  if (qk_norm) p.rq = rq.data_ptr<float>(), p.rk = rk.data_ptr<float>();
  p.o = out_c.data_ptr(), p.os = row_strides(out_c);
  p.dout = dout_c.data_ptr(), p.dos = row_strides(dout_c);
  p.stat = stat_c.data_ptr<float>(), p.dq_accum = dq_accum.data_ptr<float>();
  p.qscale = rows[0].data_ptr<float>(), p.dp_scale = rows[1].data_ptr<float>(), p.dp_offset = rows[2].data_ptr<float>();
  p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
  p.dbias = bias_grad ? dbias.data_ptr() : nullptr;
  // A backward block streams its group's Q, dO and fp32 dQ rows.
  const int64_t head_bytes = int64_t{p.group} * c.I * c.D * (2 * q.element_size() + sizeof(float));
  p.section = causal ? attn::section_heads(c.B * c.Hkv, head_bytes) : 1;
  check_ok(attn::run_delta(c.dtype, p, c.D, stream), "delta");
  check_ok(c.bwd(p, score.score, stream), "backward kernel");
  return {dq, dk, dv, dbias};
}

// One sweep of fastmax's linear form (linear/linear.cuh) over chunk-major (B, chunks, heads, kLinChunk, D + 16)
// tensors. Returns (r1, r2), fp32: r1 (B, chunks, Hr, kLinChunk, D + 16) when r1_tiles > 0, r2
// (B, chunks, Hr, kLinChunk, D) when want_r2; each is empty otherwise.
std::tuple<Tensor, Tensor> attn_linear(const Tensor& ux, const Tensor& uw, const Tensor& rx,
                                       const optional<Tensor>& rg, int64_t upd_heads, int64_t rd_heads, bool causal,
                                       bool reverse, bool second, at::ArrayRef<double> cu, at::ArrayRef<double> cr,
                                       int64_t r1_tiles, bool want_r2) {
  TORCH_CHECK(ux.dim() == 5 && ux.sizes() == uw.sizes() && rx.dim() == 5, "attn_cuda: linear: expected "
              "chunk-major (B, chunks, heads, ", attn::kLinChunk, ", D + 16) tensors, ux and uw alike");
  TORCH_CHECK(ux.size(3) == attn::kLinChunk && rx.size(3) == attn::kLinChunk && ux.size(4) == rx.size(4) &&
                  ux.size(0) == rx.size(0) && ux.size(1) == rx.size(1),
              "attn_cuda: linear: ux and rx must share batch, chunks and row width, with ", attn::kLinChunk,
              " rows per chunk");
  TORCH_CHECK(upd_heads > 0 && rd_heads > 0 && ux.size(2) % upd_heads == 0 && rx.size(2) % rd_heads == 0 &&
                  ux.size(2) / upd_heads == rx.size(2) / rd_heads,
              "attn_cuda: linear: heads do not split into the same kv heads");
  TORCH_CHECK(cu.size() == 3 && cr.size() == 3, "attn_cuda: linear: cu and cr are (c0, c1, c2)");
  TORCH_CHECK(!want_r2 || (rg && rg->sizes() == rx.sizes()), "attn_cuda: linear: R2 needs rg shaped like rx");
  for (const Tensor* t : {&ux, &uw, &rx, rg ? &*rg : &rx})
    TORCH_CHECK(t->is_contiguous() && t->is_cuda() && t->device() == ux.device() &&
                    t->scalar_type() == ux.scalar_type(),
                "attn_cuda: linear: inputs must be contiguous CUDA tensors of one dtype and device");
  attn::Dtype dtype;
  attn::FwdFn fwd;
  attn::BwdFn bwd;
  attn::LinFn lin = nullptr;
  const int D = static_cast<int>(ux.size(4)) - 16;
  TORCH_CHECK(kernel_dtype(ux.scalar_type(), &dtype) && attn::find_kernels(dtype, D, &fwd, &bwd, &lin) && lin,
              "attn_cuda: linear: no linear-form kernel for ", ux.scalar_type(), " and head dim ", D);
  const c10::cuda::CUDAGuard guard(ux.device());
  attn::LinParams p{};
  p.B = ux.size(0), p.chunks = ux.size(1), p.Hkv = ux.size(2) / upd_heads;
  p.ux = ux.data_ptr(), p.uw = uw.data_ptr(), p.rx = rx.data_ptr(), p.rg = rg ? rg->data_ptr() : nullptr;
  p.upd_heads = upd_heads, p.rd_heads = rd_heads, p.r1_tiles = r1_tiles;
  p.causal = causal, p.reverse = reverse, p.second = second;
  for (int i = 0; i < 3; ++i) p.cu[i] = cu[i], p.cr[i] = cr[i];
  const auto f32 = ux.options().dtype(at::kFloat);
  Tensor r1 = r1_tiles > 0 ? at::zeros(rx.sizes(), f32) : at::empty({0}, f32);
  Tensor r2 = want_r2 ? at::zeros({rx.size(0), rx.size(1), rx.size(2), rx.size(3), D}, f32) : at::empty({0}, f32);
  p.r1 = r1_tiles > 0 ? r1.data_ptr<float>() : nullptr;
  p.r2 = want_r2 ? r2.data_ptr<float>() : nullptr;
  if (p.B * p.chunks > 0) check_ok(lin(p, c10::cuda::getCurrentCUDAStream()), "linear-form kernel");
  return {r1, r2};
}

// The chunked Hopper linear form (linear/lin_sm90.cuh) over chunk-major (B, chunks, heads, L, D + 16) tensors.
void chunked_kernels(const Tensor& x, attn::LinStateFn* state, attn::LinReadFn* read, const char* op) {
  attn::Dtype dtype;
  TORCH_CHECK(x.dim() == 5, "attn_cuda: ", op, ": expected chunk-major (B, chunks, heads, L, D + 16) rows, got ",
              x.sizes());
  const int D = static_cast<int>(x.size(4)) - 16;
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && kernel_dtype(x.scalar_type(), &dtype) &&
                  attn::find_chunked(dtype, D, state, read),
              "attn_cuda: ", op, ": no chunked linear-form kernel for ", x.scalar_type(), ", ", x.sizes(),
              " on this device (see chunked_head_dims)");
  TORCH_CHECK(x.size(3) % 128 == 0, "attn_cuda: ", op, ": rows per chunk must be a multiple of 128 (lin_state's "
              "stages at d64, lin_read's blocks), got ", x.size(3));
}

// Image bytes per (batch, kv head, chunk): tiles of 64 features x (D + 8 rounded up to 32) columns. An op
// too, so that lin_state's fake (attention_cuda/_extension.py) sizes its output by this one formula.
int64_t chunked_image_bytes(int64_t D, bool second) {
  const int64_t nb = D / 16, groups = nb + 1 + (second ? 16 * nb * (nb + 1) / 2 : 0);
  return (groups + 3) / 4 * ((D + 8 + 31) / 32) * 64 * 64;
}

// S per chunk of the rows x (features) and w (weights), heads rows' heads summed per kv head; image
// (B, Hkv, causal ? chunks : 1, bytes) uint8. scale: one fp32, the power of two S is stored at.
Tensor attn_lin_state(const Tensor& x, const Tensor& w, int64_t heads, bool causal, bool reverse, bool second,
                      at::ArrayRef<double> coef, const Tensor& scale) {
  attn::LinStateFn state;
  attn::LinReadFn read;
  chunked_kernels(x, &state, &read, "lin_state");
  TORCH_CHECK(w.sizes() == x.sizes() && w.scalar_type() == x.scalar_type() && w.is_contiguous() &&
                  w.device() == x.device() && heads > 0 && x.size(2) % heads == 0 && coef.size() == 3,
              "attn_cuda: lin_state: w must be like x, heads divide x's heads, coef is (c0, c1, c2)");
  TORCH_CHECK(scale.is_cuda() && scale.scalar_type() == at::kFloat && scale.numel() == 1,
              "attn_cuda: lin_state: scale is one fp32 on the device");
  const c10::cuda::CUDAGuard guard(x.device());
  attn::LinStateParams p{};
  p.B = x.size(0), p.chunks = x.size(1), p.Hkv = x.size(2) / heads, p.L = x.size(3), p.heads = heads;
  p.x = x.data_ptr(), p.w = w.data_ptr();
  p.causal = causal, p.reverse = reverse, p.second = second;
  for (int i = 0; i < 3; ++i) p.coef[i] = coef[i];
  p.scale = scale.data_ptr<float>();
  Tensor image = at::empty({p.B, p.Hkv, causal ? p.chunks : 1, chunked_image_bytes(x.size(4) - 16, second)},
                           x.options().dtype(at::kByte));
  p.image = image.data_ptr();
  if (p.B * p.Hkv > 0) check_ok(state(p, c10::cuda::getCurrentCUDAStream()), "lin_state kernel");
  return image;
}

// Reads of the image by the rows x: r1 = psi(x) S (fp32, D + 16 wide, zero from column r1_cols on) and, with
// g, r2 = d psi(x) . S g (fp32, D wide); both divided by scale. heads: readers per kv head.
std::tuple<Tensor, Tensor> attn_lin_read(const Tensor& x, const optional<Tensor>& g, const Tensor& image,
                                         int64_t heads, bool second, int64_t r1_cols, const Tensor& scale) {
  attn::LinStateFn state;
  attn::LinReadFn read;
  chunked_kernels(x, &state, &read, "lin_read");
  const int64_t D = x.size(4) - 16, Hkv = heads > 0 ? x.size(2) / heads : 0;
  TORCH_CHECK(heads > 0 && x.size(2) % heads == 0 && image.dim() == 4 && image.is_contiguous() &&
                  image.size(0) == x.size(0) && image.size(1) == Hkv &&
                  (image.size(2) == x.size(1) || image.size(2) == 1) &&
                  image.size(3) == chunked_image_bytes(D, second),
              "attn_cuda: lin_read: image does not match x (", image.sizes(), ")");
  TORCH_CHECK(!g || (g->sizes() == x.sizes() && g->scalar_type() == x.scalar_type() && g->is_contiguous()),
              "attn_cuda: lin_read: g must be like x");
  TORCH_CHECK(r1_cols >= 0 && r1_cols <= D + 8 && (r1_cols > 0 || g), "attn_cuda: lin_read: r1_cols in [0, D + 8], "
              "and something to read");
  const c10::cuda::CUDAGuard guard(x.device());
  attn::LinReadParams p{};
  p.B = x.size(0), p.chunks = x.size(1), p.Hkv = Hkv, p.L = x.size(3), p.heads = heads;
  p.x = x.data_ptr(), p.g = g ? g->data_ptr() : nullptr, p.image = image.data_ptr();
  p.per_chunk = image.size(2) > 1 || x.size(1) == 1, p.second = second, p.r1_cols = r1_cols;
  p.scale = scale.data_ptr<float>();
  const auto f32 = x.options().dtype(at::kFloat);
  Tensor r1 = r1_cols > 0 ? at::empty(x.sizes(), f32) : at::empty({0}, f32);
  Tensor r2 = g ? at::empty({x.size(0), x.size(1), x.size(2), x.size(3), D}, f32) : at::empty({0}, f32);
  p.r1 = r1_cols > 0 ? r1.data_ptr<float>() : nullptr;
  p.r2 = g ? r2.data_ptr<float>() : nullptr;
  if (p.B * p.chunks * p.Hkv > 0) check_ok(read(p, c10::cuda::getCurrentCUDAStream()), "lin_read kernel");
  return {r1, r2};
}

// The linear form's row passes (linear/lin_rows.cu): natural (B, H, n, D) rows <-> chunk-major (B, chunks, H, L, W)
// ones, chunk row t = natural row t - shift; L (rows per chunk) is 128 for the sweep (kLinChunk) and
// larger for the Hopper chunked form.
attn::Dtype lin_dtype(at::ScalarType t) {
  attn::Dtype d;
  TORCH_CHECK((t == at::kHalf || t == at::kBFloat16) && kernel_dtype(t, &d),
              "attn_cuda: the linear form takes float16 and bfloat16, got ", t);
  return d;
}

void check_chunk_major(const Tensor& t, int64_t b, int64_t h, int64_t w, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.dim() == 5 && t.size(0) == b && t.size(2) == h &&
                  t.size(3) % 64 == 0 && t.size(3) > 0 && t.size(4) == w,
              "attn_cuda: ", name, ": expected a contiguous chunk-major (", b, ", chunks, ", h, ", L, ", w,
              ") CUDA tensor with L a multiple of 64, got ", t.sizes());
}

// The linear form's row passes read natural rows a pair of elements at a time: a contiguous head dim,
// 4-byte aligned, even strides. Anything else is copied once.
Tensor pairs_aligned(const Tensor& x) {
  bool pairs = x.stride(-1) == 1 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) pairs = pairs && x.stride(d) % 2 == 0;
  return pairs ? x : x.contiguous();
}

Tensor attn_lin_rows(const Tensor& x, const optional<Tensor>& mask, const optional<Tensor>& mu, int64_t shift,
                     int64_t n_pad, int64_t width, int64_t chunk) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4, "attn_cuda: lin_rows: x must be a (B, H, N, D) CUDA tensor");
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), D = x.size(3);
  TORCH_CHECK(chunk > 0 && chunk % 64 == 0 && n_pad % chunk == 0,
              "attn_cuda: lin_rows: chunk must be a positive multiple of 64 that divides n_pad, got chunk=", chunk,
              ", n_pad=", n_pad);
  TORCH_CHECK(N > 0 && (width == D || width == D + 16) && D % 2 == 0, "attn_cuda: lin_rows: bad shape or width");
  const Tensor xs = pairs_aligned(x);
  if (mask) TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->sizes() == at::IntArrayRef({B, N}),
                        "attn_cuda: lin_rows: mask must be contiguous bool (B, N)");
  if (mu) TORCH_CHECK(mu->scalar_type() == at::kFloat && mu->is_contiguous() && mu->sizes() == at::IntArrayRef({B, H, D}),
                      "attn_cuda: lin_rows: mu must be contiguous fp32 (B, H, D)");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor dst = at::empty({B, n_pad / chunk, H, chunk, width}, x.options());
  check_ok(attn::run_lin_rows(lin_dtype(x.scalar_type()), xs.data_ptr(), row_strides(xs),
                              mask ? mask->data_ptr<bool>() : nullptr, mu ? mu->data_ptr<float>() : nullptr, B, H, N,
                              D, width, n_pad, chunk, shift, dst.data_ptr(), c10::cuda::getCurrentCUDAStream()),
           "lin_rows");
  return dst;
}

std::tuple<Tensor, Tensor> attn_lin_out(const Tensor& y, const optional<Tensor>& o, const optional<Tensor>& stat,
                                        const Tensor& mu, int64_t shift, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK(y.dim() == 5 && y.scalar_type() == at::kFloat, "attn_cuda: lin_out: y must be fp32 chunk-major");
  const int64_t B = y.size(0), chunks = y.size(1), H = y.size(2), L = y.size(3), D = y.size(4) - 16;
  const int64_t n_pad = chunks * L;
  check_chunk_major(y, B, H, D + 16, "lin_out y");
  TORCH_CHECK(o.has_value() == stat.has_value(), "attn_cuda: lin_out: o and stat come together");
  if (o) {
    TORCH_CHECK(o->dim() == 4 && o->transpose(1, 2).is_contiguous() && o->scalar_type() == dtype &&
                    o->numel() == B * n_pad * H * D && stat->is_contiguous() && stat->scalar_type() == at::kFloat &&
                    stat->numel() == B * n_pad * H,
                "attn_cuda: lin_out: o (B * chunks, H, ", L, ", D) over (B * chunks, ", L, ", H, D) memory, as ",
                "attn_cuda::fwd writes it, and stat (B * chunks, H, ", L, ") contiguous");
  }
  TORCH_CHECK(mu.scalar_type() == at::kFloat && mu.is_contiguous() && mu.sizes() == at::IntArrayRef({B, H, D}) &&
                  mu.device() == y.device(),
              "attn_cuda: lin_out: mu must be contiguous fp32 (B, H, D) on y's device");
  const c10::cuda::CUDAGuard guard(y.device());
  Tensor out = at::empty({B, n, H, D}, y.options().dtype(dtype)).transpose(1, 2);  // the tiled forward's layout
  Tensor inv_l = at::empty({B, chunks, H, L}, y.options());
  check_ok(attn::run_lin_out(lin_dtype(dtype), y.data_ptr<float>(), o ? o->data_ptr() : nullptr,
                             stat ? stat->data_ptr<float>() : nullptr, mu.data_ptr<float>(), B, H, n, D, n_pad, L,
                             shift, out.data_ptr(),
                             inv_l.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()),
           "lin_out");
  return {out, inv_l};
}

std::tuple<Tensor, Tensor> attn_lin_g(const Tensor& dout, const Tensor& out, const Tensor& inv_l, const Tensor& mu,
                                      const Tensor& cmax, int64_t shift) {
  TORCH_CHECK(dout.dim() == 4 && dout.sizes() == out.sizes() && dout.scalar_type() == out.scalar_type(),
              "attn_cuda: lin_g: dout and out must be alike (B, H, n, D)");
  const int64_t B = dout.size(0), H = dout.size(1), n = dout.size(2), D = dout.size(3);
  TORCH_CHECK(inv_l.dim() == 4 && inv_l.is_contiguous() && inv_l.scalar_type() == at::kFloat && inv_l.size(0) == B &&
                  inv_l.size(2) == H && inv_l.size(3) % 64 == 0 && inv_l.size(3) > 0,
              "attn_cuda: lin_g: inv_l must be fp32 (B, chunks, H, L), L a multiple of 64");
  TORCH_CHECK(mu.scalar_type() == at::kFloat && mu.is_contiguous() && mu.sizes() == at::IntArrayRef({B, H, D}) &&
                  cmax.scalar_type() == at::kFloat && cmax.numel() == 1,
              "attn_cuda: lin_g: mu must be fp32 (B, H, D) and cmax one fp32");
  const int64_t chunks = inv_l.size(1), L = inv_l.size(3), n_pad = chunks * L;
  const c10::cuda::CUDAGuard guard(dout.device());
  const Tensor dO = pairs_aligned(dout), O = pairs_aligned(out);
  const auto f32 = inv_l.options();
  Tensor delta = at::empty_like(inv_l), gmax = at::zeros({1}, f32.dtype(at::kInt)), scale = at::empty({1}, f32);
  Tensor g = at::empty({B, chunks, H, L, D + 16}, dout.options());
  check_ok(attn::run_lin_g(lin_dtype(dout.scalar_type()), dO.data_ptr(), row_strides(dO), O.data_ptr(), row_strides(O),
                           inv_l.data_ptr<float>(), mu.data_ptr<float>(), cmax.data_ptr<float>(), B, H, n, D, n_pad, L,
                           shift, delta.data_ptr<float>(), reinterpret_cast<unsigned*>(gmax.data_ptr<int>()),
                           g.data_ptr(), scale.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()),
           "lin_g");
  return {g, scale};
}

Tensor attn_lin_grad(const Tensor& acc, const Tensor& scale, const optional<Tensor>& diag, int64_t shift, int64_t n,
                     int64_t D, at::ScalarType dtype) {
  TORCH_CHECK(acc.dim() == 5 && acc.scalar_type() == at::kFloat && acc.is_contiguous(),
              "attn_cuda: lin_grad: acc must be contiguous fp32 chunk-major");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, "attn_cuda: lin_grad: scale is one fp32");
  const int64_t B = acc.size(0), chunks = acc.size(1), H = acc.size(2), W = acc.size(4);
  const int64_t L = acc.size(3), n_pad = chunks * L;
  check_chunk_major(acc, B, H, W, "lin_grad acc");
  if (diag)
    TORCH_CHECK(diag->is_contiguous() && diag->scalar_type() == dtype && diag->numel() == B * n_pad * H * D,
                "attn_cuda: lin_grad: diag must be contiguous (B * chunks, H, ", L, ", D)");
  TORCH_CHECK(D <= W && n + shift <= n_pad, "attn_cuda: lin_grad: rows or width out of range");
  const c10::cuda::CUDAGuard guard(acc.device());
  Tensor out = at::empty({B, H, n, D}, acc.options().dtype(dtype));
  check_ok(attn::run_lin_grad(lin_dtype(dtype), acc.data_ptr<float>(), W, scale.data_ptr<float>(),
                              diag ? diag->data_ptr() : nullptr, B, H, n, D, n_pad, L, shift, out.data_ptr(),
                              c10::cuda::getCurrentCUDAStream()),
           "lin_grad");
  return out;
}

// Whether attn_cuda::fwd's stat is a row's log2 of its weight sum (m + log2 l, the running-max variant) rather
// than 1 / l (fixed shift), for a call with these options: what merging the outputs of calls over parts of
// the keys needs (attention_cuda/_kernels.py split_keys), decided here by the same choose_score as the call.
bool stat_is_log(c10::string_view kind, double scale, optional<double> qk_norm, at::ArrayRef<double> coef,
                 bool normalize, bool has_bias, at::ScalarType dtype) {
  return make_score(kind, scale, qk_norm, coef, normalize, has_bias, dtype).score == attn::Score::kExpRowMax;
}

// The rows and tables RoPE's ops take: a dtype the kernels run, CUDA, one device, fp32 tables (T, D / 2).
attn::Dtype rope_check(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t T, int64_t D) {
  attn::Dtype dtype;
  TORCH_CHECK(x.is_cuda() && kernel_dtype(x.scalar_type(), &dtype), "attn_cuda: rope: rows must be CUDA tensors of ",
              "float16, bfloat16 or float32");
  TORCH_CHECK(D > 0 && D % 16 == 0, "attn_cuda: rope: head dim must be a positive multiple of 16, got ", D);
  for (const Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device() == x.device() &&
                    t->sizes() == at::IntArrayRef({T, D / 2}),
                "attn_cuda: rope: cos and sin must be contiguous fp32 (", T, ", ", D / 2, ") on the rows' device");
  return dtype;
}

// qkv (B, T, (heads + 2 kv_heads) D) -> q (B, heads, T, D), k (B, kv_heads, T, D), rotated (rope/rope.h).
std::tuple<Tensor, Tensor> attn_rope_split(const Tensor& qkv, const Tensor& cos, const Tensor& sin, int64_t heads,
                                           int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 3 && heads > 0 && kv_heads > 0 && qkv.size(2) % (heads + 2 * kv_heads) == 0,
              "attn_cuda: rope_split: qkv must be (B, T, (heads + 2 kv_heads) D)");
  const int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(2) / (heads + 2 * kv_heads);
  const attn::Dtype dtype = rope_check(qkv, cos, sin, T, D);
  const c10::cuda::CUDAGuard guard(qkv.device());
  const Tensor x = rows_aligned(qkv);
  Tensor q = at::empty({B, heads, T, D}, qkv.options()), k = at::empty({B, kv_heads, T, D}, qkv.options());
  attn::RopeParams p{};
  p.B = B, p.T = T, p.H = heads, p.Hkv = kv_heads, p.D = D;
  p.cos = cos.data_ptr<float>(), p.sin = sin.data_ptr<float>();
  p.qkv = x.data_ptr(), p.qkv_sb = x.stride(0), p.qkv_st = x.stride(1), p.q = q.data_ptr(), p.k = k.data_ptr();
  check_ok(attn::run_rope_split(dtype, p, c10::cuda::getCurrentCUDAStream()), "rope_split");
  return {q, k};
}

// dq (B, heads, T, D), dk and dv (B, kv_heads, T, D) -> dqkv (B, T, (heads + 2 kv_heads) D): rope_split's
// gradient, with v's (a strided view of the projection) in its place.
Tensor attn_rope_merge(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& cos, const Tensor& sin) {
  TORCH_CHECK(dq.dim() == 4 && dk.dim() == 4 && dk.sizes() == dv.sizes() && dk.size(0) == dq.size(0) &&
                  dk.size(2) == dq.size(2) && dk.size(3) == dq.size(3),
              "attn_cuda: rope_merge: expected dq (B, heads, T, D), dk and dv (B, kv_heads, T, D)");
  TORCH_CHECK(dk.scalar_type() == dq.scalar_type() && dv.scalar_type() == dq.scalar_type() &&
                  dk.device() == dq.device() && dv.device() == dq.device(),
              "attn_cuda: rope_merge: dq, dk, dv must share a dtype and device");
  const int64_t B = dq.size(0), H = dq.size(1), Hkv = dk.size(1), T = dq.size(2), D = dq.size(3);
  const attn::Dtype dtype = rope_check(dq, cos, sin, T, D);
  const c10::cuda::CUDAGuard guard(dq.device());
  const Tensor q = rows_aligned(dq), k = rows_aligned(dk), v = rows_aligned(dv);
  Tensor qkv = at::empty({B, T, (H + 2 * Hkv) * D}, dq.options());
  attn::RopeParams p{};
  p.B = B, p.T = T, p.H = H, p.Hkv = Hkv, p.D = D;
  p.cos = cos.data_ptr<float>(), p.sin = sin.data_ptr<float>();
  p.qkv = qkv.data_ptr(), p.qkv_sb = qkv.stride(0), p.qkv_st = qkv.stride(1);
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.qs = row_strides(q), p.ks = row_strides(k), p.vs = row_strides(v);
  check_ok(attn::run_rope_merge(dtype, p, c10::cuda::getCurrentCUDAStream()), "rope_merge");
  return qkv;
}

// What the Python side asks of the build: the head dims compiled for dtype at which `has` (dtype, head dim) holds.
// The plan sends a call down a path only at the head dims the path's op reports.
template <class F>
std::vector<int64_t> head_dims_with(at::ScalarType dtype, F&& has) {
  attn::Dtype d;
  std::vector<int64_t> dims;
  if (kernel_dtype(dtype, &d))
    for (int64_t D : attn::compiled_head_dims(d))
      if (has(d, static_cast<int>(D))) dims.push_back(D);
  return dims;
}

std::vector<int64_t> head_dims(at::ScalarType dtype) {
  return head_dims_with(dtype, [](attn::Dtype, int) { return true; });
}

// The linear form's sweep (quadratic/tiles.h says at which head dims it is built).
std::vector<int64_t> sweep_head_dims(at::ScalarType dtype) {
  return head_dims_with(dtype, [](attn::Dtype d, int D) {
    attn::FwdFn fwd;
    attn::BwdFn bwd;
    attn::LinFn lin = nullptr;
    return attn::find_kernels(d, D, &fwd, &bwd, &lin) && lin;
  });
}

// The chunked linear-form kernels, on this device.
std::vector<int64_t> chunked_head_dims(at::ScalarType dtype) {
  return head_dims_with(dtype, [](attn::Dtype d, int D) {
    attn::LinStateFn state;
    attn::LinReadFn read;
    return attn::find_chunked(d, D, &state, &read);
  });
}

// Cosine's decode kernel.
std::vector<int64_t> decode_head_dims(at::ScalarType dtype) {
  return head_dims_with(dtype, [](attn::Dtype, int D) { return attn::decode_takes(D); });
}

}  // namespace

TORCH_LIBRARY(attn_cuda, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, bool causal, str kind, float scale, "
      "float? qk_norm, float[] coef, bool normalize) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor out, Tensor stat, "
      "Tensor rq, Tensor rk, bool causal, str kind, float scale, float? qk_norm, float[] coef, "
      "bool normalize, bool bias_grad) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "linear(Tensor ux, Tensor uw, Tensor rx, Tensor? rg, int upd_heads, int rd_heads, bool causal, bool reverse, "
      "bool second, float[] cu, float[] cr, int r1_tiles, bool want_r2) -> (Tensor, Tensor)");
  m.def("lin_rows(Tensor x, Tensor? mask, Tensor? mu, int shift, int n_pad, int width, int chunk) -> Tensor");
  m.def("lin_out(Tensor y, Tensor? o, Tensor? stat, Tensor mu, int shift, int n, ScalarType dtype) -> "
        "(Tensor, Tensor)");
  m.def("lin_g(Tensor dout, Tensor out, Tensor inv_l, Tensor mu, Tensor cmax, int shift) -> (Tensor, Tensor)");
  m.def("lin_grad(Tensor acc, Tensor scale, Tensor? diag, int shift, int n, int dim, ScalarType dtype) -> Tensor");
  m.def("head_dims(ScalarType dtype) -> int[]", &head_dims);
  m.def("lin_state(Tensor x, Tensor w, int heads, bool causal, bool reverse, bool second, float[] coef, "
        "Tensor scale) -> Tensor");
  m.def("lin_read(Tensor x, Tensor? g, Tensor image, int heads, bool second, int r1_cols, Tensor scale) "
        "-> (Tensor, Tensor)");
  m.def("sweep_head_dims(ScalarType dtype) -> int[]", &sweep_head_dims);
  m.def("chunked_head_dims(ScalarType dtype) -> int[]", &chunked_head_dims);
  m.def("decode_head_dims(ScalarType dtype) -> int[]", &decode_head_dims);
  m.def("chunked_image_bytes(int D, bool second) -> int", &chunked_image_bytes);
  m.def("decode(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float? qk_norm, int splits) -> Tensor");
  m.def("rope_split(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor)");
  m.def("rope_merge(Tensor dq, Tensor dk, Tensor dv, Tensor cos, Tensor sin) -> Tensor");
  m.def("stat_is_log(str kind, float scale, float? qk_norm, float[] coef, bool normalize, bool has_bias, "
        "ScalarType dtype) -> bool", &stat_is_log);
}

TORCH_LIBRARY_IMPL(attn_cuda, CUDA, m) {
  m.impl("fwd", &attn_fwd);
  m.impl("bwd", &attn_bwd);
  m.impl("decode", &attn_decode);
  m.impl("linear", &attn_linear);
  m.impl("lin_rows", &attn_lin_rows);
  m.impl("lin_out", &attn_lin_out);
  m.impl("lin_g", &attn_lin_g);
  m.impl("lin_grad", &attn_lin_grad);
  m.impl("lin_state", &attn_lin_state);
  m.impl("lin_read", &attn_lin_read);
  m.impl("rope_split", &attn_rope_split);
  m.impl("rope_merge", &attn_rope_merge);
}
