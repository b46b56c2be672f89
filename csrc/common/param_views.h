// Zero-copy parameter views into a flat buffer. Metadata only, so the CPU and CUDA
// registrations share this one implementation.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace megatron_fsdp {

inline std::vector<at::Tensor> param_views(const at::Tensor& flat, at::IntArrayRef offsets,
                                           at::IntArrayRef shapes, at::IntArrayRef ranks) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(),
              "param_views: the flat buffer must be 1-D and contiguous, got shape ", flat.sizes());
  TORCH_CHECK(offsets.size() == ranks.size(), "param_views: got ", offsets.size(), " offsets but ",
              ranks.size(), " ranks");
  std::vector<at::Tensor> views;
  views.reserve(offsets.size());
  size_t cursor = 0;
  for (size_t i = 0; i < offsets.size(); ++i) {
    TORCH_CHECK(ranks[i] >= 0 && cursor + ranks[i] <= shapes.size(),
                "param_views: shapes holds fewer sizes than ranks asks for");
    at::IntArrayRef shape = shapes.slice(cursor, ranks[i]);
    cursor += ranks[i];
    const int64_t numel = c10::multiply_integers(shape);
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + numel <= flat.numel(), "param_views: view ", i,
                " (", numel, " elements at offset ", offsets[i], ") does not fit in ", flat.numel(),
                " elements");
    views.push_back(flat.narrow(0, offsets[i], numel).view(shape));
  }
  TORCH_CHECK(cursor == shapes.size(), "param_views: shapes holds more sizes than ranks uses");
  return views;
}

}  // namespace megatron_fsdp
