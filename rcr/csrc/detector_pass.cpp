// The detector pass of RCR's decode-time decision, the op rcr::detector_pass (rcr/fused.py; docs/algorithms.md, "rcr"
// and "The fused CPU kernels").
//
// Per (sample b, KV head h), from the rank-r query projections qr (G, r) and the projected prefix keys
// P = K~^T (r, Np):
//   logits  l[g, n] = scaling * qr[g] . P[:, n]             (-inf where the prefix entry is padding), except that
//                     a kept entry n = selection[j] takes its exact logit kept[g, j] when kept is given
//   lse_ev[g]       = log sum_{n evicted} exp(l[g, n])      (-inf when no valid entry is evicted; the evicted
//                     entries' logits are the approximate ones)
//   scores[n]       = mean_g p[g, n] (mean_prob) or max_g l[g, n] (max_logit); -inf where padding, with
//                     p[g, n] = softmax_n(l[g, :])[n], or exp(l[g, n] - logaddexp(lse_res[g], lse_ev[g])) when
//                     lse_res (the exact log-sum-exp over the resident slots) is given: the probability under the
//                     query head's whole context
// The composed torch version (rcr.detector.Detector.evicted_lse_and_scores) writes the (G, Np) logits out and
// reads them back in five separate passes. Here phase A forms them with one read of P for all G query heads, into a
// scratch that stays in cache, and takes their exponentials against each row's maximum, the kept entries left out
// (so the sum is the evicted mass); phase B, which only a refresh needs, puts the kept entries' exponentials back
// and takes the head mean. Scratch buffers live with the thread: a step allocates nothing but its outputs.
#include "detector_pass.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

