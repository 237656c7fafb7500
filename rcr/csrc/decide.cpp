// RCR's decode-time layer-step as one CPU op, rcr::decide, and the masked merge of a re-selection into the resident
// slots, rcr::merge_rows (rcr/fused.py; docs/algorithms.md, "The fused CPU kernels").
//
// rcr::decide is RCR.decide (rcr/methods/rcr.py) with the resident reader, then the threshold update, the telemetry
// record and the merge. Per (sample, KV head): the exact logits over the resident slots (their log-sum-exp, and the
// kept entries' logits for the candidate ranking) and the detector pass (detector_pass.cpp), the candidate scores
// while its exponentials are in cache; then the drift and the trigger; then, only for the rows that fired, the top C,
// the candidates' exact re-scoring, the top S and the row copies of the merge. A row that did not fire keeps its
// selection and is not re-scored: the torch path computes a selection for it and its masked merge discards it. The
// top-k sets are found by a threshold, which is at::topk's set wherever the k-th value is not tied; where it is,
// at::topk chooses, as in the torch path. The rounding differs from the torch path (sums in another order, another
// exponential) but not the decisions (tests/rcr/test_rcr_reference.py, tests/rcr/test_rcr_decision.py). tau is
// multiplied by factors that the torch path's own ops computed (RCR.tau_factors), so it is the same to the bit.
//
// rcr::merge_rows is ResidentLayer.refresh (rcr/cache.py) without its temporaries, for a decision made elsewhere: where
// the trigger is set, slots [0, S) of a (sample, KV head) become copies of the selected prefix rows.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "detector_pass.h"
#include "kernels.h"

using namespace rcr_kernels;

namespace {

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "rcr::decide/merge_rows: ", name, " must be a CPU tensor");
}

// x (B, H, N, d) with contiguous rows (a slice along N of a contiguous tensor is fine)
at::Tensor rows_contiguous(const at::Tensor& x) {
  return (x.stride(3) == 1 && x.stride(2) == x.size(3)) ? x : x.contiguous();
}

// One (sample, KV head) row of the resident layer and its prefix store: where the merge copies to and from
struct MergeRow {
  char *keys, *values;  // slot 0 of the resident buffers
  bool* slot_valid;
  int64_t* selection;
  const char *prefix_keys, *prefix_values;  // prefix entry 0
  const bool* prefix_valid;                 // (Np) or nullptr: no padding
  int64_t key_row, value_row, Np;           // bytes per row
};

void merge_row(const MergeRow& r, const int64_t* sel, int64_t S) {
  for (int64_t j = 0; j < S; ++j) {  // the rows' addresses are all known: every read in flight at once
    if (sel[j] < 0 || sel[j] >= r.Np) continue;
    prefetch_row(r.prefix_keys + sel[j] * r.key_row, r.key_row);
    prefetch_row(r.prefix_values + sel[j] * r.value_row, r.value_row);
  }
  for (int64_t j = 0; j < S; ++j) {
    const int64_t n = sel[j];
    TORCH_CHECK(n >= 0 && n < r.Np, "rcr::merge_rows: selection index ", n, " outside the prefix [0, ", r.Np, ")");
    std::memcpy(r.keys + j * r.key_row, r.prefix_keys + n * r.key_row, r.key_row);
    std::memcpy(r.values + j * r.value_row, r.prefix_values + n * r.value_row, r.value_row);
    if (r.prefix_valid != nullptr) r.slot_valid[j] = r.prefix_valid[n];
    r.selection[j] = n;
  }
}

