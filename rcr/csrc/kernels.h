// Building blocks of the fused CPU ops (detector_pass.cpp, decide.cpp): the dot products of a KV head's G query rows
// with one key row, a row's log-sum-exp, and the ascending top-k of a row by a threshold. Written with ATen's
// Vectorized<float>, so one source serves every build of rcr/fused.py: 16 lanes with AVX-512, 8 with AVX2, and ATen's
// plain-array fallback on any other CPU.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

namespace rcr_kernels {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The sum and the maximum of a vector's lanes: the vector builds' own reductions; ATen's generic Vectorized has none
// that compiles, so the plain loop there
inline float lanes_sum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_add();
#else
  float b[kW];
  v.store(b);
  float s = 0.f;
  for (int64_t i = 0; i < kW; ++i) s += b[i];
  return s;
#endif
}

inline float lanes_max(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_max();
#else
  float b[kW];
  v.store(b);
  float m = b[0];
  for (int64_t i = 1; i < kW; ++i) m = std::max(m, b[i]);
  return m;
#endif
}

// exp of each lane. With AVX-512: Cephes' expf (x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-5 polynomial,
// 2^n by scalef, which also gives the denormals and the 0 below them), within 1.3 ulp, in half the instructions of
// ATen's Sleef exp. It is most of the detector's cost: one exponential per query head per prefix entry.
inline Vec vexp(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  // clamped to [-104, 100], where exp is 0 below and +inf above in float; the clamp's operand order keeps NaN
  const __m512 x = _mm512_min_ps(_mm512_set1_ps(100.f), _mm512_max_ps(_mm512_set1_ps(-104.f), static_cast<__m512>(v)));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return Vec(_mm512_scalef_ps(p, n));
#else
  return v.exp();
#endif
}

// A buffer of at least n elements that lives as long as the thread: steady-state decoding allocates nothing. Each
// caller names its own buffer (distinct `Tag`s), so two of them are never the same memory.
template <typename T, int Tag>
T* scratch(int64_t n) {
  thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// out[g] = sc * q[g] . k for the G query rows q (G, d) and one key row k (d): one read of the key row for all of them,
// GN <= 8 rows at a time, each with its own accumulator over d
template <int GN>
inline void dots_block(const float* q, int64_t d, const float* k, float sc, float* out) {
  Vec acc[GN];
  for (int g = 0; g < GN; ++g) acc[g] = Vec(0.f);
  int64_t i = 0;
  for (; i + kW <= d; i += kW) {
    const Vec kv = Vec::loadu(k + i);
    for (int g = 0; g < GN; ++g) acc[g] = at::vec::fmadd(Vec::loadu(q + g * d + i), kv, acc[g]);
  }
  if (i < d) {  // zero-filled tail lanes add nothing
    const Vec kv = Vec::loadu(k + i, d - i);
    for (int g = 0; g < GN; ++g) acc[g] = at::vec::fmadd(Vec::loadu(q + g * d + i, d - i), kv, acc[g]);
  }
  for (int g = 0; g < GN; ++g) out[g] = lanes_sum(acc[g]) * sc;
}

inline void key_dots(const float* q, int64_t G, int64_t d, const float* k, float sc, float* out) {
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const float* qg = q + g0 * d;
    switch (std::min<int64_t>(8, G - g0)) {
      case 1: dots_block<1>(qg, d, k, sc, out + g0); break;
      case 2: dots_block<2>(qg, d, k, sc, out + g0); break;
      case 3: dots_block<3>(qg, d, k, sc, out + g0); break;
      case 4: dots_block<4>(qg, d, k, sc, out + g0); break;
      case 5: dots_block<5>(qg, d, k, sc, out + g0); break;
      case 6: dots_block<6>(qg, d, k, sc, out + g0); break;
      case 7: dots_block<7>(qg, d, k, sc, out + g0); break;
      default: dots_block<8>(qg, d, k, sc, out + g0);
    }
  }
}

// Asks for the cache lines of a row that will be read soon: rows picked across the prefix store are far apart, where
// the hardware prefetcher cannot guess them
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o);
}

// A key row as float: itself, or converted into buf (d) from bf16, fp16 or fp64 keys.
template <typename T>
inline const float* row_as_float(const T* k, int64_t d, float* buf) {
  for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(k[i]);
  return buf;
}
template <>
inline const float* row_as_float<float>(const float* k, int64_t, float*) {
  return k;
}