namespace rcr_kernels {

int64_t padded_length(int64_t Np) { return (Np + kW - 1) / kW * kW; }

namespace {

// Pass 1 of phase A: E[g, :] = sc * q[g] . P[:, n] (+ bias), vmax[g] their lane-wise running maxima and (max_scores)
// the max over g. RC > 0: the rank at compile time, with the block of P loaded once for all G; 0: any rank R.
template <int64_t RC, bool kMaxScores>
void logits_pass(const DetectorHead& h, float* E, Vec* vmax, float* max_scores) {
  const int64_t G = h.G, R = RC > 0 ? RC : h.R, Np = h.Np, Npad = padded_length(Np);
  const Vec vsc(h.sc);
  for (int64_t n0 = 0; n0 < Npad; n0 += kW) {
    const int64_t cnt = std::min(kW, Np - n0);
    Vec p[RC > 0 ? RC : 1];
    for (int64_t k = 0; k < R; ++k) __builtin_prefetch(h.P + k * Np + n0 + 8 * kW);  // R streams, 8 vectors ahead
    if constexpr (RC > 0)
      for (int64_t k = 0; k < RC; ++k) p[k] = Vec::loadu(h.P + k * Np + n0, cnt);
    Vec head_max(kNegInf);
    for (int64_t g = 0; g < G; ++g) {
      const float* q = h.qr + g * R;
      Vec acc(0.f);
      for (int64_t k = 0; k < R; ++k)
        acc = at::vec::fmadd(Vec(q[k]), RC > 0 ? p[k] : Vec::loadu(h.P + k * Np + n0, cnt), acc);
      acc = acc * vsc;
      if (h.bias != nullptr) {
        acc = acc + Vec::loadu(h.bias + n0);
      } else if (cnt < kW) {
        acc = Vec::set(Vec(kNegInf), acc, cnt);  // lanes past Np
      }
      acc.store(E + g * Npad + n0);
      vmax[g] = at::vec::maximum(vmax[g], acc);
      if constexpr (kMaxScores) head_max = at::vec::maximum(head_max, acc);
    }
    if constexpr (kMaxScores) head_max.store(max_scores + n0, cnt);
  }
}

}  // namespace

void detector_phase_a(const DetectorHead& h, const HeadScratch& s, float* lse_ev, float* max_scores) {
  const int64_t G = h.G, S = h.S, Npad = padded_length(h.Np);
  Vec* vmax = scratch<Vec, 0>(G);
  std::fill(vmax, vmax + G, Vec(kNegInf));
  if (max_scores != nullptr) {
    logits_pass<0, true>(h, s.E, vmax, max_scores);  // max_logit, an ablation
  } else {
    switch (h.R) {  // the common ranks unrolled
      case 4: logits_pass<4, false>(h, s.E, vmax, nullptr); break;
      case 8: logits_pass<8, false>(h, s.E, vmax, nullptr); break;
      case 16: logits_pass<16, false>(h, s.E, vmax, nullptr); break;
      default: logits_pass<0, false>(h, s.E, vmax, nullptr);
    }
  }
  // the kept entries' logits into K, exact (-inf on padding) or approximate as formed, then out of the rows
  for (int64_t g = 0; g < G; ++g) {
    const float* e = s.E + g * Npad;
    for (int64_t j = 0; j < S; ++j) {
      const int64_t n = h.sel[j];
      s.K[g * S + j] = h.kept != nullptr ? h.kept[g * S + j] + (h.bias != nullptr ? h.bias[n] : 0.f) : e[n];
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < S; ++j) s.E[g * Npad + h.sel[j]] = kNegInf;
  if (max_scores != nullptr)
    for (int64_t j = 0; j < S; ++j) {
      float head_max = kNegInf;
      for (int64_t g = 0; g < G; ++g) head_max = std::max(head_max, s.K[g * S + j]);
      max_scores[h.sel[j]] = head_max;
    }
  // pass 2: exponentials against each row's maximum (over the kept entries' logits too); their sum is the evicted mass
  for (int64_t g = 0; g < G; ++g) {
    float* e = s.E + g * Npad;
    float m = lanes_max(vmax[g]);
    for (int64_t j = 0; j < S; ++j) m = std::max(m, s.K[g * S + j]);
    s.m[g] = m;
    if (m == kNegInf) {  // no valid entry in this sample: nothing to normalise, nothing evicted
      std::fill(e, e + Npad, 0.f);
      s.ev[g] = 0.f;
      lse_ev[g] = kNegInf;
      continue;
    }
    const Vec vm(m);
    Vec ve(0.f);
    for (int64_t n0 = 0; n0 < Npad; n0 += kW) {
      const Vec x = vexp(Vec::loadu(e + n0) - vm);
      x.store(e + n0);
      ve = ve + x;
    }
    s.ev[g] = lanes_sum(ve);
    lse_ev[g] = s.ev[g] > 0.f ? m + std::log(s.ev[g]) : kNegInf;
  }
}

void detector_phase_b(const DetectorHead& h, const HeadScratch& s, const float* lse_ev, const float* lse_res,
                      float* scores) {
  const int64_t G = h.G, S = h.S, Np = h.Np, Npad = padded_length(Np);
  float* f = scratch<float, 10>(G + S);  // per head, the factor that takes exp(l - m) to its probability
  float* kx = f + G;                    // (S) one head's kept exponentials
  for (int64_t g = 0; g < G; ++g) {
    float* e = s.E + g * Npad;
    const float m = s.m[g];
    if (m == kNegInf) {
      f[g] = 0.f;
      continue;
    }
    float sum = s.ev[g];
    for (int64_t j = 0; j < S; j += kW) {
      const int64_t cnt = std::min(kW, S - j);
      vexp(Vec::loadu(s.K + g * S + j, cnt) - Vec(m)).store(kx + j, cnt);
    }
    for (int64_t j = 0; j < S; ++j) e[h.sel[j]] = kx[j], sum += kx[j];
    if (lse_res == nullptr) {  // the softmax over the prefix
      f[g] = sum > 0.f ? 1.f / sum : 0.f;
    } else {  // the context's normaliser
      const float norm = logaddexp(lse_res[g], lse_ev[g]);
      f[g] = norm == kNegInf ? 0.f : std::exp(m - norm);
    }
  }
  const Vec vg(static_cast<float>(G));
  for (int64_t n0 = 0; n0 < Npad; n0 += kW) {
    const int64_t cnt = std::min(kW, Np - n0);
    Vec acc(0.f);
    for (int64_t g = 0; g < G; ++g) acc = acc + Vec::loadu(s.E + g * Npad + n0) * Vec(f[g]);
    acc = acc / vg;
    if (h.bias != nullptr) acc = acc + Vec::loadu(h.bias + n0);
    acc.store(scores + n0, cnt);
  }
}

}  // namespace rcr_kernels

using namespace rcr_kernels;

std::tuple<at::Tensor, at::Tensor> detector_pass(const at::Tensor& qr_in, const at::Tensor& proj_in,
                                                 const at::Tensor& sel_in, const std::optional<at::Tensor>& valid_in,
                                                 const std::optional<at::Tensor>& kept_in,
                                                 const std::optional<at::Tensor>& lse_res_in, double scaling,
                                                 bool mean_prob) {
  TORCH_CHECK(qr_in.device().is_cpu() && proj_in.device().is_cpu() && sel_in.device().is_cpu(),
              "rcr::detector_pass runs on CPU tensors");
  TORCH_CHECK(qr_in.scalar_type() == at::kFloat && proj_in.scalar_type() == at::kFloat,
              "rcr::detector_pass: qr and projected_t must be float32");
  TORCH_CHECK(qr_in.dim() == 4 && proj_in.dim() == 4 && sel_in.dim() == 3, "rcr::detector_pass: bad ranks");
  const int64_t B = qr_in.size(0), H = qr_in.size(1), G = qr_in.size(2), R = qr_in.size(3);
  const int64_t Np = proj_in.size(3), S = sel_in.size(2), Npad = padded_length(Np);
  TORCH_CHECK(proj_in.size(0) == B && proj_in.size(1) == H && proj_in.size(2) == R,
              "rcr::detector_pass: projected_t must be (B, Hkv, r, Np) for qr (B, Hkv, G, r)");
  TORCH_CHECK(sel_in.size(0) == B && sel_in.size(1) == H && sel_in.scalar_type() == at::kLong,
              "rcr::detector_pass: selection must be int64 (B, Hkv, S)");
  const at::Tensor qr = qr_in.contiguous(), proj = proj_in.contiguous(), sel = sel_in.contiguous();
  at::Tensor valid;
  if (valid_in.has_value()) {
    valid = valid_in->contiguous();
    TORCH_CHECK(valid.scalar_type() == at::kBool && valid.dim() == 2 && valid.size(0) == B && valid.size(1) == Np,
                "rcr::detector_pass: valid must be bool (B, Np)");
  }
  at::Tensor kept, lse_res;
  if (kept_in.has_value()) {
    kept = kept_in->contiguous();
    TORCH_CHECK(kept.scalar_type() == at::kFloat && kept.dim() == 4 && kept.size(0) == B && kept.size(1) == H &&
                kept.size(2) == G && kept.size(3) == S, "rcr::detector_pass: kept must be float32 (B, Hkv, G, S)");
  }
  if (lse_res_in.has_value()) {
    lse_res = lse_res_in->contiguous();
    TORCH_CHECK(lse_res.scalar_type() == at::kFloat && lse_res.dim() == 3 && lse_res.size(0) == B &&
                lse_res.size(1) == H && lse_res.size(2) == G,
                "rcr::detector_pass: lse_res must be float32 (B, Hkv, G)");
  }
  const int64_t* sd = sel.data_ptr<int64_t>();
  for (int64_t i = 0; i < sel.numel(); ++i)
    TORCH_CHECK(sd[i] >= 0 && sd[i] < Np, "rcr::detector_pass: selection index ", sd[i], " outside the prefix [0, ",
                Np, ")");
  at::Tensor lse_ev = at::empty({B, H, G}, qr.options());
  at::Tensor scores = at::empty({B, H, Np}, qr.options());
  // per sample, 0 on valid entries and -inf on padding and past Np
  float* bias = valid.defined() ? scratch<float, 20>(B * Npad) : nullptr;
  if (bias != nullptr) {
    const bool* vd = valid.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t n = 0; n < Npad; ++n) bias[b * Npad + n] = (n < Np && vd[b * Np + n]) ? 0.f : kNegInf;
  }
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    const HeadScratch s{scratch<float, 21>(G * Npad), scratch<float, 22>(G * S), scratch<float, 23>(G),
                        scratch<float, 24>(G)};
    for (int64_t bh = begin; bh < end; ++bh) {
      const DetectorHead h{qr.data_ptr<float>() + bh * G * R, proj.data_ptr<float>() + bh * R * Np, sd + bh * S,
                           kept.defined() ? kept.data_ptr<float>() + bh * G * S : nullptr,
                           bias != nullptr ? bias + (bh / H) * Npad : nullptr, G, R, Np, S,
                           static_cast<float>(scaling)};
      float* lo = lse_ev.data_ptr<float>() + bh * G;
      float* so = scores.data_ptr<float>() + bh * Np;
      detector_phase_a(h, s, lo, mean_prob ? nullptr : so);
      if (mean_prob) detector_phase_b(h, s, lo, lse_res.defined() ? lse_res.data_ptr<float>() + bh * G : nullptr, so);
    }
  });
  return {lse_ev, scores};
}

// torch.ops.rcr.detector_pass: called from C++ through the dispatcher (no Python in between, and opaque to
// torch.compile, which takes its output shapes from the fake kernel registered in rcr/fused.py)
TORCH_LIBRARY(rcr, m) {
  m.def("detector_pass(Tensor qr, Tensor projected_t, Tensor selection, Tensor? valid, Tensor? kept, "
        "Tensor? lse_res, float scaling, bool mean_prob) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rcr, CPU, m) { m.impl("detector_pass", &detector_pass); }
