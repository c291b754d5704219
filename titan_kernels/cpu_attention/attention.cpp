// Causal attention for small head dims on the CPU (forward and backward).
//
// ATen's CPU flash attention spends most of its time outside its GEMMs when head_dim is tiny
// (16 for the Llama 3 debug model): per 256x512 score block it runs several passes of scaling,
// masking, max, exp and bf16 conversion. This kernel keeps a tile of query rows x 16 keys in
// registers (8 rows on the bf16 path, 4 on the fp32 path); the softmax is exact (two passes over
// one row strip that stays in L1/L2), and the backward recomputes P from the saved log-sum-exp
// like FlashAttention-2. GQA is native: a key/value head is packed once and serves its query
// group. Two paths: bf16 inputs on AVX512-BF16 use `vdpbf16ps` for every product; everything
// else (fp32, half, bf16 without AVX512-BF16) uses fp32 FMAs through ATen's Vectorized<float>.
//
// Layout: q [B, Hq, S, D], k/v [B, Hkv, S, D] with any strides and dtype float/bfloat16/half.
// Outputs are allocated as [B, S, H, D] memory (what the surrounding transpose/reshape wants)
// and returned as [B, H, S, D] views. docs/attention.md has the measurements.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();  // keys per vector
constexpr int64_t R = 4;            // query rows per register tile (fp32 path)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Row s of head (b, h) of a [B, H, S, D] tensor with arbitrary strides.
template <typename T>
struct Rows {
  const T* base;
  int64_t sb, sh, ss, sd;
  explicit Rows(const at::Tensor& t)
      : base(t.data_ptr<T>()), sb(t.stride(0)), sh(t.stride(1)), ss(t.stride(2)), sd(t.stride(3)) {}
  const T* row(int64_t b, int64_t h, int64_t s) const { return base + b * sb + h * sh + s * ss; }
};

// dst[s][d] = mul * src[s][d] for s < S; rows S..S_pad are zero.
template <typename T>
void pack_rows(const Rows<T>& src, int64_t b, int64_t h, int64_t S, int64_t S_pad, int64_t D, float mul,
               float* dst) {
  for (int64_t s = 0; s < S; ++s) {
    const T* r = src.row(b, h, s);
    for (int64_t d = 0; d < D; ++d) dst[s * D + d] = mul * static_cast<float>(r[d * src.sd]);
  }
  std::fill(dst + S * D, dst + S_pad * D, 0.f);
}

// Transposed in tiles of W rows: dst[s / W][d][s % W] = src[s][d]; rows S..S_pad are zero.
// A tile's D vectors are contiguous (a plain [D][S] transpose puts them S*4 bytes apart, which
// thrashes L1 sets at S = 2048).
template <typename T>
void pack_cols(const Rows<T>& src, int64_t b, int64_t h, int64_t S, int64_t S_pad, int64_t D, float* dst) {
  for (int64_t s = 0; s < S_pad; ++s) {
    const T* r = s < S ? src.row(b, h, s) : nullptr;
    for (int64_t d = 0; d < D; ++d) dst[((s / W) * D + d) * W + s % W] = r ? static_cast<float>(r[d * src.sd]) : 0.f;
  }
}

template <typename T>
void store_row(const float* src, float mul, int64_t D, T* dst, int64_t sd) {
  for (int64_t d = 0; d < D; ++d) dst[d * sd] = static_cast<T>(mul * src[d]);
}

// Lanes j0 + l > row are masked (set to `fill`).
inline Vec causal_mask(const Vec& x, int64_t j0, int64_t row, float fill) {
  if (j0 + W - 1 <= row) return x;
  alignas(64) float tmp[W];
  x.store(tmp);
  for (int64_t l = 0; l < W; ++l)
    if (j0 + l > row) tmp[l] = fill;
  return Vec::loadu(tmp);
}

// Forward for one (b, h): Q [S_pad][D] pre-scaled, KT transposed tiles (pack_cols), V [S_pad][D].
// O [S_pad][D] normalized output, LSE [S_pad]. strip: R x S_pad scratch.
template <int64_t ND>
void forward_head(const float* Q, const float* KT, const float* V, int64_t S_pad, float* O, float* LSE,
                  float* strip) {
  constexpr int64_t D = ND * W;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r0 = 0; r0 < S_pad; r0 += R) {
    const int64_t n = r0 + R;  // keys 0..n-1 reach this tile's last row
    const int64_t n_t = round_up(n, W);
    // scores = Q KT, causal-masked
    for (int64_t j = 0; j < n_t; j += W) {
      Vec acc[R];
      for (int64_t i = 0; i < R; ++i) acc[i] = Vec(0.f);
      for (int64_t d = 0; d < D; ++d) {
        const Vec kv = Vec::loadu(KT + ((j / W) * D + d) * W);
        for (int64_t i = 0; i < R; ++i) acc[i] = at::vec::fmadd(Vec(Q[(r0 + i) * D + d]), kv, acc[i]);
      }
      for (int64_t i = 0; i < R; ++i) causal_mask(acc[i], j, r0 + i, neg_inf).store(strip + i * S_pad + j);
    }
    // softmax numerators in place
    float inv_sum[R];
    for (int64_t i = 0; i < R; ++i) {
      float* s = strip + i * S_pad;
      const int64_t len = r0 + i + 1;
      const float m = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s, len);
      const Vec vm(m);
      Vec vsum(0.f);
      for (int64_t j = 0; j < n_t; j += W) {
        const Vec e = (Vec::loadu(s + j) - vm).exp_u20();  // exp(-inf) = 0 for masked lanes
        e.store(s + j);
        vsum = vsum + e;
      }
      const float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
      inv_sum[i] = 1.f / sum;
      LSE[r0 + i] = m + std::log(sum);
    }
    // O = P V
    Vec o[R][ND];
    for (int64_t i = 0; i < R; ++i)
      for (int64_t c = 0; c < ND; ++c) o[i][c] = Vec(0.f);
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = V + j * D;
      for (int64_t c = 0; c < ND; ++c) {
        const Vec vv = Vec::loadu(vr + c * W);
        for (int64_t i = 0; i < R; ++i) o[i][c] = at::vec::fmadd(Vec(strip[i * S_pad + j]), vv, o[i][c]);
      }
    }
    for (int64_t i = 0; i < R; ++i)
      for (int64_t c = 0; c < ND; ++c) (o[i][c] * Vec(inv_sum[i])).store(O + (r0 + i) * D + c * W);
  }
}

