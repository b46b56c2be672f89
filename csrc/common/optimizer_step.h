// Host side of the optimizer-step ops (adam_step_, sgd_step_), shared by the CPU and CUDA kernels:
// the argument checks (weights_out's included), so both reject bad input with one message before
// writing anything, and the fp32 constants every element is updated with. torch.optim computes
// its scalars as Python floats (double) and ATen rounds each to fp32 once; computing them here
// the same way lets the kernels follow torch.optim to the last bits.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "optimizer_constants.h"

namespace megatron_fsdp {

AdamConstants check_adam_args(const at::Tensor& param, const at::Tensor& grad,
                              const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                              const std::optional<at::Tensor>& max_exp_avg_sq, double lr,
                              double beta1, double beta2, double eps, double weight_decay,
                              int64_t step, bool decoupled_weight_decay, bool amsgrad,
                              bool maximize, const std::optional<at::Tensor>& weights_out);

SgdConstants check_sgd_args(const at::Tensor& param, const at::Tensor& grad,
                            const std::optional<at::Tensor>& momentum_buffer, double lr,
                            double momentum, double dampening, double weight_decay, bool nesterov,
                            bool maximize, bool first_step,
                            const std::optional<at::Tensor>& weights_out);

}  // namespace megatron_fsdp
