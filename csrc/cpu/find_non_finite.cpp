// One flag per tensor: does it hold a NaN or an Inf.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>

#include "../common/checks.h"

namespace megatron_fsdp {
namespace {

at::Tensor find_non_finite_cpu(at::TensorList tensors) {
  check_same_device(tensors, "find_non_finite");
  auto flags = at::zeros({static_cast<int64_t>(tensors.size())}, at::kBool);
  bool* flag = flags.mutable_data_ptr<bool>();
  for (size_t t = 0; t < tensors.size(); ++t) {
    const at::Tensor src = tensors[t].contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "find_non_finite", [&] {
      const scalar_t* data = src.const_data_ptr<scalar_t>();
      std::atomic<bool> found{false};
      at::parallel_for(0, src.numel(), 32768, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end && !found.load(std::memory_order_relaxed); ++i) {
          if (!std::isfinite(static_cast<double>(data[i]))) {
            found.store(true, std::memory_order_relaxed);
          }
        }
      });
      flag[t] = found.load();
    });
  }
  return flags;
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CPU, m) {
  m.impl("find_non_finite", &megatron_fsdp::find_non_finite_cpu);
}