// Backward for one query head, accumulating into dK, dV of its key/value head.
// Qs [S_pad][D] pre-scaled, KT/VT transposed tiles (pack_cols), K [S_pad][D], DO [S_pad][D],
// LSE, DELTA [S_pad]. Writes dQ [S_pad][D] (unscaled: caller multiplies by scale).
template <int64_t ND>
void backward_head(const float* Qs, const float* KT, const float* K, const float* VT, const float* DO,
                   const float* LSE, const float* DELTA, int64_t S_pad, float* dQ, float* dK, float* dV) {
  constexpr int64_t D = ND * W;
  alignas(64) float P[R][W];
  alignas(64) float DS[R][W];
  for (int64_t r0 = 0; r0 < S_pad; r0 += R) {
    const int64_t n = r0 + R;
    Vec dq[R][ND], qrow[R][ND], dorow[R][ND];
    for (int64_t i = 0; i < R; ++i)
      for (int64_t c = 0; c < ND; ++c) {
        dq[i][c] = Vec(0.f);
        qrow[i][c] = Vec::loadu(Qs + (r0 + i) * D + c * W);
        dorow[i][c] = Vec::loadu(DO + (r0 + i) * D + c * W);
      }
    for (int64_t j = 0; j < n; j += W) {
      Vec s[R], dp[R];
      for (int64_t i = 0; i < R; ++i) s[i] = dp[i] = Vec(0.f);
      for (int64_t d = 0; d < D; ++d) {
        const Vec kv = Vec::loadu(KT + ((j / W) * D + d) * W);
        const Vec vv = Vec::loadu(VT + ((j / W) * D + d) * W);
        for (int64_t i = 0; i < R; ++i) {
          s[i] = at::vec::fmadd(Vec(Qs[(r0 + i) * D + d]), kv, s[i]);
          dp[i] = at::vec::fmadd(Vec(DO[(r0 + i) * D + d]), vv, dp[i]);
        }
      }
      for (int64_t i = 0; i < R; ++i) {
        const int64_t row = r0 + i;
        const Vec p = causal_mask((s[i] - Vec(LSE[row])).exp_u20(), j, row, 0.f);
        p.store(P[i]);
        (p * (dp[i] - Vec(DELTA[row]))).store(DS[i]);
      }
      const int64_t lmax = std::min(W, n - j);
      for (int64_t l = 0; l < lmax; ++l) {
        const int64_t jj = j + l;
        for (int64_t c = 0; c < ND; ++c) {
          const Vec kv = Vec::loadu(K + jj * D + c * W);
          Vec dk = Vec::loadu(dK + jj * D + c * W);
          Vec dv = Vec::loadu(dV + jj * D + c * W);
          for (int64_t i = 0; i < R; ++i) {
            const Vec ds(DS[i][l]);
            dq[i][c] = at::vec::fmadd(ds, kv, dq[i][c]);
            dk = at::vec::fmadd(ds, qrow[i][c], dk);
            dv = at::vec::fmadd(Vec(P[i][l]), dorow[i][c], dv);
          }
          dk.store(dK + jj * D + c * W);
          dv.store(dV + jj * D + c * W);
        }
      }
    }
    for (int64_t i = 0; i < R; ++i)
      for (int64_t c = 0; c < ND; ++c) dq[i][c].store(dQ + (r0 + i) * D + c * W);
  }
}


void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "titan_cpu attention: q, k, v must be 4-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "titan_cpu attention: CPU only");
  TORCH_CHECK(k.sizes() == v.sizes(), "titan_cpu attention: k and v shapes differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3),
              "titan_cpu attention: q and k disagree on batch, seq or head_dim");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "titan_cpu attention: q heads not a multiple of kv heads");
  TORCH_CHECK(q.size(3) % W == 0 && q.size(3) <= 8 * W, "titan_cpu attention: head_dim must be a multiple of ",
              W, " and at most ", 8 * W);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "titan_cpu attention: q, k, v dtypes differ");
}

// [B, H, S, D] view over [B, S, H, D] memory.
at::Tensor new_bhsd(const at::Tensor& like, int64_t B, int64_t H, int64_t S, int64_t D, at::ScalarType dtype) {
  return at::empty({B, S, H, D}, like.options().dtype(dtype)).transpose(1, 2);
}


// ---------------------------------------------------------------------------------------------
// bf16 inputs on CPUs with AVX512-BF16: the two products per score run as `vdpbf16ps` (two bf16
// multiplies per fp32 lane), 4x the fp32 FMA rate. Softmax stays fp32; P and dS are rounded to
// bf16 only as GEMM operands, as ATen's flash kernel and GPU kernels do.
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#define TITAN_HAS_BF16 1
using u16 = uint16_t;

constexpr int64_t kRowsFwd = 8;  // query rows per register tile (8 measured best at head_dim 16)
constexpr int64_t kRowsBwd = 8;

inline __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
// Two adjacent bf16 values as one 32-bit lane, broadcast.
inline __m512i bcast_pair(const u16* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(static_cast<int>(x));
}
inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
// Lane l = (bf16(a[l]), bf16(b[l])): pairs along a second axis (two rows of a tile).
inline __m512i interleave_bf16(__m512 a, __m512 b) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(to_bf16(a)), _mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(b)), 16));
}
inline __m512 mask_upper(__m512 x, int64_t j0, int64_t row, float fill) {
  if (j0 + 15 <= row) return x;
  const int64_t keep = row - j0 + 1;  // lanes 0..keep-1 stay
  const __mmask16 m = keep <= 0 ? 0 : static_cast<__mmask16>((1u << keep) - 1u);
  return _mm512_mask_blend_ps(m, _mm512_set1_ps(fill), x);
}

