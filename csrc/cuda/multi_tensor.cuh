// "One launch for many tensors": the host splits every tensor into fixed-size chunks and uploads
// a table describing them; the kernel runs one block per chunk and looks its chunk up by blockIdx.
//
// Table layout (int64, on the device):
//   tensor section: num_tensors rows of `tensor_fields` values chosen by the kernel
//                   (data pointers stored as integers, flag indices, ...)
//   chunk section:  num_chunks rows of {tensor row, first element, element count}
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

namespace megatron_fsdp {
namespace multi_tensor {

// Elements per chunk (one block each). Large enough to amortise the table lookup and block
// start-up over many loads, small enough that the last wave of blocks ends soon after the rest.
constexpr int64_t kChunkSize = 32768;
// Kernels stride by this constant rather than blockDim.x so index offsets fold into immediates.
constexpr int kBlockThreads = 256;
constexpr int kChunkFields = 3;

// N consecutive elements moved by one load or store instruction (N * sizeof(T) <= 16 bytes).
// The pointer cast to Vec* must be aligned to alignof(Vec).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

// Loads each thread issues before using any of them. Memory-bound kernels need many bytes in
// flight to cover DRAM latency: about 64 per thread, more loads when each one is narrow.
constexpr int loads_in_flight(int bytes_per_load) {
  return bytes_per_load >= 16 ? 4 : bytes_per_load >= 4 ? 64 / bytes_per_load : 16;
}

__device__ __forceinline__ uintptr_t misalignment(const void* ptr, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(ptr) % alignment;
}

template <typename T>
inline int64_t address_of(T* ptr) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(ptr));
}

template <typename T>
__device__ __forceinline__ T* pointer_from(int64_t address) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(address));
}

// The chunk this block works on. Launch with gridDim.x == the number of chunks in the range.
struct Chunk {
  const int64_t* tensor;  // this chunk's row in the tensor section
  int64_t start;          // first element of the chunk within its tensor
  int64_t count;          // elements in the chunk, 1..kChunkSize
};

__device__ __forceinline__ Chunk current_chunk(const int64_t* tensors, int tensor_fields,
                                               const int64_t* chunks) {
  const int64_t* row = chunks + static_cast<int64_t>(blockIdx.x) * kChunkFields;
  return {tensors + row[0] * tensor_fields, row[1], row[2]};
}

// Calls visit(element) on this thread's elements of a read-only chunk: a scalar head up to the
// first 16-byte boundary (tensors are aligned to their element size), then 16-byte vectors with
// several loads in flight per thread, then a scalar tail. Head and tail are each shorter than a
// vector, so one element per thread covers them. Every element is visited exactly once per block.
template <typename T, typename Visit>
__device__ __forceinline__ void for_each_element(const T* data, int count, Visit&& visit) {
  constexpr int kVec = static_cast<int>(16 / sizeof(T));
  using VecT = Vec<T, kVec>;
  constexpr int kLoads = loads_in_flight(static_cast<int>(sizeof(VecT)));
  const int thread = static_cast<int>(threadIdx.x);
  int head = static_cast<int>((16 - misalignment(data, 16)) % 16 / sizeof(T));
  if (head > count) head = count;
  const int num_vecs = (count - head) / kVec;
  const int tail = head + num_vecs * kVec + thread;  // after the vectors
  if (thread < head) visit(data[thread]);
  if (tail < count) visit(data[tail]);

  const VecT* vecs = reinterpret_cast<const VecT*>(data + head);
  for (int base = thread; base < num_vecs; base += kLoads * kBlockThreads) {
    VecT in[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = base + k * kBlockThreads;
      if (i < num_vecs) in[k] = vecs[i];
    }
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      if (base + k * kBlockThreads < num_vecs) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) visit(in[k].val[j]);
      }
    }
  }
}

// The floating dtypes the multi-tensor ops launch for, in launch order.
constexpr at::ScalarType kFloatingDtypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};

// The chunks of one dtype's tensors: one launch each.
struct DtypeGroup {
  at::ScalarType dtype;
  int64_t first_chunk;
  int64_t num_chunks;
};