// log sum_j exp(l[j]) over a row of n logits; -inf for an empty or all -inf row
inline float logsumexp(const float* l, int64_t n) {
  Vec vm(kNegInf);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) vm = at::vec::maximum(vm, Vec::loadu(l + j));
  float m = lanes_max(vm);
  for (; j < n; ++j) m = std::max(m, l[j]);
  if (m == kNegInf) return kNegInf;
  const Vec vmm(m);
  Vec vs(0.f);
  for (j = 0; j + kW <= n; j += kW) vs = vs + vexp(Vec::loadu(l + j) - vmm);
  float s = lanes_sum(vs);
  for (; j < n; ++j) s += std::exp(l[j] - m);
  return m + std::log(s);
}

inline float logaddexp(float a, float b) {
  const float hi = std::max(a, b);
  return hi == kNegInf ? kNegInf : hi + std::log1p(std::exp(std::min(a, b) - hi));
}

// The indices of the k largest of v[0, n), ascending, into out (k), without sorting: t, the k-th largest value, is
// found by selection, and the entries >= t are the top k when exactly k of them are. Where t is tied with an entry
// outside the top k, or a value is NaN, the set is at::topk's choice (the torch path's), and this returns false.
//
// At n >> k a first pass narrows the search: the k-th largest of the maxima of about 4k blocks (whole vectors) is
// <= t (k blocks hold a value at least that large), so only the entries not below it are kept, a few per block that
// holds any.
inline bool top_k_ascending(const float* v, int64_t n, int64_t k, int64_t* out) {
  if (k <= 0) return true;
  if (k >= n) {
    for (int64_t i = 0; i < n; ++i) out[i] = i;
    return k == n;
  }
  const int64_t vecs = std::max<int64_t>(1, n / (4 * k * kW)), blk = vecs * kW;  // vectors per block, entries
  const int64_t nb = n / blk;  // whole blocks; the tail's entries all go on to the selection
  float* sv = scratch<float, 0>(n);  // the entries kept: their values, in position order
  int64_t* si = scratch<int64_t, 0>(n);  // and their positions
  int64_t m = 0, i = 0;
  if (nb >= 2 * k) {
    float* bmax = scratch<float, 1>(nb);
    Vec any_nan(kNegInf);  // maximum() propagates NaN lane by lane
    for (int64_t b = 0; b < nb; ++b) {
      Vec x = Vec::loadu(v + b * blk);
      for (int64_t j = 1; j < vecs; ++j) x = at::vec::maximum(x, Vec::loadu(v + b * blk + j * kW));
      any_nan = at::vec::maximum(any_nan, x);
      bmax[b] = lanes_max(x);
    }
    float lanes[kW];
    any_nan.store(lanes);
    for (int64_t j = 0; j < kW; ++j)
      if (std::isnan(lanes[j])) return false;
    std::nth_element(bmax, bmax + (k - 1), bmax + nb, std::greater<float>());
    const Vec t0(bmax[k - 1]);
    for (; i < nb * blk; i += kW) {
      const int below = (Vec::loadu(v + i) >= t0).zero_mask();  // bit j set: lane j is below t0
      if (below == (1 << kW) - 1) continue;
      for (int64_t j = 0; j < kW; ++j)
        if (!((below >> j) & 1)) sv[m] = v[i + j], si[m++] = i + j;
    }
  }
  for (; i < n; ++i) {
    if (std::isnan(v[i])) return false;
    sv[m] = v[i], si[m++] = i;
  }
  float* sel = scratch<float, 2>(m);
  std::copy(sv, sv + m, sel);
  std::nth_element(sel, sel + (k - 1), sel + m, std::greater<float>());
  const float t = sel[k - 1];
  int64_t above = 0, at_t = 0;
  for (int64_t j = 0; j < m; ++j) above += sv[j] > t, at_t += sv[j] == t;
  if (above + at_t != k) return false;
  int64_t o = 0;
  for (int64_t j = 0; j < m; ++j)
    if (sv[j] >= t) out[o++] = si[j];
  return true;
}

// The same, by at::topk (the torch path's rcr.scoring.top_sorted): its choice among ties, NaN ranked highest
inline void top_k_ascending_topk(const float* v, int64_t n, int64_t k, int64_t* out) {
  const at::Tensor row = at::from_blob(const_cast<float*>(v), {n}, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor idx = std::get<1>(at::topk(row, k, -1)).contiguous();
  std::copy(idx.data_ptr<int64_t>(), idx.data_ptr<int64_t>() + k, out);
  std::sort(out, out + k);
}

inline void top_sorted(const float* v, int64_t n, int64_t k, int64_t* out) {
  if (!top_k_ascending(v, n, k, out)) top_k_ascending_topk(v, n, k, out);
}

}  // namespace rcr_kernels
