// RCR's decode-time decision for one layer-step as one CPU op, rcr::decide, and the masked merge of a re-selection
// into the resident slots, rcr::merge_rows (rcr/fused.py; docs/algorithms.md, "The fused CPU kernels").
//
// rcr::decide is RCR.decide (rcr/methods/rcr.py) with the resident reader: the exact logits over the resident slots
// (their log-sum-exp, and the kept entries' logits for the candidate ranking), the detector pass
// (rcr::detector_pass), the drift and the trigger, and the candidates' exact re-scoring, in plain loops; at::topk chooses the candidates and the selection, as the torch path does, so ties fall the
// same way. What it removes is the ~100 torch calls of the torch path, each a few microseconds of dispatch and
// allocation: on a small model those cost far more than the arithmetic. The rounding differs from the torch path
// (sums in another order) but not the decisions (tests/rcr/test_rcr_decision.py). The threshold update stays with
// the method: it is what rcr, fixed and rcr_layer differ in.
//
// rcr::merge_rows is ResidentLayer.refresh (rcr/cache.py) without its temporaries: where the trigger is set, slots
// [0, S) of a (sample, KV head) become copies of the selected prefix rows. Rows that did not fire are not touched,
// which is what the masked torch.where of the torch path leaves them as.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include <torch/library.h>

#include "detector_pass.h"

namespace {

constexpr float kNegInfF = -std::numeric_limits<float>::infinity();

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "rcr::decide/merge_rows: ", name, " must be a CPU tensor");
}

// x (B, H, N, d) with contiguous rows (a slice along N of a contiguous tensor is fine): the rows' first bytes
at::Tensor rows_contiguous(const at::Tensor& x) {
  return (x.stride(3) == 1 && x.stride(2) == x.size(3)) ? x : x.contiguous();
}

// Row-wise ascending sort of the indices of the top k along the last dim of scores (B, H, M): rcr.scoring.top_sorted.
// at::topk chooses the set, as in the torch path (the same entries on ties); the order is then by position.
at::Tensor top_sorted(const at::Tensor& scores, int64_t k) {
  at::Tensor idx = std::get<1>(at::topk(scores, k, -1)).contiguous();
  int64_t* p = idx.data_ptr<int64_t>();
  for (int64_t row = 0; row < idx.numel() / std::max<int64_t>(k, 1); ++row) std::sort(p + row * k, p + (row + 1) * k);
  return idx;
}

template <typename T>
float dot(const float* q, const T* k, int64_t d) {
  float acc = 0.f;
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

template <>
float dot<float>(const float* q, const float* k, int64_t d) {  // 8 lanes, two accumulators
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t W = Vec::size();
  Vec a0(0.f), a1(0.f);
  int64_t i = 0;
  for (; i + 2 * W <= d; i += 2 * W) {
    a0 = at::vec::fmadd(Vec::loadu(q + i), Vec::loadu(k + i), a0);
    a1 = at::vec::fmadd(Vec::loadu(q + i + W), Vec::loadu(k + i + W), a1);
  }
  for (; i + W <= d; i += W) a0 = at::vec::fmadd(Vec::loadu(q + i), Vec::loadu(k + i), a0);
  float buf[W];
  (a0 + a1).store(buf);
  float acc = 0.f;
  for (int64_t j = 0; j < W; ++j) acc += buf[j];
  for (; i < d; ++i) acc += q[i] * k[i];
  return acc;
}

// log sum_j exp(l[j]) over a row of logits, -inf for an empty or all -inf row
float logsumexp(const float* l, int64_t n) {
  float m = kNegInfF;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, l[j]);
  if (m == kNegInfF) return kNegInfF;
  float s = 0.f;
  for (int64_t j = 0; j < n; ++j) s += std::exp(l[j] - m);
  return m + std::log(s);
}