// bf16 packs of one head (raw bf16 bits; rows/cols past S are zero).
// rows  [S_pad][D]          row-major copy
// dpair [S_pad/16][D/2][16][2]  pairs along d for each s, 16 keys a tile (operand vectorized over s)
// spair [S_pad/2][D][2]     pairs along s for each d   (operand vectorized over d)
void pack_bf16(const Rows<at::BFloat16>& src, int64_t b, int64_t h, int64_t S, int64_t S_pad, int64_t D, u16* rows,
               u16* dpair, u16* spair) {
  for (int64_t s = 0; s < S_pad; ++s)
    for (int64_t d = 0; d < D; ++d) {
      const u16 x = s < S ? src.row(b, h, s)[d * src.sd].x : u16(0);
      if (rows) rows[s * D + d] = x;
      if (dpair) dpair[(((s / 16) * (D / 2) + d / 2) * 16 + s % 16) * 2 + (d & 1)] = x;
      if (spair) spair[((s / 2) * D + d) * 2 + (s & 1)] = x;
    }
}

// dst[d * sd] = bf16(mul * src[d]), vectorized where dst is contiguous.
void store_bf16(const float* src, float mul, int64_t D, at::BFloat16* dst, int64_t sd) {
  if (sd != 1) return store_row(src, mul, D, dst, sd);
  const __m512 m = _mm512_set1_ps(mul);
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), to_bf16(_mm512_mul_ps(_mm512_loadu_ps(src + d), m)));
}

// Write one head's fp32 rows [S][D] times `mul` into row block (b, h) of a bf16 [B, H, S, D] tensor.
void store_head(const float* src, float mul, int64_t S, int64_t D, at::Tensor& dst, int64_t b, int64_t h) {
  at::BFloat16* base = dst.data_ptr<at::BFloat16>() + b * dst.stride(0) + h * dst.stride(1);
  for (int64_t s = 0; s < S; ++s) store_bf16(src + s * D, mul, D, base + s * dst.stride(2), dst.stride(3));
}

// DELTA[s] = rowsum(dO * O) and L[s] = the saved log-sum-exp of head (b, h); rows S..S_pad are 0.
void head_delta_lse(const Rows<at::BFloat16>& dor, const Rows<at::BFloat16>& outr, const float* lrow, int64_t b,
                    int64_t h, int64_t S, int64_t S_pad, int64_t D, float* DELTA, float* L) {
  for (int64_t s = 0; s < S_pad; ++s) {
    float acc = 0.f;
    if (s < S) {
      const at::BFloat16* orow = outr.row(b, h, s);
      const at::BFloat16* drow = dor.row(b, h, s);
      for (int64_t d = 0; d < D; ++d) acc += static_cast<float>(drow[d * dor.sd]) * static_cast<float>(orow[d * outr.sd]);
    }
    DELTA[s] = acc;
    L[s] = s < S ? lrow[s] : 0.f;
  }
}

template <int64_t ND, int64_t R>
void forward_head_bf16(const u16* QB, const u16* KP, const u16* VP, int64_t S_pad, float scale, float* O,
                       float* LSE, float* strip, u16* pb) {
  constexpr int64_t D = ND * 16;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < S_pad; r0 += R) {
    const int64_t n = r0 + R;
    const int64_t n_t = round_up(n, 16);
    for (int64_t j = 0; j < n_t; j += 16) {
      __m512 acc[R];
      for (int64_t i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t p = 0; p < D / 2; ++p) {
        const __m512i kv = _mm512_loadu_si512(KP + ((j / 16) * (D / 2) + p) * 32);
        for (int64_t i = 0; i < R; ++i) acc[i] = dpbf16(acc[i], bcast_pair(QB + (r0 + i) * D + 2 * p), kv);
      }
      for (int64_t i = 0; i < R; ++i)
        _mm512_storeu_ps(strip + i * S_pad + j, mask_upper(_mm512_mul_ps(acc[i], vscale), j, r0 + i, neg_inf));
    }
    float inv_sum[R];
    for (int64_t i = 0; i < R; ++i) {
      float* s = strip + i * S_pad;
      u16* pr = pb + i * S_pad;
      __m512 vmax = _mm512_set1_ps(neg_inf);
      for (int64_t j = 0; j < n_t; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
      const float m = _mm512_reduce_max_ps(vmax);
      const Vec vm(m);
      Vec vsum(0.f);
      for (int64_t j = 0; j < n_t; j += 16) {
        const Vec e = (Vec::loadu(s + j) - vm).exp_u20();
        vsum = vsum + e;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), to_bf16(e));
      }
      const float sum = _mm512_reduce_add_ps(vsum);
      inv_sum[i] = 1.f / sum;
      LSE[r0 + i] = m + std::log(sum);
    }
    __m512 o[R][ND];
    for (int64_t i = 0; i < R; ++i)
      for (int64_t c = 0; c < ND; ++c) o[i][c] = _mm512_setzero_ps();
    for (int64_t jp = 0; jp < n / 2; ++jp) {
      __m512i pp[R];
      for (int64_t i = 0; i < R; ++i) pp[i] = bcast_pair(pb + i * S_pad + 2 * jp);
      for (int64_t c = 0; c < ND; ++c) {
        const __m512i vv = _mm512_loadu_si512(VP + (jp * D + c * 16) * 2);
        for (int64_t i = 0; i < R; ++i) o[i][c] = dpbf16(o[i][c], pp[i], vv);
      }
    }
    for (int64_t i = 0; i < R; ++i)
      for (int64_t c = 0; c < ND; ++c)
        _mm512_storeu_ps(O + (r0 + i) * D + c * 16, _mm512_mul_ps(o[i][c], _mm512_set1_ps(inv_sum[i])));
  }
}

