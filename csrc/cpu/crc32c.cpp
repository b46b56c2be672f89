// CRC-32C (Castagnoli, the iSCSI / ext4 checksum) of a byte tensor: the checksum of checkpoint
// files. SSE4.2's crc32 instruction where the CPU has it (checked at run time), slicing-by-8
// tables otherwise; large inputs are split into one piece per thread (torch.get_num_threads())
// and the pieces' CRCs are combined exactly, so the result never depends on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace megatron_fsdp {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // reflected 0x1EDC6F41
// Below this a piece costs less than starting a thread for it (tens of microseconds).
constexpr int64_t kMinPieceBytes = 4 << 20;

using Tables = std::array<std::array<uint32_t, 256>, 8>;

// tables[k][b]: the CRC register after byte b followed by k zero bytes.
const Tables& slicing_tables() {
  static const Tables tables = [] {
    Tables t{};
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t crc = b;
      for (int bit = 0; bit < 8; ++bit) {
        crc = (crc >> 1) ^ (kPolynomial & (0u - (crc & 1u)));
      }
      t[0][b] = crc;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) {
        t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
      }
    }
    return t;
  }();
  return tables;
}

// Advances the CRC register (the inverted CRC) over n bytes.
uint32_t update_software(uint32_t crc, const uint8_t* p, int64_t n) {
  const Tables& t = slicing_tables();
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= crc;
    crc = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^
          t[4][(word >> 24) & 0xFF] ^ t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^
          t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
  }
#endif
  for (; n > 0; ++p, --n) {
    crc = t[0][(crc ^ *p) & 0xFF] ^ (crc >> 8);
  }
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t update_sse42(uint32_t crc, const uint8_t* p, int64_t n) {
  uint64_t wide = crc;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    wide = _mm_crc32_u64(wide, word);
  }
  crc = static_cast<uint32_t>(wide);
  for (; n > 0; ++p, --n) {
    crc = _mm_crc32_u8(crc, *p);
  }
  return crc;
}
#endif

uint32_t update(uint32_t crc, const uint8_t* p, int64_t n) {
#if defined(__x86_64__)
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  if (has_sse42) {
    return update_sse42(crc, p, n);
  }
#endif
  return update_software(crc, p, n);
}

// a * b modulo the polynomial, in the reflected representation (bit 31 is x^0).
uint32_t multiply_mod_p(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) {
      product ^= b;
    }
    b = (b & 1) ? (b >> 1) ^ kPolynomial : b >> 1;
  }
  return product;
}

// x^(8 * bytes) modulo the polynomial: what appending that many zero bytes multiplies a CRC by.
uint32_t shift_by_bytes(uint64_t bytes) {
  static const std::array<uint32_t, 64> x_to_2_to_k = [] {  // x^(2^k) mod P
    std::array<uint32_t, 64> powers{};
    uint32_t power = 1u << 30;  // x^1
    for (auto& entry : powers) {
      entry = power;
      power = multiply_mod_p(power, power);
    }
    return powers;
  }();
  uint32_t result = 1u << 31;  // x^0
  for (int k = 3; bytes != 0; bytes >>= 1, ++k) {  // 8 * bytes = bytes * 2^3
    if (bytes & 1) {
      result = multiply_mod_p(x_to_2_to_k[k], result);
    }
  }
  return result;
}

// The CRC of A followed by B, from crc(A), crc(B) and B's length.
uint32_t combine(uint32_t crc_a, uint32_t crc_b, int64_t length_b) {
  return multiply_mod_p(shift_by_bytes(static_cast<uint64_t>(length_b)), crc_a) ^ crc_b;
}

at::Tensor crc32c_cpu(const at::Tensor& data, int64_t seed) {
  TORCH_CHECK(data.scalar_type() == at::kByte,
              "crc32c: data must be a uint8 tensor (the bytes to checksum), got ",
              data.scalar_type());
  TORCH_CHECK(data.is_contiguous(), "crc32c: data must be contiguous");
  TORCH_CHECK(seed >= 0 && seed <= 0xFFFFFFFFll,
              "crc32c: seed must be a CRC-32C value in [0, 2**32), got ", seed);
  const uint8_t* bytes = data.const_data_ptr<uint8_t>();
  const int64_t n = data.numel();
  const int64_t pieces = std::clamp<int64_t>(n / kMinPieceBytes, 1, at::get_num_threads());
  const int64_t piece_bytes = (n + pieces - 1) / pieces;
  auto piece_length = [&](int64_t i) { return std::min(piece_bytes, n - i * piece_bytes); };
  std::vector<uint32_t> crcs(pieces);
  auto checksum_piece = [&](int64_t i) {
    // The first piece continues from the seed; the others start afresh and are combined below.
    const uint32_t start = i == 0 ? static_cast<uint32_t>(seed) : 0u;
    crcs[i] = ~update(~start, bytes + i * piece_bytes, piece_length(i));
  };
  // One thread per piece; the calling thread takes the first.
  std::vector<std::thread> workers;
  for (int64_t i = 1; i < pieces; ++i) {
    workers.emplace_back(checksum_piece, i);
  }
  checksum_piece(0);
  for (auto& worker : workers) {
    worker.join();
  }
  uint32_t crc = crcs[0];
  for (int64_t i = 1; i < pieces; ++i) {
    crc = combine(crc, crcs[i], piece_length(i));
  }
  return at::scalar_tensor(static_cast<int64_t>(crc), at::TensorOptions().dtype(at::kLong));
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CPU, m) {
  m.impl("crc32c", &megatron_fsdp::crc32c_cpu);
}