// Step 1 of the decision for one (sample, KV head) whose keys are of type T: the exact logits of the G query heads
// over the n resident slots kr (n, d) (-inf where a slot is invalid), their log-sum-exp lse_res (G), and, with
// kept (G, S), the logits of the first S slots (the kept prefix entries), which rank them among the candidates.
template <typename T>
void resident_logits(const float* q, int64_t G, int64_t d, const T* kr, int64_t n, const bool* rv, float sc,
                     int64_t S, float* lse_res, float* kept, std::vector<float>& scratch) {
  scratch.resize(n);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < n; ++j)
      scratch[j] = (rv == nullptr || rv[j]) ? dot(q + g * d, kr + j * d, d) * sc : kNegInfF;
    lse_res[g] = logsumexp(scratch.data(), n);
    if (kept != nullptr) std::copy(scratch.begin(), scratch.begin() + S, kept + g * S);
  }
}

// Step 3: the exact scores (C) of the candidates cand (C) with the prefix rows kp (Np, d). mean_prob: the mean over
// G of each head's probability, its softmax over the candidates, or with norm (G) exp(logit - norm[g]).
template <typename T>
void exact_scores(const float* q, int64_t G, int64_t d, const T* kp, const int64_t* cand, int64_t C, const bool* pv,
                  float sc, bool mean_prob, const float* norm, float* exact, std::vector<float>& scratch) {
  scratch.resize(G * C);
  float* lg = scratch.data();  // (G, C) exact logits of the candidates, -inf where a candidate is padding
  for (int64_t c = 0; c < C; ++c) {
    const bool ok = pv == nullptr || pv[cand[c]];
    for (int64_t g = 0; g < G; ++g) lg[g * C + c] = ok ? dot(q + g * d, kp + cand[c] * d, d) * sc : kNegInfF;
  }
  if (mean_prob) {  // an all-padding row (or a -inf normaliser) counts 0
    std::fill(exact, exact + C, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      const float lse = norm != nullptr ? norm[g] : logsumexp(lg + g * C, C);
      if (lse == kNegInfF) continue;
      for (int64_t c = 0; c < C; ++c) exact[c] += std::exp(lg[g * C + c] - lse);
    }
    for (int64_t c = 0; c < C; ++c) exact[c] /= static_cast<float>(G);
  } else {
    for (int64_t c = 0; c < C; ++c) {
      exact[c] = kNegInfF;
      for (int64_t g = 0; g < G; ++g) exact[c] = std::max(exact[c], lg[g * C + c]);
    }
  }
  if (pv != nullptr)
    for (int64_t c = 0; c < C; ++c) if (!pv[cand[c]]) exact[c] = kNegInfF;
}

float logaddexp(float a, float b) {
  const float hi = std::max(a, b);
  return hi == kNegInfF ? kNegInfF : hi + std::log1p(std::exp(std::min(a, b) - hi));
}

}  // namespace

