// Adam/AdamW and SGD steps over flat fp32 buffers on the host: the optimizer of CPU offloading.
// The element loops live in optimizer_step_vec.h; this file builds them for ATen's default
// capability, picks the AVX2 build where ATen itself runs AVX2 or AVX512 kernels (so
// multiply-adds are fused exactly where torch.optim's are), and spreads the elements over
// threads with at::parallel_for.
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <string>

#include "../common/optimizer_step.h"
#include "optimizer_step_vec.h"

namespace megatron_fsdp {

void adam_range_default(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_range(c, b, begin, end);
}

void sgd_range_default(const SgdConstants& c, const SgdBuffers& b, int64_t begin, int64_t end) {
  sgd_range(c, b, begin, end);
}

namespace {

// Elements per parallel task: megabytes of traffic, far more than a task costs to start.
constexpr int64_t kGrain = 1 << 16;

using AdamRange = void (*)(const AdamConstants&, const AdamBuffers&, int64_t, int64_t);
using SgdRange = void (*)(const SgdConstants&, const SgdBuffers&, int64_t, int64_t);

struct Loops {
  AdamRange adam;
  SgdRange sgd;
};

// The AVX2 loops where ATen runs its AVX2 or AVX512 kernels (torch.backends.cpu's capability,
// which ATEN_CPU_CAPABILITY may lower) and the CPU has the FMA and F16C they also use.
const Loops& loops() {
  static const Loops chosen = [] {
#if MEGATRON_FSDP_AVX2_LOOPS
    const std::string capability = at::get_cpu_capability();
    if ((capability == "AVX2" || capability == "AVX512") && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      return Loops{adam_range_avx2, sgd_range_avx2};
    }
#endif
    return Loops{adam_range_default, sgd_range_default};
  }();
  return chosen;
}

void adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                   double lr, double beta1, double beta2, double eps, double weight_decay,
                   int64_t step, bool decoupled_weight_decay, bool amsgrad, bool maximize,
                   const std::optional<at::Tensor>& weights_out) {
  const AdamConstants c =
      check_adam_args(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lr, beta1, beta2, eps,
                      weight_decay, step, decoupled_weight_decay, amsgrad, maximize, weights_out);
  const AdamBuffers b{param.mutable_data_ptr<float>(),
                      grad.const_data_ptr(),
                      grad.scalar_type(),
                      exp_avg.mutable_data_ptr<float>(),
                      exp_avg_sq.mutable_data_ptr<float>(),
                      amsgrad ? max_exp_avg_sq->mutable_data_ptr<float>() : nullptr,
                      weights_out ? weights_out->mutable_data_ptr() : nullptr,
                      weights_out ? weights_out->scalar_type() : at::kFloat};
  const AdamRange range = loops().adam;
  at::parallel_for(0, param.numel(), kGrain,
                   [&](int64_t begin, int64_t end) { range(c, b, begin, end); });
}

void sgd_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                  const std::optional<at::Tensor>& momentum_buffer, double lr, double momentum,
                  double dampening, double weight_decay, bool nesterov, bool maximize,
                  bool first_step, const std::optional<at::Tensor>& weights_out) {
  const SgdConstants c = check_sgd_args(param, grad, momentum_buffer, lr, momentum, dampening,
                                        weight_decay, nesterov, maximize, first_step, weights_out);
  const SgdBuffers b{param.mutable_data_ptr<float>(),
                     grad.const_data_ptr(),
                     grad.scalar_type(),
                     c.momentum ? momentum_buffer->mutable_data_ptr<float>() : nullptr,
                     weights_out ? weights_out->mutable_data_ptr() : nullptr,
                     weights_out ? weights_out->scalar_type() : at::kFloat};
  const SgdRange range = loops().sgd;
  at::parallel_for(0, param.numel(), kGrain,
                   [&](int64_t begin, int64_t end) { range(c, b, begin, end); });
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CPU, m) {
  m.impl("adam_step_", &megatron_fsdp::adam_step_cpu);
  m.impl("sgd_step_", &megatron_fsdp::sgd_step_cpu);
}
