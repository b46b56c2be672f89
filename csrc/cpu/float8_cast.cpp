// The float8 weight ops on the host: per-segment amax of a flat buffer, and its cast to float8
// with one scale per segment, saturating as torchao's weight cast does.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "../common/segment_checks.h"

namespace megatron_fsdp {
namespace {

constexpr int64_t kGrain = 32768;

// max(|x|) with a NaN winning, so a non-finite weight shows in its amax.
inline float amax_step(float running, float value) {
  const float magnitude = std::fabs(value);
  return (std::isnan(magnitude) || magnitude > running) ? magnitude : running;
}

at::Tensor segment_amax_cpu(const at::Tensor& flat, at::IntArrayRef bounds) {
  check_segment_bounds(flat, bounds, "segment_amax");
  const int64_t segments = static_cast<int64_t>(bounds.size() / 2);
  auto amax = at::zeros({segments}, at::kFloat);
  float* result = amax.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "segment_amax", [&] {
    const scalar_t* data = flat.const_data_ptr<scalar_t>();
    for (int64_t s = 0; s < segments; ++s) {
      const int64_t start = bounds[2 * s];
      const int64_t end = bounds[2 * s + 1];
      result[s] = at::parallel_reduce(
          start, end, kGrain, 0.0f,
          [&](int64_t begin, int64_t stop, float running) {
            for (int64_t i = begin; i < stop; ++i) running = amax_step(running, static_cast<float>(data[i]));
            return running;
          },
          [](float a, float b) { return amax_step(a, b); });
    }
  });
  return amax;
}

template <typename Float8>
void cast_segments(const at::Tensor& flat, at::IntArrayRef bounds, const float* scale, Float8* out) {
  const float largest = static_cast<float>(std::numeric_limits<Float8>::max());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "float8_cast_segments", [&] {
    const scalar_t* data = flat.const_data_ptr<scalar_t>();
    for (size_t s = 0; s < bounds.size() / 2; ++s) {
      const float segment_scale = scale[s];
      at::parallel_for(bounds[2 * s], bounds[2 * s + 1], kGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          // Scaled in float32, then clamped to the format's range (a NaN stays NaN).
          const float scaled = static_cast<float>(data[i]) * segment_scale;
          out[i] = Float8(std::min(std::max(scaled, -largest), largest));
        }
      });
    }
  });
}

void float8_cast_segments_cpu(const at::Tensor& flat, at::IntArrayRef bounds, const at::Tensor& scales,
                              at::Tensor& out) {
  check_float8_cast(flat, bounds, scales, out);
  out.zero_();  // what no segment covers (padding) reads as zero
  const float* scale = scales.const_data_ptr<float>();
  if (out.scalar_type() == at::kFloat8_e4m3fn) {
    cast_segments(flat, bounds, scale, out.mutable_data_ptr<c10::Float8_e4m3fn>());
  } else {
    cast_segments(flat, bounds, scale, out.mutable_data_ptr<c10::Float8_e5m2>());
  }
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CPU, m) {
  m.impl("segment_amax", &megatron_fsdp::segment_amax_cpu);
  m.impl("float8_cast_segments", &megatron_fsdp::float8_cast_segments_cpu);
}