// -> trigger ((B,) bool, or (B, Hkv) with per_head), f ((B,) fp32: the refresh indicator, or the fraction of KV
// heads, that the rate controller takes), drift ((B,) fp32), selection ((B, Hkv, S) int64, ascending: the new
// selection, merged where trigger is set)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> decide(
    const at::Tensor& qg, const at::Tensor& basis_in, const at::Tensor& projected_t, const at::Tensor& resident_keys_in,
    const std::optional<at::Tensor>& resident_valid, const at::Tensor& selection, const std::optional<at::Tensor>& valid,
    const at::Tensor& prefix_keys_in, const at::Tensor& tau, double scaling, bool mean_prob, bool per_head,
    int64_t n_candidates, int64_t n_selected, bool kept_exact, bool context_norm) {
  check_cpu(qg, "qg");
  check_cpu(resident_keys_in, "resident_keys");
  check_cpu(prefix_keys_in, "prefix_keys");
  check_cpu(tau, "tau");
  TORCH_CHECK(qg.dim() == 4 && resident_keys_in.dim() == 4 && prefix_keys_in.dim() == 4,
              "rcr::decide: qg, resident_keys and prefix_keys must be (B, Hkv, *, d)");
  const int64_t B = qg.size(0), H = qg.size(1), G = qg.size(2), d = qg.size(3), Np = projected_t.size(-1);
  const int64_t R = basis_in.size(-1), n = resident_keys_in.size(2), C = std::min(n_candidates, Np);
  TORCH_CHECK(prefix_keys_in.size(0) == B && prefix_keys_in.size(1) == H && prefix_keys_in.size(2) == Np &&
              prefix_keys_in.size(3) == d, "rcr::decide: prefix_keys must be (B, Hkv, Np, d) for the detector's Np = ", Np);
  TORCH_CHECK(resident_keys_in.size(0) == B && resident_keys_in.size(1) == H && resident_keys_in.size(3) == d &&
              resident_keys_in.scalar_type() == prefix_keys_in.scalar_type(),
              "rcr::decide: resident_keys must be (B, Hkv, n, d), of prefix_keys' dtype");
  TORCH_CHECK(basis_in.scalar_type() == at::kFloat && basis_in.dim() == 4 && basis_in.size(0) == B &&
              basis_in.size(1) == H && basis_in.size(2) == d, "rcr::decide: basis must be float32 (B, Hkv, d, r)");
  TORCH_CHECK(tau.dim() == 1 && tau.size(0) == B && tau.scalar_type() == at::kFloat, "rcr::decide: tau must be float32 (B,)");
  TORCH_CHECK(n_selected >= 0 && n_selected <= C, "rcr::decide: n_selected must be <= the candidates");
  at::Tensor rv;
  if (resident_valid.has_value()) {
    rv = resident_valid->stride(2) == 1 ? *resident_valid : resident_valid->contiguous();
    TORCH_CHECK(rv.scalar_type() == at::kBool && rv.dim() == 3 && rv.size(0) == B && rv.size(1) == H && rv.size(2) == n,
                "rcr::decide: resident_valid must be bool (B, Hkv, n)");
  }
  at::Tensor pv;
  if (valid.has_value()) {
    pv = valid->stride(1) == 1 ? *valid : valid->contiguous();  // (B, Np), a slice of (B, N)
    TORCH_CHECK(pv.scalar_type() == at::kBool && pv.dim() == 2 && pv.size(0) == B && pv.size(1) == Np,
                "rcr::decide: valid must be bool (B, Np)");
  }
  const at::Tensor q = qg.to(at::kFloat).contiguous();  // (B, H, G, d)
  const at::Tensor basis = basis_in.contiguous();
  const at::Tensor kr = rows_contiguous(resident_keys_in), kp = rows_contiguous(prefix_keys_in);
  const float sc = static_cast<float>(scaling);
  const float* qd = q.data_ptr<float>();

  // the detector pass: rank-r query projections qr = q @ basis (B, H, G, r), then rcr::detector_pass
  at::Tensor qr = at::empty({B, H, G, R}, q.options());
  {
    const float* bd = basis.data_ptr<float>();
    float* out = qr.data_ptr<float>();
    for (int64_t bhg = 0; bhg < B * H * G; ++bhg) {
      const float* qv = qd + bhg * d;
      const float* U = bd + (bhg / G) * d * R;  // (d, r) of this (b, h)
      for (int64_t k = 0; k < R; ++k) {
        float acc = 0.f;
        for (int64_t i = 0; i < d; ++i) acc += qv[i] * U[i * R + k];
        out[bhg * R + k] = acc;
      }
    }
  }
  // 1. the exact logits over the resident slots: their log-sum-exp, and the kept entries' logits (slots [0, S))
  const int64_t S = selection.size(2);
  const bool context = mean_prob && context_norm;
  at::Tensor lse_res = at::empty({B, H, G}, q.options());
  at::Tensor kept = kept_exact ? at::empty({B, H, G, S}, q.options()) : at::Tensor();
  TORCH_CHECK(!kept_exact || S <= n, "rcr::decide: the resident slots must hold the S kept entries");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kr.scalar_type(), "rcr::decide", [&] {
    std::vector<float> scratch;
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      resident_logits<scalar_t>(
          qd + bh * G * d, G, d, kr.data_ptr<scalar_t>() + b * kr.stride(0) + h * kr.stride(1), n,
          rv.defined() ? rv.data_ptr<bool>() + b * rv.stride(0) + h * rv.stride(1) : nullptr, sc, S,
          lse_res.data_ptr<float>() + bh * G, kept_exact ? kept.data_ptr<float>() + bh * G * S : nullptr, scratch);
    }
  });
  // the detector pass: the evicted log-sum-exp and the candidate scores
  auto [lse_ev, scores] = detector_pass(qr, projected_t, selection, valid,
                                        kept_exact ? std::optional<at::Tensor>(kept) : std::nullopt,
                                        context ? std::optional<at::Tensor>(lse_res) : std::nullopt, scaling, mean_prob);
  // (B, H, C): the top C of the prefix ranking, in position order; every entry when C covers the prefix
  at::Tensor cand;
  if (C == Np) {
    cand = at::empty({B, H, Np}, selection.options());
    int64_t* cd = cand.data_ptr<int64_t>();
    for (int64_t i = 0; i < B * H * Np; ++i) cd[i] = i % Np;
  } else {
    cand = top_sorted(scores, C);
  }

  // 3. the candidates' exact scores; with the context's normaliser logaddexp(lse_res, lse_ev) per query head
  at::Tensor exact = at::empty({B, H, C}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kp.scalar_type(), "rcr::decide", [&] {
    std::vector<float> scratch, norm(G);
    const float* lr = lse_res.data_ptr<float>();
    const float* le = lse_ev.data_ptr<float>();
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      if (context)
        for (int64_t g = 0; g < G; ++g) norm[g] = logaddexp(lr[bh * G + g], le[bh * G + g]);
      exact_scores<scalar_t>(
          qd + bh * G * d, G, d, kp.data_ptr<scalar_t>() + b * kp.stride(0) + h * kp.stride(1),
          cand.data_ptr<int64_t>() + bh * C, C, pv.defined() ? pv.data_ptr<bool>() + b * pv.stride(0) : nullptr, sc,
          mean_prob, context ? norm.data() : nullptr, exact.data_ptr<float>() + bh * C, scratch);
    }
  });

  // drift = sigmoid(lse_ev - lse_res), mean over G (per KV head), then over the KV heads; 2. the trigger
  at::Tensor drift = at::empty({B}, q.options()), f = at::empty({B}, q.options());
  at::Tensor trigger = at::empty(per_head ? std::vector<int64_t>{B, H} : std::vector<int64_t>{B}, q.options().dtype(at::kBool));
  {
    const float* le = lse_ev.data_ptr<float>();
    const float* lr = lse_res.data_ptr<float>();
    const at::Tensor tau_f = tau.contiguous();
    const float* td = tau_f.data_ptr<float>();
    float* dd = drift.data_ptr<float>();
    float* fd = f.data_ptr<float>();
    bool* tr = trigger.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b) {
      float sum_h = 0.f, fired = 0.f;
      for (int64_t h = 0; h < H; ++h) {
        float sum_g = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = (b * H + h) * G + g;
          sum_g += 1.f / (1.f + std::exp(lr[i] - le[i]));  // sigmoid(lse_ev - lse_res); NaN when both are -inf
        }
        const float drift_h = sum_g / static_cast<float>(G);
        sum_h += drift_h;
        if (per_head) {
          tr[b * H + h] = drift_h > td[b];
          fired += tr[b * H + h] ? 1.f : 0.f;
        }
      }
      dd[b] = sum_h / static_cast<float>(H);
      if (!per_head) tr[b] = dd[b] > td[b];
      fd[b] = per_head ? fired / static_cast<float>(H) : (tr[b] ? 1.f : 0.f);
    }
  }
  at::Tensor sel = at::gather(cand, 2, top_sorted(exact, n_selected));  // prefix indices, ascending
  return {trigger, f, drift, sel};
}

