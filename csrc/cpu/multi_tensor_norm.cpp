// Per tensor, sum(|x|^p) (not rooted) or, for p = inf, max(|x|): the reduction behind fused
// gradient clipping. Summed in double, so the float32 result is within an ulp or so of exact.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../common/checks.h"

namespace megatron_fsdp {

// Shared with cuda/multi_tensor_norm.cu (this file is always compiled), so both kernels reject bad
// input with one message.
void check_multi_tensor_norm_args(at::TensorList tensors, double norm_type) {
  check_same_device(tensors, "multi_tensor_norm");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].is_contiguous(), "multi_tensor_norm: tensor ", i,
                " must be contiguous, got strides ", tensors[i].strides(), " for shape ",
                tensors[i].sizes());
  }
  TORCH_CHECK(norm_type > 0, "multi_tensor_norm: norm_type must be > 0 (a finite p or inf), got ",
              norm_type);
}

namespace {

// Elements per parallel task: large enough to amortise the task, small enough that one huge
// tensor still spreads over every thread.
constexpr int64_t kChunkSize = 32768;

enum class Norm { kOne, kTwo, kPower, kMax };

template <Norm kNorm>
inline double term(double x, double p) {
  if constexpr (kNorm == Norm::kTwo) {
    return x * x;
  } else if constexpr (kNorm == Norm::kPower) {
    return std::pow(std::abs(x), p);
  } else {
    return std::abs(x);
  }
}

// Sum, or a max that keeps NaN (std::max would drop a NaN met after a number). Bitwise | rather
// than || keeps the max branch-free, so it vectorises.
template <Norm kNorm>
inline double combine(double acc, double value) {
  if constexpr (kNorm == Norm::kMax) {
    return ((value > acc) | std::isnan(value)) ? value : acc;
  } else {
    return acc + value;
  }
}

template <typename T, Norm kNorm>
double reduce_chunk(const T* data, int64_t count, double p) {
  // Independent lanes break the dependency chain of one accumulator, so the compiler can
  // vectorise across them. Every term is >= 0, so 0 is the identity of both sum and max.
  constexpr int kLanes = 8;
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      lanes[j] = combine<kNorm>(lanes[j], term<kNorm>(static_cast<double>(data[i + j]), p));
    }
  }
  for (; i < count; ++i) {
    lanes[0] = combine<kNorm>(lanes[0], term<kNorm>(static_cast<double>(data[i]), p));
  }
  double total = lanes[0];
  for (int j = 1; j < kLanes; ++j) total = combine<kNorm>(total, lanes[j]);
  return total;
}

struct Chunk {
  int64_t tensor;
  int64_t start;
  int64_t count;
};

template <Norm kNorm>
void multi_tensor_norm_impl(at::TensorList tensors, double p, float* out) {
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk(tensors.size() + 1, 0);
  int64_t total_numel = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t numel = tensors[t].numel();
    for (int64_t start = 0; start < numel; start += kChunkSize) {
      chunks.push_back({static_cast<int64_t>(t), start, std::min(kChunkSize, numel - start)});
    }
    first_chunk[t + 1] = static_cast<int64_t>(chunks.size());
    total_numel += numel;
  }
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());

  // One partial per chunk, combined per tensor afterwards in a fixed order: deterministic results
  // whatever the thread count. The grain gives each task about kChunkSize elements even when the
  // list holds many small tensors.
  std::vector<double> partials(num_chunks);
  const int64_t grain =
      std::max<int64_t>(1, kChunkSize * num_chunks / std::max<int64_t>(1, total_numel));
  at::parallel_for(0, num_chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& chunk = chunks[c];
      const at::Tensor& src = tensors[chunk.tensor];
      AT_DISPATCH_FLOATING_TYPES_AND2(
          at::kHalf, at::kBFloat16, src.scalar_type(), "multi_tensor_norm", [&] {
            const scalar_t* data = src.const_data_ptr<scalar_t>() + chunk.start;
            partials[c] = reduce_chunk<scalar_t, kNorm>(data, chunk.count, p);
          });
    }
  });
  for (size_t t = 0; t < tensors.size(); ++t) {
    double total = 0.0;  // also the result of an empty tensor
    for (int64_t c = first_chunk[t]; c < first_chunk[t + 1]; ++c) {
      total = combine<kNorm>(total, partials[c]);
    }
    out[t] = static_cast<float>(total);
  }
}

at::Tensor multi_tensor_norm_cpu(at::TensorList tensors, double norm_type) {
  check_multi_tensor_norm_args(tensors, norm_type);
  auto norms = at::empty({static_cast<int64_t>(tensors.size())}, at::kFloat);
  float* out = norms.mutable_data_ptr<float>();
  if (std::isinf(norm_type)) {
    multi_tensor_norm_impl<Norm::kMax>(tensors, norm_type, out);
  } else if (norm_type == 1.0) {
    multi_tensor_norm_impl<Norm::kOne>(tensors, norm_type, out);
  } else if (norm_type == 2.0) {
    multi_tensor_norm_impl<Norm::kTwo>(tensors, norm_type, out);
  } else {
    multi_tensor_norm_impl<Norm::kPower>(tensors, norm_type, out);
  }
  return norms;
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CPU, m) {
  m.impl("multi_tensor_norm", &megatron_fsdp::multi_tensor_norm_cpu);
}