// lg (G, n) = sc * q (G, d) . rows (n, d) of a key tensor of type T, -inf where ok[j] is false (ok nullptr: all valid);
// row j at keys + idx[j] * d (idx nullptr: j)
template <typename T>
void logits_rows(const float* q, int64_t G, int64_t d, const T* keys, const int64_t* idx, int64_t n, const bool* ok,
                 float sc, float* lg) {
  float* out = scratch<float, 30>(G + d);
  // rows are asked for 8 ahead of the one being read: scattered ones (idx) the hardware cannot guess, and even
  // consecutive ones arrive sooner from memory than by its prefetcher alone
  constexpr int64_t ahead = 8;
  auto row_of = [&](int64_t j) { return idx != nullptr ? idx[j] : j; };
  for (int64_t j = 0; j < std::min(ahead, n); ++j) prefetch_row(keys + row_of(j) * d, d * sizeof(T));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = row_of(j);
    if (j + ahead < n) prefetch_row(keys + row_of(j + ahead) * d, d * sizeof(T));
    if (ok != nullptr && !ok[row]) {
      for (int64_t g = 0; g < G; ++g) lg[g * n + j] = kNegInf;
      continue;
    }
    key_dots(q, G, d, row_as_float(keys + row * d, d, out + G), sc, out);
    for (int64_t g = 0; g < G; ++g) lg[g * n + j] = out[g];
  }
}

// The candidates' exact scores (C) from their exact logits lg (G, C): mean_prob, the mean over G of each head's
// probability (its softmax over the candidates, or with norm (G) exp(logit - norm[g]); a -inf normaliser counts 0),
// or max_logit; -inf where a candidate is padding (its logits are -inf)
void exact_scores(const float* lg, int64_t G, int64_t C, bool mean_prob, const float* norm, float* exact) {
  if (!mean_prob) {
    std::fill(exact, exact + C, kNegInf);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < C; ++c) exact[c] = std::max(exact[c], lg[g * C + c]);
    return;
  }
  std::fill(exact, exact + C, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    const float lse = norm != nullptr ? norm[g] : logsumexp(lg + g * C, C);
    if (lse == kNegInf) continue;
    for (int64_t c = 0; c < C; c += kW) {
      const int64_t cnt = std::min(kW, C - c);
      (Vec::loadu(exact + c, cnt) + vexp(Vec::loadu(lg + g * C + c, cnt) - Vec(lse))).store(exact + c, cnt);
    }
  }
  for (int64_t c = 0; c < C; ++c) exact[c] /= static_cast<float>(G);
}

}  // namespace

