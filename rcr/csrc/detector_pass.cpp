// The detector pass of RCR's decode-time decision as one CPU kernel, the op rcr::detector_pass (rcr/fused.py;
// docs/algorithms.md, "rcr" and "Cost per decode step").
//
// Per (sample b, KV head h), from the rank-r query projections qr (G, r) and the projected prefix keys
// P = K~^T (r, Np):
//   logits  l[g, n] = scaling * qr[g] . P[:, n]             (-inf where the prefix entry is padding), except that
//                     a kept entry n = selection[j] takes its exact logit kept[g, j] when kept is given
//   lse_ev[g]       = log sum_{n evicted} exp(l[g, n])      (-inf when no valid entry is evicted)
//   scores[n]       = mean_g p[g, n] (mean_prob) or max_g l[g, n] (max_logit); -inf where padding, with
//                     p[g, n] = softmax_n(l[g, :])[n], or exp(l[g, n] - logaddexp(lse_res[g], lse_ev[g])) when
//                     lse_res (the exact log-sum-exp over the resident slots) is given: the probability under the
//                     query head's whole context
// The composed torch version (rcr.detector.Detector.evicted_lse_and_scores) writes the (G, Np) logits out and
// reads them back in five separate passes; here they are formed once, kept in a per-thread scratch that fits
// in L2, and reduced in two more passes (exponentials, then the head mean), 8 lanes at a time. The kept entries'
// exact logits are written into the scratch between the first two passes (S entries per query head).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include <torch/library.h>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float hsum(const Vec& v) {
  float buf[Vec::size()];
  v.store(buf);
  float s = 0.f;
  for (int i = 0; i < Vec::size(); ++i) s += buf[i];
  return s;
}

float hmax(const Vec& v) {
  float buf[Vec::size()];
  v.store(buf);
  float m = kNegInf;
  for (int i = 0; i < Vec::size(); ++i) m = std::max(m, buf[i]);
  return m;
}

