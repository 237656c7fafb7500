// rcr::detector_pass (detector_pass.cpp), also called directly by rcr::decide (decide.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

std::tuple<at::Tensor, at::Tensor> detector_pass(const at::Tensor& qr, const at::Tensor& projected_t,
                                                 const at::Tensor& selection, const std::optional<at::Tensor>& valid,
                                                 const std::optional<at::Tensor>& kept,
                                                 const std::optional<at::Tensor>& lse_res, double scaling,
                                                 bool mean_prob);