// Backward for one query head (bf16 operands, fp32 accumulation). dQ is unscaled.
// QB/DOB [S_pad][D]; QR/DOR [S_pad/2][D][2]; KP/VP dpair tiles; KJ [S_pad/2][D][2].
template <int64_t ND, int64_t R>
void backward_head_bf16(const u16* QB, const u16* QR, const u16* DOB, const u16* DOR, const u16* KP, const u16* VP,
                        const u16* KJ, const float* LSE, const float* DELTA, int64_t S_pad, float scale, float* dQ,
                        float* dK, float* dV) {
  constexpr int64_t D = ND * 16;
  constexpr int64_t RP = R / 2;  // row pairs per tile
  const __m512 vscale = _mm512_set1_ps(scale);
  alignas(64) u16 DSb[R][16];       // dS rows as bf16: pairs along keys, for dQ
  alignas(64) uint32_t PT[RP][16];  // (P[i][l], P[i+1][l]) pairs along rows, for dV
  alignas(64) uint32_t DT[RP][16];  // (dS[i][l], dS[i+1][l]) pairs along rows, for dK
  for (int64_t r0 = 0; r0 < S_pad; r0 += R) {
    const int64_t n = r0 + R;
    __m512 dq[R][ND];
    __m512i qr[RP][ND], dor[RP][ND];
    for (int64_t i = 0; i < R; ++i)
      for (int64_t c = 0; c < ND; ++c) dq[i][c] = _mm512_setzero_ps();
    for (int64_t ip = 0; ip < RP; ++ip)
      for (int64_t c = 0; c < ND; ++c) {
        qr[ip][c] = _mm512_loadu_si512(QR + ((r0 / 2 + ip) * D + c * 16) * 2);
        dor[ip][c] = _mm512_loadu_si512(DOR + ((r0 / 2 + ip) * D + c * 16) * 2);
      }
    for (int64_t j = 0; j < n; j += 16) {
      __m512 s[R], dp[R];
      for (int64_t i = 0; i < R; ++i) s[i] = dp[i] = _mm512_setzero_ps();
      for (int64_t p = 0; p < D / 2; ++p) {
        const __m512i kv = _mm512_loadu_si512(KP + ((j / 16) * (D / 2) + p) * 32);
        const __m512i vv = _mm512_loadu_si512(VP + ((j / 16) * (D / 2) + p) * 32);
        for (int64_t i = 0; i < R; ++i) {
          s[i] = dpbf16(s[i], bcast_pair(QB + (r0 + i) * D + 2 * p), kv);
          dp[i] = dpbf16(dp[i], bcast_pair(DOB + (r0 + i) * D + 2 * p), vv);
        }
      }
      __m512 P[R], DS[R];
      for (int64_t i = 0; i < R; ++i) {
        const int64_t row = r0 + i;
        const Vec x = Vec(_mm512_fmsub_ps(s[i], vscale, _mm512_set1_ps(LSE[row])));
        P[i] = mask_upper(__m512(x.exp_u20()), j, row, 0.f);
        DS[i] = _mm512_mul_ps(P[i], _mm512_sub_ps(dp[i], _mm512_set1_ps(DELTA[row])));
        _mm256_store_si256(reinterpret_cast<__m256i*>(DSb[i]), to_bf16(DS[i]));
      }
      for (int64_t ip = 0; ip < RP; ++ip) {
        _mm512_store_si512(PT[ip], interleave_bf16(P[2 * ip], P[2 * ip + 1]));
        _mm512_store_si512(DT[ip], interleave_bf16(DS[2 * ip], DS[2 * ip + 1]));
      }
      // dQ[i] += sum_l dS[i][l] K[j+l]  (pairs of keys)
      const int64_t lmax = std::min<int64_t>(16, n - j);  // even
      for (int64_t lp = 0; lp < lmax / 2; ++lp)
        for (int64_t c = 0; c < ND; ++c) {
          const __m512i kv = _mm512_loadu_si512(KJ + (((j / 2) + lp) * D + c * 16) * 2);
          for (int64_t i = 0; i < R; ++i) dq[i][c] = dpbf16(dq[i][c], bcast_pair(DSb[i] + 2 * lp), kv);
        }
      // dK[j+l] += sum_i dS[i][l] Q[i];  dV[j+l] += sum_i P[i][l] dO[i]  (pairs of rows)
      for (int64_t l = 0; l < lmax; ++l)
        for (int64_t c = 0; c < ND; ++c) {
          float* dkp = dK + (j + l) * D + c * 16;
          float* dvp = dV + (j + l) * D + c * 16;
          __m512 dk = _mm512_loadu_ps(dkp), dv = _mm512_loadu_ps(dvp);
          for (int64_t ip = 0; ip < RP; ++ip) {
            dk = dpbf16(dk, _mm512_set1_epi32(static_cast<int>(DT[ip][l])), qr[ip][c]);
            dv = dpbf16(dv, _mm512_set1_epi32(static_cast<int>(PT[ip][l])), dor[ip][c]);
          }
          _mm512_storeu_ps(dkp, dk);
          _mm512_storeu_ps(dvp, dv);
        }
    }
    for (int64_t i = 0; i < R; ++i)
      for (int64_t c = 0; c < ND; ++c) _mm512_storeu_ps(dQ + (r0 + i) * D + c * 16, dq[i][c]);
  }
}

template <int64_t ND>
void run_forward_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out,
                      at::Tensor& lse) {
  constexpr int64_t D = ND * 16;
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), Hkv = k.size(1);
  const int64_t group = Hq / Hkv, S_pad = round_up(S, 16);
  Rows<at::BFloat16> qr(q), kr(k), vr(v);
  float* lse_base = lse.data_ptr<float>();
  at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<u16> QB(S_pad * D), KP(D * S_pad), VP(S_pad * D), pb(kRowsFwd * S_pad);
    std::vector<float> O(S_pad * D), L(S_pad), strip(kRowsFwd * S_pad);
    int64_t packed_kv = -1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / Hq, h = u % Hq, hk = h / group;
      if (b * Hkv + hk != packed_kv) {
        pack_bf16(kr, b, hk, S, S_pad, D, nullptr, KP.data(), nullptr);
        pack_bf16(vr, b, hk, S, S_pad, D, nullptr, nullptr, VP.data());
        packed_kv = b * Hkv + hk;
      }
      pack_bf16(qr, b, h, S, S_pad, D, QB.data(), nullptr, nullptr);
      forward_head_bf16<ND, kRowsFwd>(QB.data(), KP.data(), VP.data(), S_pad, static_cast<float>(scale), O.data(), L.data(),
                            strip.data(), pb.data());
      store_head(O.data(), 1.f, S, D, out, b, h);
      std::copy(L.data(), L.data() + S, lse_base + (b * Hq + h) * S);
    }
  });
}