// Logits l[g, n] = scaling * q[g] . P[:, n] + bias[n] into E (G, Npad), their running max per row into vmax, and
// (max_logit) the max over g into out_scores. RC > 0: the rank at compile time; 0: any rank R.
template <int64_t RC>
void logits_pass(const float* q, const float* P, int64_t R, int64_t G, int64_t Np, int64_t Npad, float sc,
                 const float* bias, float* E, Vec* vmax, float* out_scores, bool mean_prob) {
  constexpr int64_t W = Vec::size();
  for (int64_t n0 = 0; n0 < Npad; n0 += W) {
    const int64_t cnt = std::min(W, Np - n0);
    const Vec vb = Vec::loadu(bias + n0);
    Vec p[RC > 0 ? RC : 1];
    if constexpr (RC > 0) {
      for (int64_t k = 0; k < RC; ++k) p[k] = Vec::loadu(P + k * Np + n0, cnt);
    }
    Vec head_max(kNegInf);
    for (int64_t g = 0; g < G; ++g) {
      Vec acc(0.f);
      if constexpr (RC > 0) {
        for (int64_t k = 0; k < RC; ++k) acc = at::vec::fmadd(Vec(q[g * RC + k]), p[k], acc);
      } else {
        for (int64_t k = 0; k < R; ++k) acc = at::vec::fmadd(Vec(q[g * R + k]), Vec::loadu(P + k * Np + n0, cnt), acc);
      }
      acc = acc * Vec(sc) + vb;
      acc.store(E + g * Npad + n0);
      vmax[g] = at::vec::maximum(vmax[g], acc);
      head_max = at::vec::maximum(head_max, acc);
    }
    if (!mean_prob) head_max.store(out_scores + n0, cnt);
  }
}

}  // namespace

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
  const int64_t Np = proj_in.size(3), S = sel_in.size(2);
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
                lse_res.size(1) == H && lse_res.size(2) == G, "rcr::detector_pass: lse_res must be float32 (B, Hkv, G)");
  }
  at::Tensor lse_ev = at::empty({B, H, G}, qr.options());
  at::Tensor scores = at::empty({B, H, Np}, qr.options());

  const float* qd = qr.data_ptr<float>();
  const float* pd = proj.data_ptr<float>();
  const int64_t* sd = sel.data_ptr<int64_t>();
  const bool* vd = valid.defined() ? valid.data_ptr<bool>() : nullptr;
  const float* kd = kept.defined() ? kept.data_ptr<float>() : nullptr;
  const float* rd = lse_res.defined() ? lse_res.data_ptr<float>() : nullptr;
  float* lo = lse_ev.data_ptr<float>();
  float* so = scores.data_ptr<float>();
  const float sc = static_cast<float>(scaling);
  constexpr int64_t W = Vec::size();
  const int64_t Npad = (Np + W - 1) / W * W;  // scratch rows padded to whole vectors; the pad lanes are -inf

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> E(G * Npad);  // logits, then their exponentials: (G, Npad)
    std::vector<float> bias(Npad);   // 0 on valid entries, -inf on padding and pad lanes
    std::vector<float> evicted(Npad);  // 1 on evicted entries
    std::vector<float> m(G), s(G), kmax(G);
    std::vector<Vec> vmax(G);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H;
      const float* q = qd + bh * G * R;
      const float* P = pd + bh * R * Np;
      for (int64_t n = 0; n < Npad; ++n) bias[n] = (n < Np && (vd == nullptr || vd[b * Np + n])) ? 0.f : kNegInf;
      std::fill(evicted.begin(), evicted.end(), 0.f);
      std::fill(evicted.begin(), evicted.begin() + Np, 1.f);
      for (int64_t j = 0; j < S; ++j) {
        const int64_t n = sd[bh * S + j];
        TORCH_CHECK(n >= 0 && n < Np, "rcr::detector_pass: selection index ", n, " outside the prefix [0, ", Np, ")");
        evicted[n] = 0.f;
      }
      std::fill(vmax.begin(), vmax.end(), Vec(kNegInf));
      float* out_scores = so + bh * Np;

      // pass 1: the logits, their row maxima, and (max_logit) the max over the query heads
      switch (R) {  // the common ranks unrolled, with the block of P loaded once for all G query heads
        case 4: logits_pass<4>(q, P, R, G, Np, Npad, sc, bias.data(), E.data(), vmax.data(), out_scores, mean_prob); break;
        case 8: logits_pass<8>(q, P, R, G, Np, Npad, sc, bias.data(), E.data(), vmax.data(), out_scores, mean_prob); break;
        case 16: logits_pass<16>(q, P, R, G, Np, Npad, sc, bias.data(), E.data(), vmax.data(), out_scores, mean_prob); break;
        default: logits_pass<0>(q, P, R, G, Np, Npad, sc, bias.data(), E.data(), vmax.data(), out_scores, mean_prob);
      }
      // the kept entries' exact logits in place of their approximate ones (and in the max over the heads)
      std::fill(kmax.begin(), kmax.end(), kNegInf);
      if (kd != nullptr) {
        const float* kl = kd + bh * G * S;  // (G, S)
        for (int64_t j = 0; j < S; ++j) {
          const int64_t n = sd[bh * S + j];
          float head_max = kNegInf;
          for (int64_t g = 0; g < G; ++g) {
            const float v = kl[g * S + j] + bias[n];  // -inf where the kept entry is padding
            E[g * Npad + n] = v;
            kmax[g] = std::max(kmax[g], v);
            head_max = std::max(head_max, v);
          }
          if (!mean_prob) out_scores[n] = head_max;
        }
      }
      // pass 2: exponentials against each row's max, the row sums and the evicted sums
      for (int64_t g = 0; g < G; ++g) {
        float* e = E.data() + g * Npad;
        m[g] = std::max(hmax(vmax[g]), kmax[g]);
        if (m[g] == kNegInf) {  // no valid entry in this sample: nothing to normalise, nothing evicted
          std::fill(e, e + Npad, 0.f);
          s[g] = 0.f;
          lo[bh * G + g] = kNegInf;
          continue;
        }
        const Vec vm(m[g]);
        Vec vs(0.f), ve(0.f);
        for (int64_t n0 = 0; n0 < Npad; n0 += W) {
          const Vec x = (Vec::loadu(e + n0) - vm).exp();
          x.store(e + n0);
          vs = vs + x;
          ve = at::vec::fmadd(x, Vec::loadu(evicted.data() + n0), ve);
        }
        s[g] = hsum(vs);
        const float ev = hsum(ve);
        lo[bh * G + g] = ev > 0.f ? m[g] + std::log(ev) : kNegInf;
      }
      // pass 3 (mean_prob): the mean over the query heads of the normalised probabilities; s[g] becomes the factor
      // that takes exp(l - m) to them: 1 / (row sum), or exp(m - norm) with the context's normaliser
      // norm = logaddexp(lse_res, lse_ev)
      if (mean_prob) {
        for (int64_t g = 0; g < G; ++g) {
          if (rd == nullptr || s[g] == 0.f) {
            s[g] = s[g] > 0.f ? 1.f / s[g] : 0.f;
            continue;
          }
          const float a = rd[bh * G + g], b_ = lo[bh * G + g];
          const float hi = std::max(a, b_);
          const float norm = hi == kNegInf ? kNegInf : hi + std::log1p(std::exp(std::min(a, b_) - hi));
          s[g] = norm == kNegInf ? 0.f : std::exp(m[g] - norm);
        }
        const Vec vg(static_cast<float>(G));
        for (int64_t n0 = 0; n0 < Npad; n0 += W) {
          const int64_t cnt = std::min(W, Np - n0);
          Vec acc(0.f);
          for (int64_t g = 0; g < G; ++g) acc = acc + Vec::loadu(E.data() + g * Npad + n0) * Vec(s[g]);
          (acc / vg + Vec::loadu(bias.data() + n0)).store(out_scores + n0, cnt);
        }
      }
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
