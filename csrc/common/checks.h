// Argument checks shared by the CPU and CUDA kernels, so both reject bad input with one message.
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

namespace megatron_fsdp {

// promoting_reduce sums in fp32, or in fp64 when the chunks or the output are fp64: float64 main
// gradients accumulated through fp32 would lose their precision at every micro-batch.
template <typename in_t, typename out_t>
using promoting_acc_t =
    std::conditional_t<std::is_same_v<in_t, double> || std::is_same_v<out_t, double>, double, float>;

inline bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
         dtype == at::kBFloat16;
}

inline void check_float(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(is_supported_float(t.scalar_type()), op, ": ", what,
              " must be float32, float64, float16 or bfloat16, got ", t.scalar_type());
}

inline void check_flat(const at::Tensor& flat, const char* op) {
  TORCH_CHECK(flat.dim() == 1, op, ": the flat buffer must be 1-D, got shape ", flat.sizes());
  TORCH_CHECK(flat.is_contiguous(), op, ": the flat buffer must be contiguous");
  check_float(flat, op, "the flat buffer");
}

// Each [offset, offset + numel) must lie inside the flat buffer.
inline void check_segments(const at::Tensor& flat, at::IntArrayRef offsets, at::TensorList tensors,
                           const char* op) {
  TORCH_CHECK(offsets.size() == tensors.size(), op, ": got ", tensors.size(), " tensors but ",
              offsets.size(), " offsets");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].device() == flat.device(), op, ": tensor ", i, " is on ",
                tensors[i].device(), " but the flat buffer is on ", flat.device());
    check_float(tensors[i], op, "every tensor");
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + tensors[i].numel() <= flat.numel(), op,
                ": tensor ", i, " (", tensors[i].numel(), " elements at offset ", offsets[i],
                ") does not fit in the flat buffer of ", flat.numel(), " elements");
  }
}

inline void check_promoting_reduce(const at::Tensor& chunks, const at::Tensor& out) {
  constexpr const char* op = "promoting_reduce";
  TORCH_CHECK(chunks.dim() == 2, op, ": chunks must be [world, n], got shape ", chunks.sizes());
  TORCH_CHECK(out.dim() == 1 && out.size(0) == chunks.size(1), op, ": out must be [n] = [",
              chunks.size(1), "], got shape ", out.sizes());
  TORCH_CHECK(chunks.is_contiguous() && out.is_contiguous(), op,
              ": chunks and out must be contiguous");
  TORCH_CHECK(chunks.device() == out.device(), op, ": chunks are on ", chunks.device(),
              " but out is on ", out.device());
  check_float(chunks, op, "chunks");
  check_float(out, op, "out");
}

inline void check_same_device(at::TensorList tensors, const char* op) {
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device() == tensors[0].device(), op, ": all tensors must be on one device, got ",
                tensors[0].device(), " and ", t.device());
    check_float(t, op, "every tensor");
  }
}

}  // namespace megatron_fsdp
