// The whole surface of the megatron_fsdp library: every op schema and the bucket pool class.
// Kernels register per device in cpu/*.cpp and cuda/*.cu; fake kernels live in megatron_fsdp/_ops.py.
#include <torch/library.h>

#include "common/bucket_pool.h"

TORCH_LIBRARY(megatron_fsdp, m) {
  // Parameter-shaped views into one flat buffer. shapes holds every view's sizes back to back and
  // ranks says how many belong to each view; views share flat's storage (zero copy).
  m.def("param_views(Tensor(a -> *) flat, int[] offsets, int[] shapes, int[] ranks) -> Tensor(a)[]");

  // flat[offsets[i] : offsets[i] + srcs[i].numel()] = srcs[i], cast to flat's dtype.
  m.def("flatten_copy(Tensor[] srcs, int[] offsets, Tensor(a!) flat) -> ()");

  // dsts[i] = flat[offsets[i] : offsets[i] + dsts[i].numel()], cast to each dst's dtype.
  m.def("unflatten_copy(Tensor flat, int[] offsets, Tensor(a!)[] dsts) -> ()");

  // out (=|+=) scale * sum_r chunks[r], summed in fp32 (fp64 when chunks or out are fp64)
  // whatever the dtypes of chunks [world, n] and out [n]: the reduction step behind
  // low-precision communication.
  m.def("promoting_reduce(Tensor chunks, float scale, bool accumulate, Tensor(a!) out) -> ()");

  // One bool per tensor: does it hold a NaN or an Inf. Computed on the tensors' device, no host sync.
  m.def("find_non_finite(Tensor[] tensors) -> Tensor");

  // One float32 per tensor: sum(|x|^norm_type), not rooted, or max(|x|) for norm_type = inf (0 when
  // empty), summed in double on the tensors' device. A NaN or an Inf in a tensor reaches its entry.
  m.def("multi_tensor_norm(Tensor[] tensors, float norm_type) -> Tensor");

  // CRC-32C of a contiguous uint8 tensor's bytes, continuing from seed (the CRC of the bytes
  // before them; 0 to start), as an int64 scalar tensor. CPU only: it checksums checkpoint files,
  // whose bytes are on the host.
  m.def("crc32c(Tensor data, int seed=0) -> Tensor");

  // One torch.optim.Adam step (AdamW's with decoupled_weight_decay) over flat buffers, in place:
  // fp32 param and states, grad in fp32, bf16 or fp16 (upcast first); step counts this step
  // (>= 1); max_exp_avg_sq is given exactly when amsgrad. Rounds like torch.optim's update on
  // the same device. weights_out (fp32, bf16 or fp16, like param otherwise), when given, also
  // receives the updated param cast as Tensor.to casts it: the compute weights, in the same pass.
  m.def(
      "adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? max_exp_avg_sq, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, int step, bool decoupled_weight_decay, bool amsgrad, "
      "bool maximize, Tensor(e!)? weights_out=None) -> ()");

  // One torch.optim.SGD step over flat buffers, in place, with the same dtype rules and
  // weights_out; the momentum buffer is given exactly when momentum != 0, and on first_step it is
  // set to the gradient.
  m.def(
      "sgd_step_(Tensor(a!) param, Tensor grad, Tensor(b!)? momentum_buffer, float lr, "
      "float momentum, float dampening, float weight_decay, bool nesterov, bool maximize, "
      "bool first_step, Tensor(c!)? weights_out=None) -> ()");

  // One float32 per [start, end) pair of bounds: max(|flat[start:end]|), 0 when empty, NaN when
  // the segment holds one. The local amax of each float8 weight's piece of a shard.
  m.def("segment_amax(Tensor flat, int[] bounds) -> Tensor");

  // out[i] = float8(clamp(float32(flat[i]) * scales[s], -max, max)) for i in segment s of bounds
  // (max: out's float8 format's largest finite value; rounded to nearest even), and 0 outside
  // every segment: a shard of float8 weights, each with its own (torchao tensorwise) scale.
  m.def("float8_cast_segments(Tensor flat, int[] bounds, Tensor scales, Tensor(a!) out) -> ()");

  m.class_<megatron_fsdp::BucketPool>("BucketPool")
      .def(torch::init<bool>())
      .def("placeholder", &megatron_fsdp::BucketPool::placeholder)
      .def("fill", &megatron_fsdp::BucketPool::fill)
      .def("release", &megatron_fsdp::BucketPool::release)
      .def("fetch", &megatron_fsdp::BucketPool::fetch)
      .def("is_filled", &megatron_fsdp::BucketPool::is_filled)
      .def("bytes_in_use", &megatron_fsdp::BucketPool::bytes_in_use)
      .def("bytes_reserved", &megatron_fsdp::BucketPool::bytes_reserved)
      .def("high_water_mark", &megatron_fsdp::BucketPool::high_water_mark)
      .def("reset_high_water_mark", &megatron_fsdp::BucketPool::reset_high_water_mark)
      .def("empty_cache", &megatron_fsdp::BucketPool::empty_cache)
      .def("double_buffer", &megatron_fsdp::BucketPool::double_buffer)
      .def("blocks_per_key", &megatron_fsdp::BucketPool::blocks_per_key)
      .def("move_new_blocks", &megatron_fsdp::BucketPool::move_new_blocks);
}
