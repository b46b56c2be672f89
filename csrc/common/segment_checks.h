// Argument checks of the float8 weight ops (segment_amax, float8_cast_segments), shared by the
// CPU and CUDA kernels so both reject bad input with one message.
#pragma once

#include <ATen/ATen.h>

#include "checks.h"

namespace megatron_fsdp {

// bounds holds [start, end) pairs of element offsets into flat, each inside it, in any order.
inline void check_segment_bounds(const at::Tensor& flat, at::IntArrayRef bounds, const char* op) {
  check_flat(flat, op);
  TORCH_CHECK(bounds.size() % 2 == 0, op, ": bounds must hold [start, end) pairs, got ",
              bounds.size(), " numbers");
  for (size_t i = 0; i < bounds.size(); i += 2) {
    TORCH_CHECK(0 <= bounds[i] && bounds[i] <= bounds[i + 1] && bounds[i + 1] <= flat.numel(), op,
                ": segment ", i / 2, " [", bounds[i], ", ", bounds[i + 1],
                ") does not lie in the flat buffer of ", flat.numel(), " elements");
  }
}

inline bool is_float8(at::ScalarType dtype) {
  return dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2;
}

inline void check_float8_cast(const at::Tensor& flat, at::IntArrayRef bounds,
                              const at::Tensor& scales, const at::Tensor& out) {
  constexpr const char* op = "float8_cast_segments";
  check_segment_bounds(flat, bounds, op);
  TORCH_CHECK(is_float8(out.scalar_type()), op, ": out must be float8_e4m3fn or float8_e5m2, got ",
              out.scalar_type());
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous() && out.numel() == flat.numel(), op,
              ": out must be contiguous 1-D of flat's ", flat.numel(), " elements, got shape ",
              out.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.is_contiguous(),
              op, ": scales must be a contiguous 1-D float32 tensor, got ", scales.scalar_type(),
              " of shape ", scales.sizes());
  TORCH_CHECK(scales.numel() * 2 == static_cast<int64_t>(bounds.size()), op, ": got ",
              scales.numel(), " scales for ", bounds.size() / 2, " segments");
  TORCH_CHECK(flat.device() == out.device() && flat.device() == scales.device(), op,
              ": flat, scales and out must be on one device, got ", flat.device(), ", ",
              scales.device(), " and ", out.device());
}

}  // namespace megatron_fsdp