template <int64_t ND>
void run_backward_bf16(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& out, const at::Tensor& lse, double scale, at::Tensor& dq, at::Tensor& dk,
                       at::Tensor& dv) {
  constexpr int64_t D = ND * 16;
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), Hkv = k.size(1);
  const int64_t group = Hq / Hkv, S_pad = round_up(S, 16);
  Rows<at::BFloat16> qr(q), kr(k), vr(v), dor(dout), outr(out);
  const at::Tensor lse_c = lse.contiguous();
  const float* lse_base = lse_c.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<u16> QB(S_pad * D), QR(S_pad * D), DOB(S_pad * D), DOR(S_pad * D);
    std::vector<u16> KP(D * S_pad), VP(D * S_pad), KJ(S_pad * D);
    std::vector<float> L(S_pad), DELTA(S_pad), dQ(S_pad * D), dK(S_pad * D), dV(S_pad * D);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / Hkv, hk = u % Hkv;
      pack_bf16(kr, b, hk, S, S_pad, D, nullptr, KP.data(), KJ.data());
      pack_bf16(vr, b, hk, S, S_pad, D, nullptr, VP.data(), nullptr);
      std::fill(dK.begin(), dK.end(), 0.f);
      std::fill(dV.begin(), dV.end(), 0.f);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        pack_bf16(qr, b, h, S, S_pad, D, QB.data(), nullptr, QR.data());
        pack_bf16(dor, b, h, S, S_pad, D, DOB.data(), nullptr, DOR.data());
        head_delta_lse(dor, outr, lse_base + (b * Hq + h) * S, b, h, S, S_pad, D, DELTA.data(), L.data());
        backward_head_bf16<ND, kRowsBwd>(QB.data(), QR.data(), DOB.data(), DOR.data(), KP.data(), VP.data(), KJ.data(),
                               L.data(), DELTA.data(), S_pad, static_cast<float>(scale), dQ.data(), dK.data(),
                               dV.data());
        store_head(dQ.data(), static_cast<float>(scale), S, D, dq, b, h);
      }
      store_head(dK.data(), static_cast<float>(scale), S, D, dk, b, hk);
      store_head(dV.data(), 1.f, S, D, dv, b, hk);
    }
  });
}

// ---- AMX path: the block GEMMs through ATen's brgemm (oneDNN ukernels) --------------------
// On CPUs where oneDNN runs bf16 brgemm on AMX tiles (`cpublas::could_pack(kBFloat16)`), the
// products above are far cheaper as tile GEMMs than as `vdpbf16ps` loops: a 32-row block of
// queries multiplies the whole causal key range in one call, and what is left per score is the
// vectorized softmax. Operands in VNNI form ([K/2][N][2] bf16 pairs, what brgemm reads with
// is_vnni) are packed once per head. The backward works on transposed score blocks (keys x
// queries): P^T and dS^T are then row-major A operands for dV += P^T dO and dK += dS^T Q,
// dQ^T = K^T dS^T takes dS^T in VNNI form, and the per-query LSE / delta are vector loads.
// TITAN_CPU_ATTN_AMX=0 turns the path off (the kernel then runs the vdpbf16ps path above).
namespace amx {

using at::native::cpublas::brgemm;
constexpr int64_t QB = 32;  // query rows per block

inline bool enabled() {
  static const bool hw = at::native::cpublas::could_pack(at::kBFloat16);
  if (!hw) return false;
  const char* e = std::getenv("TITAN_CPU_ATTN_AMX");
  return !(e && e[0] == '0' && e[1] == '\0');
}

inline const at::BFloat16* bf(const u16* p) { return reinterpret_cast<const at::BFloat16*>(p); }

// Pack one head of src ([S][D] rows; rows S..S_pad are zero) into one of the layouts below.
// plain [S_pad][D]; trans [D][S_pad]; vrow [S_pad/2][D][2] (VNNI over s); vcol [D/2][S_pad][2] (VNNI over d).
// Rows are read through a contiguous copy of the D values (`row_of`), so the loops move whole
// 16- or 32-bit words (a tensor's head_dim stride is 1 in the models' layout).
struct HeadRows {
  const Rows<at::BFloat16>& src;
  int64_t b, h, S, D;
  std::vector<u16> tmp;
  HeadRows(const Rows<at::BFloat16>& src, int64_t b, int64_t h, int64_t S, int64_t D)
      : src(src), b(b), h(h), S(S), D(D), tmp(D) {}
  const u16* row_of(int64_t s) {  // nullptr past S
    if (s >= S) return nullptr;
    const at::BFloat16* r = src.row(b, h, s);
    if (src.sd == 1) return reinterpret_cast<const u16*>(r);
    for (int64_t d = 0; d < D; ++d) tmp[d] = r[d * src.sd].x;
    return tmp.data();
  }
};

void pack_plain(HeadRows rows, int64_t S_pad, u16* dst) {
  const int64_t D = rows.D;
  for (int64_t s = 0; s < S_pad; ++s) {
    const u16* r = rows.row_of(s);
    if (r) std::memcpy(dst + s * D, r, D * sizeof(u16));
    else std::fill(dst + s * D, dst + (s + 1) * D, u16(0));
  }
}

void pack_trans(HeadRows rows, int64_t S_pad, u16* dst) {
  const int64_t D = rows.D;
  for (int64_t s = 0; s < S_pad; ++s) {
    const u16* r = rows.row_of(s);
    for (int64_t d = 0; d < D; ++d) dst[d * S_pad + s] = r ? r[d] : u16(0);
  }
}

void pack_vrow(HeadRows rows, int64_t S_pad, u16* dst) {
  const int64_t D = rows.D;
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  std::vector<u16> even(D);
  for (int64_t s = 0; s < S_pad; s += 2) {
    const u16* r0 = rows.row_of(s);
    if (r0) std::memcpy(even.data(), r0, D * sizeof(u16));  // row_of may reuse its buffer
    const u16* r1 = rows.row_of(s + 1);
    for (int64_t d = 0; d < D; ++d)
      out[(s / 2) * D + d] = uint32_t(r0 ? even[d] : 0) | (uint32_t(r1 ? r1[d] : 0) << 16);
  }
}

void pack_vcol(HeadRows rows, int64_t S_pad, u16* dst) {
  const int64_t P = rows.D / 2;
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t s = 0; s < S_pad; ++s) {
    const u16* r = rows.row_of(s);
    uint32_t pair[64];
    if (r) std::memcpy(pair, r, P * sizeof(uint32_t));
    for (int64_t p = 0; p < P; ++p) out[p * S_pad + s] = r ? pair[p] : 0u;
  }
}