// In place: the resident layer (keys, values, slot_valid, selection) where the trigger fired, tau (with tau_factors,
// (Hkv + 1, B): the rate controller's factor when k KV heads refreshed) and, when given, the telemetry's decisions
// (F, B, L, T) at (layer, t).
// -> trigger ((B,) bool, or (B, Hkv) with per_head), drift ((B,) fp32), tau ((B,) fp32, this step's threshold, before
// the update), selection ((B, Hkv, S) int64, ascending: the new selection where the trigger fired, the current one
// elsewhere)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> decide(
    const at::Tensor& query, const at::Tensor& basis_in, const at::Tensor& projected_t, const at::Tensor& keys,
    const at::Tensor& values, const at::Tensor& slot_valid, const at::Tensor& selection, int64_t n_stored,
    bool slots_masked, const std::optional<at::Tensor>& valid, const at::Tensor& prefix_keys_in,
    const at::Tensor& prefix_values_in, const at::Tensor& tau, const std::optional<at::Tensor>& tau_factors,
    double scaling, bool mean_prob, bool per_head, int64_t n_candidates, bool kept_exact, bool context_norm,
    const std::optional<at::Tensor>& decisions, int64_t layer, int64_t t, const at::Tensor& detector_dots) {
  for (const auto* x : {&query, &keys, &values, &prefix_keys_in, &prefix_values_in, &tau, &projected_t})
    check_cpu(*x, "every tensor");
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1 && basis_in.dim() == 4 && query.size(1) % basis_in.size(1) == 0,
              "rcr::decide: query must be (B, Hq, 1, d), Hq a multiple of the basis' Hkv");
  TORCH_CHECK(keys.dim() == 4 && prefix_keys_in.dim() == 4 && projected_t.dim() == 4,
              "rcr::decide: keys, prefix_keys and projected_t must be 4-d");
  // query head j belongs to KV head j // G (transformers' repeat_kv convention): (B, Hq, 1, d) is (B, Hkv, G, d)
  const int64_t B = query.size(0), H = basis_in.size(1), G = query.size(1) / H, d = query.size(3);
  const int64_t Np = projected_t.size(-1), R = basis_in.size(-1), S = selection.size(2), cap = keys.size(2);
  const int64_t C = std::min(n_candidates, Np), Npad = padded_length(Np), n = n_stored;
  TORCH_CHECK(prefix_keys_in.size(0) == B && prefix_keys_in.size(1) == H && prefix_keys_in.size(2) == Np &&
              prefix_keys_in.size(3) == d && prefix_values_in.sizes() == prefix_keys_in.sizes(),
              "rcr::decide: prefix_keys must be (B, Hkv, Np, d) for the detector's Np = ", Np);
  TORCH_CHECK(keys.size(0) == B && keys.size(1) == H && keys.size(3) == d && values.sizes() == keys.sizes() &&
              keys.scalar_type() == prefix_keys_in.scalar_type() &&
              values.scalar_type() == prefix_values_in.scalar_type() && keys.is_contiguous() && values.is_contiguous(),
              "rcr::decide: keys must be contiguous (B, Hkv, cap, d), of prefix_keys' dtype");
  TORCH_CHECK(slot_valid.scalar_type() == at::kBool && slot_valid.is_contiguous() &&
              slot_valid.sizes() == at::IntArrayRef({B, H, cap}) && selection.scalar_type() == at::kLong &&
              selection.is_contiguous() && selection.size(0) == B && selection.size(1) == H,
              "rcr::decide: slot_valid must be bool (B, Hkv, cap), selection int64 (B, Hkv, S)");
  TORCH_CHECK(basis_in.scalar_type() == at::kFloat && basis_in.size(0) == B && basis_in.size(2) == d,
              "rcr::decide: basis must be float32 (B, Hkv, d, r)");
  TORCH_CHECK(projected_t.scalar_type() == at::kFloat && projected_t.size(0) == B && projected_t.size(1) == H &&
              projected_t.size(2) == R, "rcr::decide: projected_t must be float32 (B, Hkv, r, Np)");
  TORCH_CHECK(tau.dim() == 1 && tau.size(0) == B && tau.scalar_type() == at::kFloat,
              "rcr::decide: tau must be float32 (B,)");
  TORCH_CHECK(!tau_factors.has_value() || (tau_factors->scalar_type() == at::kFloat && tau_factors->is_contiguous() &&
                                           tau_factors->dim() == 2 && tau_factors->size(0) == H + 1 &&
                                           tau_factors->size(1) == B),
              "rcr::decide: tau_factors must be float32 (Hkv + 1, B)");
  TORCH_CHECK(S <= C && (!kept_exact || S <= n) && n <= cap, "rcr::decide: the resident slots must hold the S kept "
              "entries, and S <= the candidates");
  at::Tensor pv;
  if (valid.has_value()) {
    pv = valid->stride(1) == 1 ? *valid : valid->contiguous();  // (B, Np), a slice of (B, N)
    TORCH_CHECK(pv.scalar_type() == at::kBool && pv.dim() == 2 && pv.size(0) == B && pv.size(1) == Np,
                "rcr::decide: valid must be bool (B, Np)");
  }
  at::Tensor dec;
  if (decisions.has_value()) {
    dec = *decisions;
    TORCH_CHECK(dec.scalar_type() == at::kFloat && dec.is_contiguous() && dec.dim() == 4 && dec.size(0) >= 6 &&
                dec.size(1) == B && layer < dec.size(2) && t < dec.size(3) && detector_dots.numel() == B &&
                detector_dots.scalar_type() == at::kFloat,
                "rcr::decide: decisions must be the telemetry's float32 (F >= 6, B, L, T)");
  }
  const at::Tensor q =
      query.scalar_type() == at::kFloat && query.is_contiguous() ? query : query.to(at::kFloat).contiguous();
  const at::Tensor basis = basis_in.contiguous();
  const at::Tensor proj = projected_t.contiguous(), sel_cur = selection;
  const at::Tensor kp = rows_contiguous(prefix_keys_in), vp = rows_contiguous(prefix_values_in);
  const float sc = static_cast<float>(scaling);
  const bool context = mean_prob && context_norm;
  const float* qd = q.data_ptr<float>();
  const int64_t* cur = sel_cur.data_ptr<int64_t>();
  for (int64_t i = 0; i < sel_cur.numel(); ++i)
    TORCH_CHECK(cur[i] >= 0 && cur[i] < Np, "rcr::decide: selection index ", cur[i], " outside the prefix [0, ", Np,
                ")");

  // the step's own results, per (sample, KV head): lse_res and lse_ev (B·H, G), the candidate scores (B·H, Np);
  // bias (B, Npad) 0 on valid prefix entries, -inf on padding and past Np
  const int64_t BH = B * H;
  float* lse_res = scratch<float, 41>(BH * G);
  float* lse_ev = scratch<float, 42>(BH * G);
  float* scores = scratch<float, 47>(BH * Np);
  float* bias = pv.defined() ? scratch<float, 48>(B * Npad) : nullptr;
  if (bias != nullptr)
    for (int64_t b = 0; b < B; ++b) {
      const bool* ok = pv.data_ptr<bool>() + b * pv.stride(0);
      for (int64_t i = 0; i < Npad; ++i) bias[b * Npad + i] = (i < Np && ok[i]) ? 0.f : kNegInf;
    }

  // 1. per (sample, KV head): qr = q @ basis; the exact logits over the n resident slots, their log-sum-exp and the
  // kept entries' (slots [0, S)); the detector pass: the evicted log-sum-exp and the candidate scores. The scores are
  // only used where the trigger fires, but the pass's exponentials are still in cache here (one head's, G x Np),
  // and another pass over them costs less than keeping them for every head until the trigger is known.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "rcr::decide", [&] {
    at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
      float* qr = scratch<float, 40>(G * R);
      float* kept = scratch<float, 43>(G * S);
      const HeadScratch hs{scratch<float, 44>(G * Npad), scratch<float, 45>(G * S), scratch<float, 46>(G),
                           scratch<float, 35>(G)};
      for (int64_t bh = begin; bh < end; ++bh) {
        const float* U = basis.data_ptr<float>() + bh * d * R;  // (d, R)
        float* Ut = scratch<float, 34>(R * d + G);  // (R, d): a basis vector per row, as key_dots reads them
        for (int64_t i = 0; i < d; ++i)
          for (int64_t k = 0; k < R; ++k) Ut[k * d + i] = U[i * R + k];
        for (int64_t k = 0; k < R; ++k) {
          float* col = Ut + R * d;  // qr[:, k] of the G query heads
          key_dots(qd + bh * G * d, G, d, Ut + k * d, 1.f, col);
          for (int64_t g = 0; g < G; ++g) qr[g * R + k] = col[g];
        }
        float* lg = scratch<float, 31>(G * n);
        logits_rows<scalar_t>(qd + bh * G * d, G, d, keys.data_ptr<scalar_t>() + bh * cap * d, nullptr, n,
                              slots_masked ? slot_valid.data_ptr<bool>() + bh * cap : nullptr, sc, lg);
        for (int64_t g = 0; g < G; ++g) {
          lse_res[bh * G + g] = logsumexp(lg + g * n, n);
          if (kept_exact) std::copy(lg + g * n, lg + g * n + S, kept + g * S);
        }
        const DetectorHead h{qr, proj.data_ptr<float>() + bh * R * Np, cur + bh * S, kept_exact ? kept : nullptr,
                             bias != nullptr ? bias + (bh / H) * Npad : nullptr, G, R, Np, S, sc};
        detector_phase_a(h, hs, lse_ev + bh * G, mean_prob ? nullptr : scores + bh * Np);
        if (mean_prob)
          detector_phase_b(h, hs, lse_ev + bh * G, context ? lse_res + bh * G : nullptr, scores + bh * Np);
      }
    });
  });

  // 2. drift = sigmoid(lse_ev - lse_res), mean over G (per KV head), then over the KV heads; the trigger; f, the
  // refresh indicator (or the fraction of KV heads) the rate controller takes
  at::Tensor drift = at::empty({B}, q.options());
  float* fd = scratch<float, 49>(B);
  at::Tensor trigger =
      at::empty(per_head ? std::vector<int64_t>{B, H} : std::vector<int64_t>{B}, q.options().dtype(at::kBool));
  at::Tensor tau_before = at::empty({B}, q.options());
  float* td = tau_before.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) td[b] = tau.data_ptr<float>()[b * tau.stride(0)];
  float* dd = drift.data_ptr<float>();
  bool* tr = trigger.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    float sum_h = 0.f, fired = 0.f;
    for (int64_t h = 0; h < H; ++h) {
      float sum_g = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = (b * H + h) * G + g;
        sum_g += 1.f / (1.f + std::exp(lse_res[i] - lse_ev[i]));  // sigmoid(lse_ev - lse_res); NaN when both are -inf
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
  // 3. the rate controller: tau * exp(step * (f - rho)), the factor for f = k / H being row k of tau_factors, which
  // the torch ops of RateController.update computed (RCR.tau_factors)
  if (tau_factors.has_value()) {
    const float* law = tau_factors->data_ptr<float>();
    float* tw = tau.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      int64_t k = 0;
      for (int64_t h = 0; h < H; ++h) k += tr[per_head ? b * H + h : b];
      tw[b * tau.stride(0)] = td[b] * law[k * B + b];  // per layer, k is 0 or H
    }
  }
  if (dec.defined()) {  // Telemetry.record_decision: drift, tau, trigger fraction, keys and values read, detector
    // dots (FIELDS_FLOAT's first six); the fields after them (a page cache's recalls) are NaN: RCR has none
    const int64_t F = dec.size(0), L = dec.size(2), T = dec.size(3);
    const float* dots = detector_dots.data_ptr<float>();
    float* out = dec.data_ptr<float>() + layer * T + t;
    for (int64_t b = 0; b < B; ++b) {
      const float row[6] = {dd[b], td[b], fd[b], fd[b] * static_cast<float>(C), fd[b] * static_cast<float>(S),
                            dots[b * detector_dots.stride(0)]};
      for (int64_t fld = 0; fld < F; ++fld)
        out[(fld * B + b) * L * T] = fld < 6 ? row[fld] : std::numeric_limits<float>::quiet_NaN();
    }
  }

  // 4. where the trigger fired: the candidate scores, the top C of the prefix ranking, their exact scores (with the
  // context's normaliser logaddexp(lse_res, lse_ev) per query head), the top S, and the merge
  at::Tensor sel = at::empty({B, H, S}, selection.options());
  int64_t* so = sel.data_ptr<int64_t>();
  const MergeRow base{static_cast<char*>(keys.data_ptr()), static_cast<char*>(values.data_ptr()),
                      slot_valid.data_ptr<bool>(), selection.data_ptr<int64_t>(),
                      static_cast<const char*>(kp.data_ptr()), static_cast<const char*>(vp.data_ptr()),
                      nullptr, d * keys.element_size(), d * values.element_size(), Np};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "rcr::decide", [&] {
    at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
      int64_t* cand = scratch<int64_t, 32>(C + S);
      int64_t* top = cand + C;
      float* lg = scratch<float, 33>(G * C + C + G);
      float* exact = lg + G * C;
      float* norm = exact + C;
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        if (!tr[per_head ? bh : b]) {
          std::copy(cur + bh * S, cur + (bh + 1) * S, so + bh * S);
          continue;
        }
        const float* sc_bh = scores + bh * Np;
        if (C == Np) {
          for (int64_t i = 0; i < Np; ++i) cand[i] = i;
        } else {
          top_sorted(sc_bh, Np, C, cand);
        }
        const bool* pvb = pv.defined() ? pv.data_ptr<bool>() + b * pv.stride(0) : nullptr;
        const scalar_t* kpr = static_cast<const scalar_t*>(kp.data_ptr()) + b * kp.stride(0) + h * kp.stride(1);
        logits_rows<scalar_t>(qd + bh * G * d, G, d, kpr, cand, C, pvb, sc, lg);
        if (context)
          for (int64_t g = 0; g < G; ++g) norm[g] = logaddexp(lse_res[bh * G + g], lse_ev[bh * G + g]);
        exact_scores(lg, G, C, mean_prob, context ? norm : nullptr, exact);
        if (pvb != nullptr)
          for (int64_t c = 0; c < C; ++c)
            if (!pvb[cand[c]]) exact[c] = kNegInf;
        top_sorted(exact, C, S, top);
        for (int64_t j = 0; j < S; ++j) so[bh * S + j] = cand[top[j]];  // ascending: cand and top are
        MergeRow r = base;
        r.keys += bh * cap * r.key_row;
        r.values += bh * cap * r.value_row;
        r.slot_valid += bh * cap;
        r.selection += bh * S;
        r.prefix_keys += (b * kp.stride(0) + h * kp.stride(1)) * kp.element_size();
        r.prefix_values += (b * vp.stride(0) + h * vp.stride(1)) * vp.element_size();
        r.prefix_valid = pvb;
        merge_row(r, so + bh * S, S);
      }
    });
  });
  return {trigger, drift, tau_before, sel};
}

