// A pool of device memory for temporary buckets (unsharded weights, un-reduced gradients,
// communication copies). Memory is lent to a tensor's own storage and taken back, so every view
// of that storage (parameters, tensors autograd saved) sees the memory of the current lease:
// a bucket can be released after forward and filled again before backward without touching the
// views. Works for any device through that device's own allocator and events.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <c10/core/Event.h>
#include <torch/custom_class.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace megatron_fsdp {

struct PoolBlock {
  at::DataPtr memory;                 // owned by the pool for the block's whole life
  size_t nbytes = 0;
  at::Device device = at::kCPU;
  std::optional<c10::Event> released;  // recorded on the releasing stream (non-CPU devices)
  std::optional<c10::Stream> allocated_on;  // the stream current when the memory was allocated
  bool lent = false;
  bool moved = false;  // move_new_blocks() gave it memory from the caller's allocator
};

class BucketPool : public torch::CustomClassHolder {
 public:
  // double_buffer: each key owns persistent blocks, lent in turn and grown to the largest
  // request: two for a key whose buckets alternate (the units of a repetitive model), one more
  // for each bucket lent beyond that at once. Addresses stay fixed after the first step.
  // Otherwise a released block goes back to the device's caching allocator (CUDA), so buckets
  // and activations share one cache, or is cached here by size (CPU, which has no such cache).
  explicit BucketPool(bool double_buffer);
  ~BucketPool() override;

  // A 1-D tensor of `numel` elements whose storage holds no memory until fill().
  at::Tensor placeholder(int64_t numel, at::ScalarType dtype, at::Device device);
  // Lends a block to the placeholder's storage. On CUDA the current stream first waits for the
  // work that used the block under its previous lease.
  void fill(const at::Tensor& bucket, const std::string& key);
  // Takes the block back; views of the bucket hold no memory until the next fill().
  void release(const at::Tensor& bucket);
  // placeholder() + fill(): a temporary bucket, given back with release().
  at::Tensor fetch(int64_t numel, at::ScalarType dtype, at::Device device, const std::string& key);
  bool is_filled(const at::Tensor& bucket);

  int64_t bytes_in_use();
  int64_t bytes_reserved();
  int64_t high_water_mark();
  void reset_high_water_mark();
  // Frees every cached block that is not lent (waiting for its last use first).
  void empty_cache();
  bool double_buffer() const { return double_buffer_; }
  // double_buffer: how many persistent blocks each key owns.
  c10::Dict<std::string, int64_t> blocks_per_key();
  // double_buffer: gives every persistent block not moved before new memory from the current
  // allocator of the calling thread (e.g. a torch.cuda.MemPool under use_mem_pool), keeping a
  // lent bucket's contents; returns how many moved. Call between steps, with the device idle.
  int64_t move_new_blocks();

 private:
  using SizeKey = std::tuple<std::string, size_t>;          // (device, nbytes)
  using SlotKey = std::tuple<std::string, std::string>;     // (key, device)

  std::shared_ptr<PoolBlock> take_block(size_t nbytes, at::Device device, const std::string& key);
  std::shared_ptr<PoolBlock> allocate_block(size_t nbytes, at::Device device);
  bool hands_back(const PoolBlock& block) const;
  void note_usage();

  const bool double_buffer_;
  std::mutex mutex_;
  std::map<SizeKey, std::vector<std::shared_ptr<PoolBlock>>> free_by_size_;
  // Per key, its blocks from the least recently lent to the most.
  std::map<SlotKey, std::vector<std::shared_ptr<PoolBlock>>> slots_;
  // Holding the storage keeps a forgotten bucket visible in bytes_in_use() instead of dangling.
  std::map<c10::StorageImpl*, std::pair<c10::Storage, std::shared_ptr<PoolBlock>>> lent_;
  int64_t bytes_in_use_ = 0;
  int64_t bytes_reserved_ = 0;
  int64_t high_water_mark_ = 0;
};

}  // namespace megatron_fsdp