// One head: Q plain [S_pad][D], KC = K in vcol form (B of Q K^T), VR = V in vrow form (B of P V).
// strip [QB][S_pad] fp32, pb [QB][S_pad] bf16, o [QB][D] fp32 scratch.
template <int64_t D>
void forward_head(const u16* Q, const u16* KC, const u16* VR, int64_t S_pad, float scale, float* O, float* LSE,
                  float* strip, u16* pb, float* o) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < S_pad; i0 += QB) {
    const int64_t n = i0 + QB;  // keys 0..n-1 reach this block's last row
    brgemm(QB, n, D, D, S_pad, S_pad, false, bf(Q + i0 * D), bf(KC), strip, true);
    float inv_sum[QB];
    for (int64_t r = 0; r < QB; ++r) {
      const int64_t row = i0 + r;
      float* s = strip + r * S_pad;
      u16* p = pb + r * S_pad;
      const int64_t last = row / 16 * 16;  // the 16-key chunk holding the diagonal
      __m512 vmax = _mm512_set1_ps(neg_inf);
      for (int64_t j = 0; j < last; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
      const __m512 xl = mask_upper(_mm512_mul_ps(_mm512_loadu_ps(s + last), vscale), last, row, neg_inf);
      const float m = std::max(_mm512_reduce_max_ps(vmax) * scale, _mm512_reduce_max_ps(xl));
      const __m512 vm = _mm512_set1_ps(m);
      Vec vsum(0.f);
      for (int64_t j = 0; j < last; j += 16) {
        const Vec e = Vec(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, vm)).exp_u20();
        vsum = vsum + e;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), to_bf16(e));
      }
      const Vec el = Vec(_mm512_sub_ps(xl, vm)).exp_u20();  // exp(-inf) = 0 past the diagonal
      vsum = vsum + el;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + last), to_bf16(el));
      for (int64_t j = last + 16; j < n; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), _mm256_setzero_si256());
      const float sum = _mm512_reduce_add_ps(vsum);
      inv_sum[r] = 1.f / sum;
      LSE[row] = m + std::log(sum);
    }
    brgemm(QB, D, n, S_pad, D, D, false, bf(pb), bf(VR), o, true);
    for (int64_t r = 0; r < QB; ++r)
      for (int64_t c = 0; c < D; c += 16)
        _mm512_storeu_ps(O + (i0 + r) * D + c, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c), _mm512_set1_ps(inv_sum[r])));
  }
}

// One query head's contribution to dK, dV (fp32 [S_pad][D], accumulated; dK unscaled) and its dQ
// (fp32 [S_pad][D], unscaled). K, V plain and KT trans (per kv head); QC, DOC vcol and QR, DOR
// vrow (per query head). Scratch: st, dpt [S_pad][QB] fp32; ptb, dstb [S_pad][QB] bf16;
// dsv [S_pad/2][QB][2] bf16; dqt [D][QB] fp32.
template <int64_t D>
void backward_head(const u16* K, const u16* V, const u16* KT, const u16* QC, const u16* DOC, const u16* QR,
                   const u16* DOR, const float* LSE, const float* DELTA, int64_t S_pad, float scale, float* dQ,
                   float* dK, float* dV, float* st, float* dpt, u16* ptb, u16* dstb, u16* dsv, float* dqt) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < S_pad; i0 += QB) {
    const int64_t n = i0 + QB;  // keys 0..n-1 (rows of the transposed blocks)
    brgemm(n, QB, D, D, S_pad, QB, false, bf(K), bf(QC + i0 * 2), st, true);    // S^T = K Q^T
    brgemm(n, QB, D, D, S_pad, QB, false, bf(V), bf(DOC + i0 * 2), dpt, true);  // dP^T = V dO^T
    __m512 lse[QB / 16], delta[QB / 16];
    for (int64_t c = 0; c < QB / 16; ++c) {
      lse[c] = _mm512_loadu_ps(LSE + i0 + c * 16);
      delta[c] = _mm512_loadu_ps(DELTA + i0 + c * 16);
    }
    for (int64_t r = 0; r < n; r += 2) {
      __m512 ds[2][QB / 16];
      for (int64_t t = 0; t < 2; ++t) {
        const int64_t key = r + t;
        for (int64_t c = 0; c < QB / 16; ++c) {
          const int64_t off = key * QB + c * 16;
          __m512 p = __m512(Vec(_mm512_fmsub_ps(_mm512_loadu_ps(st + off), vscale, lse[c])).exp_u20());
          const int64_t q0 = i0 + c * 16;  // query of lane 0; lanes with query < key are masked
          if (key > q0) {
            const int64_t drop = std::min<int64_t>(16, key - q0);
            p = _mm512_maskz_mov_ps(static_cast<__mmask16>(~((1u << drop) - 1u)), p);
          }
          ds[t][c] = _mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(dpt + off), delta[c]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ptb + off), to_bf16(p));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dstb + off), to_bf16(ds[t][c]));
        }
      }
      for (int64_t c = 0; c < QB / 16; ++c)
        _mm512_storeu_si512(dsv + ((r / 2) * QB + c * 16) * 2, interleave_bf16(ds[0][c], ds[1][c]));
    }
    brgemm(n, D, QB, QB, D, D, true, bf(ptb), bf(DOR + (i0 / 2) * D * 2), dV, true);   // dV += P^T dO
    brgemm(n, D, QB, QB, D, D, true, bf(dstb), bf(QR + (i0 / 2) * D * 2), dK, true);   // dK += dS^T Q
    brgemm(D, QB, n, S_pad, QB, QB, false, bf(KT), bf(dsv), dqt, true);                // dQ^T = K^T dS^T
    for (int64_t c = 0; c < QB; ++c)
      for (int64_t d = 0; d < D; ++d) dQ[(i0 + c) * D + d] = dqt[d * QB + c];
  }
}