// In place, where trigger ((B,) or (B, Hkv) bool) is set: keys/values[b, h, :S] = prefix rows new_selection[b, h],
// selection[b, h] = new_selection[b, h] and, with prefix_valid (left padding), slot_valid[b, h, :S] = their validity.
void merge_rows(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slot_valid,
                const at::Tensor& selection, const at::Tensor& trigger_in, const at::Tensor& new_selection_in,
                const at::Tensor& prefix_keys_in, const at::Tensor& prefix_values_in,
                const std::optional<at::Tensor>& prefix_valid) {
  for (const auto* x : {&keys, &values, &prefix_keys_in, &prefix_values_in}) check_cpu(*x, "every tensor");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && slot_valid.is_contiguous() && selection.is_contiguous(),
              "rcr::merge_rows: the resident buffers must be contiguous");
  TORCH_CHECK(keys.scalar_type() == prefix_keys_in.scalar_type() &&
                  values.scalar_type() == prefix_values_in.scalar_type(),
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
  TORCH_CHECK(trig.size(0) == B && (!per_head || trig.size(1) == H),
              "rcr::merge_rows: trigger must be (B,) or (B, Hkv)");
  at::Tensor pv;
  if (prefix_valid.has_value()) {
    pv = prefix_valid->stride(1) == 1 ? *prefix_valid : prefix_valid->contiguous();  // (B, Np), a slice of (B, N)
    TORCH_CHECK(pv.scalar_type() == at::kBool && pv.size(0) == B && pv.size(1) == Np,
                "rcr::merge_rows: prefix_valid must be bool (B, Np)");
  }
  const bool* td = trig.data_ptr<bool>();
  const int64_t* ns = sel.data_ptr<int64_t>();
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    if (!td[per_head ? bh : b]) continue;
    const int64_t kp_off = (b * k_p.stride(0) + h * k_p.stride(1)) * k_p.element_size();
    const int64_t vp_off = (b * v_p.stride(0) + h * v_p.stride(1)) * v_p.element_size();
    const MergeRow r{static_cast<char*>(keys.data_ptr()) + bh * cap * d * keys.element_size(),
                     static_cast<char*>(values.data_ptr()) + bh * cap * d * values.element_size(),
                     slot_valid.data_ptr<bool>() + bh * cap, selection.data_ptr<int64_t>() + bh * S,
                     static_cast<const char*>(k_p.data_ptr()) + kp_off,
                     static_cast<const char*>(v_p.data_ptr()) + vp_off,
                     pv.defined() ? pv.data_ptr<bool>() + b * pv.stride(0) : nullptr,
                     d * keys.element_size(), d * values.element_size(), Np};
    merge_row(r, ns + bh * S, S);
  }
}

TORCH_LIBRARY_FRAGMENT(rcr, m) {
  m.def("decide(Tensor query, Tensor basis, Tensor projected_t, Tensor(a!) keys, Tensor(b!) values, "
        "Tensor(c!) slot_valid, Tensor(d!) selection, int n_stored, bool slots_masked, Tensor? valid, "
        "Tensor prefix_keys, Tensor prefix_values, Tensor(e!) tau, Tensor? tau_factors, float scaling, "
        "bool mean_prob, bool per_head, int n_candidates, bool kept_exact, bool context_norm, Tensor(f!)? decisions, "
        "int layer, int t, Tensor detector_dots) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("merge_rows(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) slot_valid, Tensor(d!) selection, Tensor trigger, "
        "Tensor new_selection, Tensor prefix_keys, Tensor prefix_values, Tensor? prefix_valid) -> ()");
}

TORCH_LIBRARY_IMPL(rcr, CPU, m) {
  m.impl("decide", &decide);
  m.impl("merge_rows", &merge_rows);
}
