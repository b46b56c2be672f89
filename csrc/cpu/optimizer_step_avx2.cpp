// The AVX2 build (with FMA and F16C) of the loops in optimizer_step_vec.h, chosen at run time by
// optimizer_step.cpp. The pragma compiles this whole file for AVX2, as ATen compiles its own AVX2
// kernel files with -mavx2 -mfma, and the macros select at::vec's AVX2 vectors. So the file
// includes nothing but the loops and their vector headers: its code is the two entry points and
// what they inline (no shared inline copies), plus <iostream>'s static initialiser, which holds no
// vector instructions. Nothing else in it runs on a CPU without AVX2.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c")
// g++ lexes ahead of the pragma, so it leaves the ISA macros unset; headers such as sleef.h
// declare their AVX2 functions only under them.
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
// The lambdas in at::vec's bfloat16 header warn about a vector ABI change that only matters
// across files built for different targets; nothing here passes vectors out.
#pragma GCC diagnostic ignored "-Wpsabi"
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2

#include "optimizer_step_vec.h"

static_assert(MEGATRON_FSDP_AVX2_LOOPS, "the AVX2 loops are built exactly where they are declared");

namespace megatron_fsdp {

void adam_range_avx2(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_range(c, b, begin, end);
}

void sgd_range_avx2(const SgdConstants& c, const SgdBuffers& b, int64_t begin, int64_t end) {
  sgd_range(c, b, begin, end);
}

}  // namespace megatron_fsdp
#endif