template <int64_t ND>
void run_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out,
                 at::Tensor& lse) {
  constexpr int64_t D = ND * 16;
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), Hkv = k.size(1);
  const int64_t group = Hq / Hkv, S_pad = round_up(S, QB);
  Rows<at::BFloat16> qr(q), kr(k), vr(v);
  float* lse_base = lse.data_ptr<float>();
  at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<u16> Q(S_pad * D), KC(D * S_pad), VR(S_pad * D), pb(QB * S_pad);
    std::vector<float> O(S_pad * D), L(S_pad), strip(QB * S_pad), o(QB * D);
    int64_t packed_kv = -1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / Hq, h = u % Hq, hk = h / group;
      if (b * Hkv + hk != packed_kv) {
        pack_vcol(HeadRows(kr, b, hk, S, D), S_pad, KC.data());
        pack_vrow(HeadRows(vr, b, hk, S, D), S_pad, VR.data());
        packed_kv = b * Hkv + hk;
      }
      pack_plain(HeadRows(qr, b, h, S, D), S_pad, Q.data());
      forward_head<D>(Q.data(), KC.data(), VR.data(), S_pad, static_cast<float>(scale), O.data(), L.data(),
                      strip.data(), pb.data(), o.data());
      store_head(O.data(), 1.f, S, D, out, b, h);
      std::copy(L.data(), L.data() + S, lse_base + (b * Hq + h) * S);
    }
    at::native::cpublas::brgemm_release(true);
  });
}

template <int64_t ND>
void run_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& out, const at::Tensor& lse, double scale, at::Tensor& dq, at::Tensor& dk,
                  at::Tensor& dv) {
  constexpr int64_t D = ND * 16;
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), Hkv = k.size(1);
  const int64_t group = Hq / Hkv, S_pad = round_up(S, QB);
  Rows<at::BFloat16> qr(q), kr(k), vr(v), dor(dout), outr(out);
  const at::Tensor lse_c = lse.contiguous();
  const float* lse_base = lse_c.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    const int64_t SD = S_pad * D;
    std::vector<u16> K(SD), V(SD), KT(SD), QC(SD), DOC(SD), QR(SD), DOR(SD);
    std::vector<u16> ptb(S_pad * QB), dstb(S_pad * QB), dsv(S_pad * QB);
    std::vector<float> L(S_pad), DELTA(S_pad), dQ(SD), dK(SD), dV(SD), st(S_pad * QB), dpt(S_pad * QB), dqt(D * QB);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / Hkv, hk = u % Hkv;
      pack_plain(HeadRows(kr, b, hk, S, D), S_pad, K.data());
      pack_trans(HeadRows(kr, b, hk, S, D), S_pad, KT.data());
      pack_plain(HeadRows(vr, b, hk, S, D), S_pad, V.data());
      std::fill(dK.begin(), dK.end(), 0.f);
      std::fill(dV.begin(), dV.end(), 0.f);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        pack_vrow(HeadRows(qr, b, h, S, D), S_pad, QR.data());
        pack_vcol(HeadRows(qr, b, h, S, D), S_pad, QC.data());
        pack_vrow(HeadRows(dor, b, h, S, D), S_pad, DOR.data());
        pack_vcol(HeadRows(dor, b, h, S, D), S_pad, DOC.data());
        head_delta_lse(dor, outr, lse_base + (b * Hq + h) * S, b, h, S, S_pad, D, DELTA.data(), L.data());
        backward_head<D>(K.data(), V.data(), KT.data(), QC.data(), DOC.data(), QR.data(), DOR.data(), L.data(),
                         DELTA.data(), S_pad, static_cast<float>(scale), dQ.data(), dK.data(), dV.data(), st.data(),
                         dpt.data(), ptb.data(), dstb.data(), dsv.data(), dqt.data());
        store_head(dQ.data(), static_cast<float>(scale), S, D, dq, b, h);
      }
      store_head(dK.data(), static_cast<float>(scale), S, D, dk, b, hk);
      store_head(dV.data(), 1.f, S, D, dv, b, hk);
    }
    at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace amx
#else
#define TITAN_HAS_BF16 0
#endif

template <int64_t ND, typename T>
void run_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out,
                 at::Tensor& lse) {
  constexpr int64_t D = ND * W;
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), Hkv = k.size(1);
  const int64_t group = Hq / Hkv, S_pad = round_up(S, W);
  Rows<T> qr(q), kr(k), vr(v);
  T* out_base = out.data_ptr<T>();
  const int64_t osb = out.stride(0), osh = out.stride(1), oss = out.stride(2), osd = out.stride(3);
  float* lse_base = lse.data_ptr<float>();
  at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Q(S_pad * D), KT(D * S_pad), V(S_pad * D), O(S_pad * D), L(S_pad), strip(R * S_pad);
    int64_t packed_kv = -1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / Hq, h = u % Hq, hk = h / group;
      if (b * Hkv + hk != packed_kv) {
        pack_cols(kr, b, hk, S, S_pad, D, KT.data());
        pack_rows(vr, b, hk, S, S_pad, D, 1.f, V.data());
        packed_kv = b * Hkv + hk;
      }
      pack_rows(qr, b, h, S, S_pad, D, static_cast<float>(scale), Q.data());
      forward_head<ND>(Q.data(), KT.data(), V.data(), S_pad, O.data(), L.data(), strip.data());
      for (int64_t s = 0; s < S; ++s) store_row(O.data() + s * D, 1.f, D, out_base + b * osb + h * osh + s * oss, osd);
      std::copy(L.data(), L.data() + S, lse_base + (b * Hq + h) * S);
    }
  });
}

