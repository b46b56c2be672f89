#include "bucket_pool.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>

namespace megatron_fsdp {
namespace {

constexpr size_t kRoundBytes = 512;  // keeps every bucket aligned and makes sizes repeat

size_t round_up(size_t nbytes) { return (nbytes + kRoundBytes - 1) / kRoundBytes * kRoundBytes; }

void no_delete(void*) {}

c10::Stream current_stream(at::Device device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

// Host-ordered devices need no events: work is done when the op returns.
bool needs_events(at::Device device) { return device.type() != at::kCPU; }

void wait_for_last_use(PoolBlock& block, bool on_host) {
  if (!block.released) return;
  if (on_host) {
    block.released->synchronize();
  } else {
    block.released->block(current_stream(block.device));
  }
}

}  // namespace

BucketPool::BucketPool(bool double_buffer) : double_buffer_(double_buffer) {}

BucketPool::~BucketPool() {
  for (auto& entry : lent_) {
    auto* storage = entry.second.first.unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, entry.second.second->device));
    storage->set_nbytes(0);
  }
}

at::Tensor BucketPool::placeholder(int64_t numel, at::ScalarType dtype, at::Device device) {
  TORCH_CHECK(numel >= 0, "BucketPool.placeholder: numel must be >= 0, got ", numel);
  auto bucket = at::empty({0}, at::TensorOptions().dtype(dtype).device(device));
  // The tensor's device carries an index even when `device` ("cuda") did not.
  auto storage = c10::Storage(c10::Storage::use_byte_size_t(), 0, at::DataPtr(nullptr, bucket.device()),
                              /*allocator=*/nullptr, /*resizable=*/false);
  auto* impl = bucket.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(storage));
  impl->set_sizes_contiguous({numel});
  return bucket;
}

std::shared_ptr<PoolBlock> BucketPool::allocate_block(size_t nbytes, at::Device device) {
  c10::OptionalDeviceGuard guard(device);
  auto block = std::make_shared<PoolBlock>();
  block->memory = c10::GetAllocator(device.type())->allocate(nbytes);
  TORCH_CHECK(nbytes == 0 || block->memory.get() != nullptr, "BucketPool: allocation of ", nbytes,
              " bytes on ", device, " failed");
  block->nbytes = nbytes;
  block->device = device;
  if (needs_events(device)) block->allocated_on = current_stream(device);
  bytes_reserved_ += static_cast<int64_t>(nbytes);
  return block;
}

// The CUDA caching allocator reuses a freed block for later work on the stream it was allocated
// on, after the work already queued there: safe when the block is released on that stream, which
// has waited for every collective that used it. Released on another stream, the pool keeps it.
bool BucketPool::hands_back(const PoolBlock& block) const {
  return !double_buffer_ && block.device.is_cuda() && block.allocated_on == current_stream(block.device);
}

std::shared_ptr<PoolBlock> BucketPool::take_block(size_t nbytes, at::Device device,
                                                  const std::string& key) {
  if (!double_buffer_) {
    auto& cached = free_by_size_[SizeKey(device.str(), nbytes)];
    if (cached.empty()) return allocate_block(nbytes, device);
    auto block = cached.back();
    cached.pop_back();
    return block;
  }
  auto& slots = slots_[SlotKey(key, device.str())];
  // The free block lent longest ago: alternating keeps one bucket's reuse off the other's.
  auto chosen = std::find_if(slots.begin(), slots.end(), [](const auto& block) { return !block->lent; });
  std::shared_ptr<PoolBlock> block;
  if (chosen == slots.end()) {
    block = allocate_block(nbytes, device);
  } else {
    block = *chosen;
    slots.erase(chosen);
    if (block->nbytes < nbytes) {
      wait_for_last_use(*block, /*on_host=*/true);
      bytes_reserved_ -= static_cast<int64_t>(block->nbytes);
      block = allocate_block(nbytes, device);
    }
  }
  slots.push_back(block);
  return block;
}

void BucketPool::fill(const at::Tensor& bucket, const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto* storage = bucket.storage().unsafeGetStorageImpl();
  TORCH_CHECK(lent_.find(storage) == lent_.end(),
              "BucketPool.fill: this bucket already holds pool memory; release() it first");
  TORCH_CHECK(bucket.storage().nbytes() == 0,
              "BucketPool.fill: the bucket must come from placeholder() (its storage owns memory)");
  const size_t needed = static_cast<size_t>(bucket.storage_offset() + bucket.numel()) *
                        bucket.element_size();
  auto block = take_block(round_up(needed), bucket.device(), key);
  wait_for_last_use(*block, /*on_host=*/false);
  block->released.reset();
  block->lent = true;
  storage->set_data_ptr_noswap(at::DataPtr(block->memory.get(), block->memory.get(), &no_delete,
                                           bucket.device()));
  storage->set_nbytes(needed);
  lent_.emplace(storage, std::make_pair(bucket.storage(),
                                        block));
  bytes_in_use_ += static_cast<int64_t>(block->nbytes);
  note_usage();
}

