// Copies between a list of tensors and one flat buffer, casting on the way.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/checks.h"

namespace megatron_fsdp {
namespace {

constexpr int64_t kGrain = 32768;

template <typename Src, typename Dst>
void cast_copy(const Src* src, Dst* dst, int64_t numel) {
  at::parallel_for(0, numel, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = static_cast<Dst>(static_cast<float>(src[i]));
  });
}

template <>
void cast_copy<double, double>(const double* src, double* dst, int64_t numel) {
  at::parallel_for(0, numel, kGrain, [&](int64_t begin, int64_t end) {
    std::copy(src + begin, src + end, dst + begin);
  });
}

// Copies `numel` elements between raw buffers of any two supported dtypes.
void copy_cast(const at::Tensor& src, int64_t src_offset, const at::Tensor& dst,
               int64_t dst_offset, int64_t numel) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "copy_cast_src", [&] {
    using src_t = scalar_t;
    const src_t* src_ptr = src.const_data_ptr<src_t>() + src_offset;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst.scalar_type(), "copy_cast_dst", [&] {
      scalar_t* dst_ptr = dst.mutable_data_ptr<scalar_t>() + dst_offset;
      if constexpr (std::is_same_v<src_t, double> || std::is_same_v<scalar_t, double>) {
        // fp64 on either side: go through double so no precision is lost on the way.
        at::parallel_for(0, numel, kGrain, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i)
            dst_ptr[i] = static_cast<scalar_t>(static_cast<double>(src_ptr[i]));
        });
      } else {
        cast_copy(src_ptr, dst_ptr, numel);
      }
    });
  });
}

void flatten_copy_cpu(at::TensorList srcs, at::IntArrayRef offsets, const at::Tensor& flat) {
  check_flat(flat, "flatten_copy");
  check_segments(flat, offsets, srcs, "flatten_copy");
  for (size_t i = 0; i < srcs.size(); ++i) {
    copy_cast(srcs[i].contiguous(), 0, flat, offsets[i], srcs[i].numel());
  }
}

void unflatten_copy_cpu(const at::Tensor& flat, at::IntArrayRef offsets, at::TensorList dsts) {
  check_flat(flat, "unflatten_copy");
  check_segments(flat, offsets, dsts, "unflatten_copy");
  for (size_t i = 0; i < dsts.size(); ++i) {
    TORCH_CHECK(dsts[i].is_contiguous(), "unflatten_copy: destination ", i, " must be contiguous");
    copy_cast(flat, offsets[i], dsts[i], 0, dsts[i].numel());
  }
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CPU, m) {
  m.impl("flatten_copy", &megatron_fsdp::flatten_copy_cpu);
  m.impl("unflatten_copy", &megatron_fsdp::unflatten_copy_cpu);
}