template <int64_t ND, typename T>
void run_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& out, const at::Tensor& lse, double scale, at::Tensor& dq, at::Tensor& dk,
                  at::Tensor& dv) {
  constexpr int64_t D = ND * W;
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), Hkv = k.size(1);
  const int64_t group = Hq / Hkv, S_pad = round_up(S, W);
  Rows<T> qr(q), kr(k), vr(v), dor(dout), outr(out);
  const at::Tensor lse_c = lse.contiguous();
  const float* lse_base = lse_c.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Qs(S_pad * D), KT(D * S_pad), K(S_pad * D), VT(D * S_pad), DO(S_pad * D), O(S_pad * D);
    std::vector<float> L(S_pad), DELTA(S_pad), dQ(S_pad * D), dK(S_pad * D), dV(S_pad * D);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / Hkv, hk = u % Hkv;
      pack_cols(kr, b, hk, S, S_pad, D, KT.data());
      pack_rows(kr, b, hk, S, S_pad, D, 1.f, K.data());
      pack_cols(vr, b, hk, S, S_pad, D, VT.data());
      std::fill(dK.begin(), dK.end(), 0.f);
      std::fill(dV.begin(), dV.end(), 0.f);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        pack_rows(qr, b, h, S, S_pad, D, static_cast<float>(scale), Qs.data());
        pack_rows(dor, b, h, S, S_pad, D, 1.f, DO.data());
        pack_rows(outr, b, h, S, S_pad, D, 1.f, O.data());
        const float* lrow = lse_base + (b * Hq + h) * S;
        for (int64_t s = 0; s < S_pad; ++s) {
          float acc = 0.f;
          for (int64_t d = 0; d < D; ++d) acc += DO[s * D + d] * O[s * D + d];
          DELTA[s] = acc;
          L[s] = s < S ? lrow[s] : 0.f;
        }
        backward_head<ND>(Qs.data(), KT.data(), K.data(), VT.data(), DO.data(), L.data(), DELTA.data(), S_pad,
                          dQ.data(), dK.data(), dV.data());
        T* dq_base = dq.data_ptr<T>();
        for (int64_t s = 0; s < S; ++s)
          store_row(dQ.data() + s * D, static_cast<float>(scale), D,
                    dq_base + b * dq.stride(0) + h * dq.stride(1) + s * dq.stride(2), dq.stride(3));
      }
      T* dk_base = dk.data_ptr<T>();
      T* dv_base = dv.data_ptr<T>();
      for (int64_t s = 0; s < S; ++s) {
        store_row(dK.data() + s * D, 1.f, D, dk_base + b * dk.stride(0) + hk * dk.stride(1) + s * dk.stride(2),
                  dk.stride(3));
        store_row(dV.data() + s * D, 1.f, D, dv_base + b * dv.stride(0) + hk * dv.stride(1) + s * dv.stride(2),
                  dv.stride(3));
      }
    }
  });
}

#define TITAN_DISPATCH_ND(D, ...)                                              \
  switch ((D) / W) {                                                           \
    case 1: { constexpr int64_t ND = 1; __VA_ARGS__; break; }                  \
    case 2: { constexpr int64_t ND = 2; __VA_ARGS__; break; }                  \
    case 4: { constexpr int64_t ND = 4; __VA_ARGS__; break; }                  \
    case 8: { constexpr int64_t ND = 8; __VA_ARGS__; break; }                  \
    default: TORCH_CHECK(false, "titan_cpu attention: unsupported head_dim ", D); \
  }

std::tuple<at::Tensor, at::Tensor> attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double scale) {
  check_inputs(q, k, v);
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3);
  at::Tensor out = new_bhsd(q, B, Hq, S, D, q.scalar_type());
  at::Tensor lse = at::empty({B, Hq, S}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "titan_cpu_attn_fwd", [&] {
#if TITAN_HAS_BF16
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (amx::enabled()) {
        TITAN_DISPATCH_ND(D, amx::run_forward<ND>(q, k, v, scale, out, lse));
        return;
      }
      TITAN_DISPATCH_ND(D, run_forward_bf16<ND>(q, k, v, scale, out, lse));
      return;
    }
#endif
    TITAN_DISPATCH_ND(D, run_forward<ND, scalar_t>(q, k, v, scale, out, lse));
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attn_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& lse,
                                                        double scale) {
  check_inputs(q, k, v);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "titan_cpu attention: dout/out shape");
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1);
  const at::Tensor dout_c = dout.scalar_type() == q.scalar_type() ? dout : dout.to(q.scalar_type());
  at::Tensor dq = new_bhsd(q, B, Hq, S, D, q.scalar_type());
  at::Tensor dk = new_bhsd(q, B, Hkv, S, D, q.scalar_type());
  at::Tensor dv = new_bhsd(q, B, Hkv, S, D, q.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "titan_cpu_attn_bwd", [&] {
#if TITAN_HAS_BF16
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (amx::enabled()) {
        TITAN_DISPATCH_ND(D, amx::run_backward<ND>(dout_c, q, k, v, out, lse, scale, dq, dk, dv));
        return;
      }
      TITAN_DISPATCH_ND(D, run_backward_bf16<ND>(dout_c, q, k, v, out, lse, scale, dq, dk, dv));
      return;
    }
#endif
    TITAN_DISPATCH_ND(D, run_backward<ND, scalar_t>(dout_c, q, k, v, out, lse, scale, dq, dk, dv));
  });
  return {dq, dk, dv};
}

bool uses_amx() {
#if TITAN_HAS_BF16
  return amx::enabled();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(titan_cpu, m) {
  m.def("uses_amx() -> bool");
  m.def("attn_fwd(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)");
  m.def(
      "attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale)"
      " -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(titan_cpu, CPU, m) {
  m.impl("attn_fwd", &attn_fwd);
  m.impl("attn_bwd", &attn_bwd);
}

TORCH_LIBRARY_IMPL(titan_cpu, CatchAll, m) { m.impl("uses_amx", &uses_amx); }
