// The detector pass of one (sample, KV head), in two phases (detector_pass.cpp), shared by rcr::detector_pass and
// rcr::decide (decide.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace rcr_kernels {

struct DetectorHead {
  const float* qr;     // (G, R) the rank-r query projections of the KV head's G query heads
  const float* P;      // (R, Np) the projected prefix keys, K~^T
  const int64_t* sel;  // (S) the kept (resident) prefix entries, distinct
  const float* kept;   // (G, S) their exact logits, which stand in for their approximate ones; nullptr: approximate
  const float* bias;   // (Npad) 0 on valid entries, -inf on padding and past Np; nullptr: no padding
  int64_t G, R, Np, S;
  float sc;
};

// What phase A leaves for phase B, per head: E (G, Npad) the exponentials exp(l - m) of the approximate logits
// (0 at the kept entries), K (G, S) the kept entries' logits, m (G) each row's maximum logit, ev (G) the sum of E's row
struct HeadScratch {
  float* E;
  float* K;
  float* m;
  float* ev;
};

// Npad: Np rounded up to whole vectors, the row stride of E
int64_t padded_length(int64_t Np);

// Phase A: the logits, their row maxima and exponentials, and lse_ev (G), the log-sum-exp over the evicted valid
// entries (-inf where there are none). max_scores (Np) or nullptr: the max over the G query heads of the logits, the
// kept entries' by their exact logits (-inf on padding), the max_logit candidate scores.
void detector_phase_a(const DetectorHead& h, const HeadScratch& s, float* lse_ev, float* max_scores);

// Phase B, for mean_prob: scores (Np), the mean over G of each query head's probabilities, normalised by the row's
// softmax, or with lse_res (G) by the context's estimate logaddexp(lse_res, lse_ev); -inf on padding. E's kept
// entries are filled in (their exponentials).
void detector_phase_b(const DetectorHead& h, const HeadScratch& s, const float* lse_ev, const float* lse_res,
                      float* scores);

}  // namespace rcr_kernels
