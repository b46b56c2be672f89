// Copies between a list of tensors and one flat buffer, casting on the way. Every tensor goes
// through one multi-tensor launch per dtype pair, not one launch per tensor.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "multi_tensor.cuh"

namespace megatron_fsdp {
namespace {

namespace mt = multi_tensor;

// Chunk table fields per tensor: source address, destination address (both at element 0).
constexpr int kFields = 2;

// Same rounding as the CPU kernel: through float, or through double when either side is fp64.
template <typename Dst, typename Src>
__device__ __forceinline__ Dst cast_value(Src value) {
  if constexpr (std::is_same_v<Src, double> || std::is_same_v<Dst, double>) {
    return static_cast<Dst>(static_cast<double>(value));
  } else {
    return static_cast<Dst>(static_cast<float>(value));
  }
}

// Copies num_vecs vectors of V elements. Each thread issues all its loads before its first
// store, so many loads are in flight; vector i is read and written by one thread only.
template <int V, typename Src, typename Dst>
__device__ __forceinline__ void copy_vectors(const Src* src, Dst* dst, int num_vecs) {
  using SrcVec = mt::Vec<Src, V>;
  using DstVec = mt::Vec<Dst, V>;
  constexpr int kLoads = mt::loads_in_flight(static_cast<int>(sizeof(SrcVec)));
  const SrcVec* src_vecs = reinterpret_cast<const SrcVec*>(src);
  DstVec* dst_vecs = reinterpret_cast<DstVec*>(dst);
  for (int base = static_cast<int>(threadIdx.x); base < num_vecs;
       base += kLoads * mt::kBlockThreads) {
    SrcVec in[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = base + k * mt::kBlockThreads;
      if (i < num_vecs) in[k] = src_vecs[i];
    }
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = base + k * mt::kBlockThreads;
      if (i < num_vecs) {
        DstVec out;
#pragma unroll
        for (int j = 0; j < V; ++j) out.val[j] = cast_value<Dst>(in[k].val[j]);
        dst_vecs[i] = out;
      }
    }
  }
}

// Copies one chunk with the widest vectors V that both sides allow. A few scalar head elements
// bring src to a V-vector boundary; if dst is then not on one too (the two are offset by a
// different amount, e.g. an odd flat offset), retry with V / 2, down to plain scalar copies,
// which stay coalesced and unrolled. Every branch depends only on the chunk, so it is uniform.
template <int V, typename Src, typename Dst>
__device__ void copy_chunk(const Src* src, Dst* dst, int count) {
  if constexpr (V == 1) {
    copy_vectors<1>(src, dst, count);
  } else {
    constexpr uintptr_t kSrcAlign = sizeof(Src) * V;
    constexpr uintptr_t kDstAlign = sizeof(Dst) * V;
    // Tensors are always aligned to their element size, so this is a whole number of elements.
    int head = static_cast<int>((kSrcAlign - mt::misalignment(src, kSrcAlign)) % kSrcAlign /
                                sizeof(Src));
    if (head > count) head = count;
    if (mt::misalignment(dst + head, kDstAlign) != 0) {
      copy_chunk<V / 2>(src, dst, count);
      return;
    }
    const int num_vecs = (count - head) / V;
    const int tail = head + num_vecs * V + static_cast<int>(threadIdx.x);  // after the vectors
    // Head and tail are each shorter than V, so one element per thread covers them.
    if (static_cast<int>(threadIdx.x) < head) {
      dst[threadIdx.x] = cast_value<Dst>(src[threadIdx.x]);
    }
    copy_vectors<V>(src + head, dst + head, num_vecs);
    if (tail < count) dst[tail] = cast_value<Dst>(src[tail]);
  }
}

// No __restrict__: a source may be a view of the very flat segment it is copied into. That is
// safe because such a source is the identical range and each element is read before it is
// written, by the same thread.
template <typename Src, typename Dst>
__global__ void copy_cast_kernel(const int64_t* tensors, const int64_t* chunks) {
  const mt::Chunk chunk = mt::current_chunk(tensors, kFields, chunks);
  const Src* src = mt::pointer_from<const Src>(chunk.tensor[0]) + chunk.start;
  Dst* dst = mt::pointer_from<Dst>(chunk.tensor[1]) + chunk.start;
  // 16-byte accesses on the wider side; the narrower side then moves fewer bytes per vector.
  constexpr int kVec = static_cast<int>(16 / std::max(sizeof(Src), sizeof(Dst)));
  copy_chunk<kVec>(src, dst, static_cast<int>(chunk.count));
}

struct CopyJob {
  const void* src;
  at::ScalarType src_dtype;
  void* dst;
  at::ScalarType dst_dtype;
  int64_t numel;
};

// Uploads one chunk table for all jobs and launches once per (source, destination) dtype pair.
void launch_copies(const std::vector<CopyJob>& jobs, at::Device device) {
  struct Group {
    at::ScalarType src_dtype;
    at::ScalarType dst_dtype;
    int64_t first_chunk;
    int64_t num_chunks;
  };
  mt::ChunkTableBuilder builder(kFields);
  std::vector<Group> groups;
  for (at::ScalarType src_dtype : mt::kFloatingDtypes) {
    for (at::ScalarType dst_dtype : mt::kFloatingDtypes) {
      const int64_t first = builder.num_chunks();
      for (const CopyJob& job : jobs) {
        if (job.src_dtype == src_dtype && job.dst_dtype == dst_dtype) {
          builder.add({mt::address_of(job.src), mt::address_of(job.dst)}, job.numel);
        }
      }
      if (builder.num_chunks() > first) {
        groups.push_back({src_dtype, dst_dtype, first, builder.num_chunks() - first});
      }
    }
  }
  if (groups.empty()) return;  // nothing but zero-element tensors

  const mt::ChunkTable table = builder.upload(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (const Group& group : groups) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, group.src_dtype, "copy_cast_src", [&] {
      using src_t = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, group.dst_dtype, "copy_cast_dst", [&] {
        copy_cast_kernel<src_t, scalar_t>
            <<<static_cast<unsigned int>(group.num_chunks), mt::kBlockThreads, 0, stream>>>(
                table.tensors(), table.chunks(group.first_chunk));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
}

// Address of element `offset` of the flat buffer.
char* flat_at(const at::Tensor& flat, int64_t offset) {
  return static_cast<char*>(flat.mutable_data_ptr()) + offset * flat.element_size();
}

void flatten_copy_cuda(at::TensorList srcs, at::IntArrayRef offsets, const at::Tensor& flat) {
  check_flat(flat, "flatten_copy");
  check_segments(flat, offsets, srcs, "flatten_copy");
  TORCH_CHECK(flat.is_cuda(), "flatten_copy: the flat buffer must be a CUDA tensor, got ",
              flat.device());
  const c10::cuda::CUDAGuard guard(flat.device());
  // Strided sources are copied to contiguous temporaries here; they must outlive the launch.
  std::vector<at::Tensor> contiguous_srcs;
  std::vector<CopyJob> jobs;
  contiguous_srcs.reserve(srcs.size());
  jobs.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    contiguous_srcs.push_back(srcs[i].contiguous());
    const at::Tensor& src = contiguous_srcs.back();
    jobs.push_back({src.const_data_ptr(), src.scalar_type(), flat_at(flat, offsets[i]),
                    flat.scalar_type(), src.numel()});
  }
  launch_copies(jobs, flat.device());
}

void unflatten_copy_cuda(const at::Tensor& flat, at::IntArrayRef offsets, at::TensorList dsts) {
  check_flat(flat, "unflatten_copy");
  check_segments(flat, offsets, dsts, "unflatten_copy");
  TORCH_CHECK(flat.is_cuda(), "unflatten_copy: the flat buffer must be a CUDA tensor, got ",
              flat.device());
  const c10::cuda::CUDAGuard guard(flat.device());
  std::vector<CopyJob> jobs;
  jobs.reserve(dsts.size());
  for (size_t i = 0; i < dsts.size(); ++i) {
    TORCH_CHECK(dsts[i].is_contiguous(), "unflatten_copy: destination ", i, " must be contiguous");
    jobs.push_back({flat_at(flat, offsets[i]), flat.scalar_type(), dsts[i].mutable_data_ptr(),
                    dsts[i].scalar_type(), dsts[i].numel()});
  }
  launch_copies(jobs, flat.device());
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CUDA, m) {
  m.impl("flatten_copy", &megatron_fsdp::flatten_copy_cuda);
  m.impl("unflatten_copy", &megatron_fsdp::unflatten_copy_cuda);
}