// The uploaded table. `storage` owns the device memory; dropping it after the launches is safe
// because the caching allocator orders reuse on the current stream.
struct ChunkTable {
  at::Tensor storage;
  int tensor_fields = 0;
  int64_t num_tensors = 0;
  int64_t num_chunks = 0;

  const int64_t* tensors() const { return storage.const_data_ptr<int64_t>(); }
  // Chunk rows from `first_chunk` on, so one table can serve several launches (one per dtype).
  const int64_t* chunks(int64_t first_chunk) const {
    return tensors() + num_tensors * tensor_fields + first_chunk * kChunkFields;
  }
};

class ChunkTableBuilder {
 public:
  explicit ChunkTableBuilder(int tensor_fields) : tensor_fields_(tensor_fields) {}

  // Adds one tensor: its kernel-specific fields and its element count, cut into chunks.
  // Zero-element tensors add no chunk, so they cost nothing on the device.
  void add(std::initializer_list<int64_t> fields, int64_t numel) {
    TORCH_INTERNAL_ASSERT(static_cast<int>(fields.size()) == tensor_fields_);
    const int64_t row = static_cast<int64_t>(tensor_rows_.size()) / tensor_fields_;
    tensor_rows_.insert(tensor_rows_.end(), fields.begin(), fields.end());
    for (int64_t start = 0; start < numel; start += kChunkSize) {
      chunk_rows_.push_back(row);
      chunk_rows_.push_back(start);
      chunk_rows_.push_back(std::min(kChunkSize, numel - start));
    }
  }

  int64_t num_chunks() const { return static_cast<int64_t>(chunk_rows_.size()) / kChunkFields; }

  // Adds the tensors dtype by dtype (kFloatingDtypes' order) through add_tensor(builder, i) for
  // each i with dtype_of(i) == dtype; returns the dtypes that got chunks, one launch each.
  template <typename DtypeOf, typename AddTensor>
  std::vector<DtypeGroup> add_by_dtype(int64_t num_tensors, const DtypeOf& dtype_of,
                                       const AddTensor& add_tensor) {
    std::vector<DtypeGroup> groups;
    for (at::ScalarType dtype : kFloatingDtypes) {
      const int64_t first = num_chunks();
      for (int64_t i = 0; i < num_tensors; ++i) {
        if (dtype_of(i) == dtype) add_tensor(*this, i);
      }
      if (num_chunks() > first) groups.push_back({dtype, first, num_chunks() - first});
    }
    return groups;
  }

  // Copies the table to `device` on the current stream without blocking the host. The staging
  // buffer is pinned memory from PyTorch's caching host allocator; copy_(non_blocking=true)
  // records an event on it, so the buffer is not reused before the copy has read it.
  ChunkTable upload(at::Device device) const {
    TORCH_CHECK(num_chunks() <= std::numeric_limits<int32_t>::max(),
                "multi-tensor launch: too many chunks (", num_chunks(), ")");
    ChunkTable table;
    table.tensor_fields = tensor_fields_;
    table.num_tensors = static_cast<int64_t>(tensor_rows_.size()) / tensor_fields_;
    table.num_chunks = num_chunks();
    const int64_t size = static_cast<int64_t>(tensor_rows_.size() + chunk_rows_.size());
    at::Tensor host =
        at::empty({size}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    int64_t* out = host.mutable_data_ptr<int64_t>();
    std::copy(tensor_rows_.begin(), tensor_rows_.end(), out);
    std::copy(chunk_rows_.begin(), chunk_rows_.end(), out + tensor_rows_.size());
    table.storage = at::empty({size}, at::TensorOptions().dtype(at::kLong).device(device));
    table.storage.copy_(host, /*non_blocking=*/true);
    return table;
  }

 private:
  int tensor_fields_;
  std::vector<int64_t> tensor_rows_;
  std::vector<int64_t> chunk_rows_;
};

}  // namespace multi_tensor
}  // namespace megatron_fsdp