// In place, where trigger ((B,) or (B, Hkv) bool) is set: keys/values[b, h, :S] = prefix rows new_selection[b, h],
// selection[b, h] = new_selection[b, h] and, with prefix_valid (left padding), slot_valid[b, h, :S] = their validity.
void merge_rows(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slot_valid,
                const at::Tensor& selection, const at::Tensor& trigger_in, const at::Tensor& new_selection_in,
                const at::Tensor& prefix_keys_in, const at::Tensor& prefix_values_in,
                const std::optional<at::Tensor>& prefix_valid) {
  check_cpu(keys, "keys");
  check_cpu(values, "values");
  check_cpu(prefix_keys_in, "prefix_keys");
  check_cpu(prefix_values_in, "prefix_values");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && slot_valid.is_contiguous() && selection.is_contiguous(),
              "rcr::merge_rows: the resident buffers must be contiguous");
  TORCH_CHECK(keys.scalar_type() == prefix_keys_in.scalar_type() && values.scalar_type() == prefix_values_in.scalar_type(),
              "rcr::merge_rows: resident and prefix dtypes differ");
  TORCH_CHECK(selection.scalar_type() == at::kLong && new_selection_in.scalar_type() == at::kLong &&
              trigger_in.scalar_type() == at::kBool && slot_valid.scalar_type() == at::kBool,
              "rcr::merge_rows: selections must be int64, trigger and slot_valid bool");
  const at::Tensor k_p = rows_contiguous(prefix_keys_in), v_p = rows_contiguous(prefix_values_in);
  const at::Tensor sel = new_selection_in.contiguous(), trig = trigger_in.contiguous();
  const int64_t B = keys.size(0), H = keys.size(1), cap = keys.size(2), d = keys.size(3), S = sel.size(2);
  const int64_t Np = k_p.size(2);
  TORCH_CHECK(sel.size(0) == B && sel.size(1) == H && selection.sizes() == sel.sizes() && S <= cap,
              "rcr::merge_rows: new_selection must be (B, Hkv, S) like selection");
  TORCH_CHECK(k_p.size(0) == B && k_p.size(1) == H && k_p.size(3) == d && v_p.sizes() == k_p.sizes() &&
              values.sizes() == keys.sizes(), "rcr::merge_rows: prefix and resident shapes differ");
  const bool per_head = trig.dim() == 2;
  TORCH_CHECK(trig.size(0) == B && (!per_head || trig.size(1) == H), "rcr::merge_rows: trigger must be (B,) or (B, Hkv)");
  at::Tensor pv;
  if (prefix_valid.has_value()) {
    pv = prefix_valid->stride(1) == 1 ? *prefix_valid : prefix_valid->contiguous();  // (B, Np), a slice of (B, N)
    TORCH_CHECK(pv.scalar_type() == at::kBool && pv.size(0) == B && pv.size(1) == Np,
                "rcr::merge_rows: prefix_valid must be bool (B, Np)");
  }
  const int64_t krow = d * keys.element_size(), vrow = d * values.element_size();
  char* kd = static_cast<char*>(keys.data_ptr());
  char* vd = static_cast<char*>(values.data_ptr());
  bool* sv = slot_valid.data_ptr<bool>();
  int64_t* so = selection.data_ptr<int64_t>();
  const char* kp = static_cast<const char*>(k_p.data_ptr());
  const char* vp = static_cast<const char*>(v_p.data_ptr());
  const int64_t* ns = sel.data_ptr<int64_t>();
  const bool* td = trig.data_ptr<bool>();
  const bool* pvd = pv.defined() ? pv.data_ptr<bool>() : nullptr;
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    if (!td[per_head ? bh : b]) continue;
    const char* krows = kp + (b * k_p.stride(0) + h * k_p.stride(1)) * k_p.element_size();
    const char* vrows = vp + (b * v_p.stride(0) + h * v_p.stride(1)) * v_p.element_size();
    for (int64_t j = 0; j < S; ++j) {
      const int64_t n = ns[bh * S + j];
      TORCH_CHECK(n >= 0 && n < Np, "rcr::merge_rows: selection index ", n, " outside the prefix [0, ", Np, ")");
      std::memcpy(kd + (bh * cap + j) * krow, krows + n * krow, krow);
      std::memcpy(vd + (bh * cap + j) * vrow, vrows + n * vrow, vrow);
      if (pvd != nullptr) sv[bh * cap + j] = pvd[b * pv.stride(0) + n];
      so[bh * S + j] = n;
    }
  }
}

TORCH_LIBRARY_FRAGMENT(rcr, m) {
  m.def("decide(Tensor qg, Tensor basis, Tensor projected_t, Tensor resident_keys, Tensor? resident_valid, "
        "Tensor selection, Tensor? valid, Tensor prefix_keys, Tensor tau, float scaling, bool mean_prob, "
        "bool per_head, int n_candidates, int n_selected, bool kept_exact, bool context_norm) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("merge_rows(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) slot_valid, Tensor(d!) selection, Tensor trigger, "
        "Tensor new_selection, Tensor prefix_keys, Tensor prefix_values, Tensor? prefix_valid) -> ()");
}

TORCH_LIBRARY_IMPL(rcr, CPU, m) {
  m.impl("decide", &decide);
  m.impl("merge_rows", &merge_rows);
}
