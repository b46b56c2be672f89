// Sums [world, n] low-precision chunks in fp32 (fp64 when the chunks or the output are fp64) and
// writes or accumulates the scaled result into an output of another dtype.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/checks.h"

namespace megatron_fsdp {
namespace {

void promoting_reduce_cpu(const at::Tensor& chunks, double scale, bool accumulate,
                          const at::Tensor& out) {
  check_promoting_reduce(chunks, out);
  const int64_t world = chunks.size(0);
  const int64_t n = chunks.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, chunks.scalar_type(), "promoting_reduce_in", [&] {
    using in_t = scalar_t;
    const in_t* in = chunks.const_data_ptr<in_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "promoting_reduce_out", [&] {
      using acc_t = promoting_acc_t<in_t, scalar_t>;
      scalar_t* dst = out.mutable_data_ptr<scalar_t>();
      const acc_t factor = static_cast<acc_t>(scale);
      at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          acc_t sum = 0;
          for (int64_t r = 0; r < world; ++r) sum += static_cast<acc_t>(in[r * n + i]);
          sum *= factor;
          if (accumulate) sum += static_cast<acc_t>(dst[i]);
          dst[i] = static_cast<scalar_t>(sum);
        }
      });
    });
  });
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CPU, m) {
  m.impl("promoting_reduce", &megatron_fsdp::promoting_reduce_cpu);
}