void BucketPool::release(const at::Tensor& bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto* storage = bucket.storage().unsafeGetStorageImpl();
  auto found = lent_.find(storage);
  TORCH_CHECK(found != lent_.end(),
              "BucketPool.release: this bucket holds no pool memory (released twice, or never "
              "filled)");
  auto block = found->second.second;
  lent_.erase(found);
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, bucket.device()));
  storage->set_nbytes(0);
  bytes_in_use_ -= static_cast<int64_t>(block->nbytes);
  if (hands_back(*block)) {
    bytes_reserved_ -= static_cast<int64_t>(block->nbytes);
    return;  // the last reference: the memory goes back to the caching allocator
  }
  if (needs_events(block->device)) {
    block->released.emplace(block->device.type());
    block->released->record(current_stream(block->device));
  }
  block->lent = false;
  if (!double_buffer_) {
    free_by_size_[SizeKey(block->device.str(), block->nbytes)].push_back(block);
  }
}

at::Tensor BucketPool::fetch(int64_t numel, at::ScalarType dtype, at::Device device,
                             const std::string& key) {
  auto bucket = placeholder(numel, dtype, device);
  fill(bucket, key);
  return bucket;
}

bool BucketPool::is_filled(const at::Tensor& bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  return lent_.count(bucket.storage().unsafeGetStorageImpl()) > 0;
}

int64_t BucketPool::bytes_in_use() {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_in_use_;
}

int64_t BucketPool::bytes_reserved() {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_reserved_;
}

int64_t BucketPool::high_water_mark() {
  std::lock_guard<std::mutex> lock(mutex_);
  return high_water_mark_;
}

void BucketPool::reset_high_water_mark() {
  std::lock_guard<std::mutex> lock(mutex_);
  high_water_mark_ = bytes_in_use_;
}

void BucketPool::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  auto drop = [this](std::shared_ptr<PoolBlock>& block) {
    wait_for_last_use(*block, /*on_host=*/true);
    bytes_reserved_ -= static_cast<int64_t>(block->nbytes);
    block.reset();
  };
  for (auto& entry : free_by_size_) {
    for (auto& block : entry.second) drop(block);
  }
  free_by_size_.clear();
  for (auto& entry : slots_) {
    auto& blocks = entry.second;
    for (auto& block : blocks) {
      if (!block->lent) drop(block);
    }
    blocks.erase(std::remove(blocks.begin(), blocks.end(), nullptr), blocks.end());
  }
}

c10::Dict<std::string, int64_t> BucketPool::blocks_per_key() {
  std::lock_guard<std::mutex> lock(mutex_);
  c10::Dict<std::string, int64_t> counts;
  for (const auto& entry : slots_) {
    const auto& key = std::get<0>(entry.first);
    const int64_t previous = counts.contains(key) ? counts.at(key) : 0;
    counts.insert_or_assign(key, previous + static_cast<int64_t>(entry.second.size()));
  }
  return counts;
}

int64_t BucketPool::move_new_blocks() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(double_buffer_, "BucketPool.move_new_blocks: only a double_buffer pool keeps persistent blocks");
  std::vector<std::shared_ptr<PoolBlock>> unmoved;
  for (auto& entry : slots_) {
    for (auto& block : entry.second) {
      if (!block->moved) unmoved.push_back(block);
    }
  }
  if (unmoved.empty()) return 0;
  const at::Device device = unmoved.front()->device;
  auto synchronize = [&device] {
    if (needs_events(device)) c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
  };
  synchronize();  // lent buckets may still be in use by collectives on other streams
  std::map<PoolBlock*, std::vector<c10::StorageImpl*>> lent_storages;
  for (auto& entry : lent_) lent_storages[entry.second.second.get()].push_back(entry.first);
  // One block at a time, the old memory freed before (idle) or right after (lent, once its
  // contents are copied) the next is allocated: at most one block is held twice.
  for (auto& block : unmoved) {
    auto found = lent_storages.find(block.get());
    const bool lent = found != lent_storages.end();
    if (!lent) block->memory.clear();
    auto fresh = allocate_block(block->nbytes, block->device);
    bytes_reserved_ -= static_cast<int64_t>(block->nbytes);  // the same block, counted once
    if (lent) {
      auto options = at::TensorOptions().dtype(at::kByte).device(block->device);
      const auto nbytes = static_cast<int64_t>(block->nbytes);
      at::from_blob(fresh->memory.get(), {nbytes}, options)
          .copy_(at::from_blob(block->memory.get(), {nbytes}, options));
      for (auto* storage : found->second) {
        storage->set_data_ptr_noswap(
            at::DataPtr(fresh->memory.get(), fresh->memory.get(), &no_delete, storage->device()));
      }
      synchronize();  // the copy is done: the old memory can go
    }
    block->memory = std::move(fresh->memory);
    block->allocated_on = fresh->allocated_on;
    block->released.reset();
    block->moved = true;
  }
  return static_cast<int64_t>(unmoved.size());
}

void BucketPool::note_usage() { high_water_mark_ = std::max(high_water_mark_, bytes_in_use_); }

}  // namespace megatron_fsdp
