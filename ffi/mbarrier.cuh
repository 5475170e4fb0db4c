// Shared-memory mbarriers and the bulk copy that completes on them (sm_90):
// the prefill kernel's stage ring (prefill_sm90.cuh), the decode kernel's
// inboxes of partial sums (decode_kernel.cu), benchmarks/racecheck_probe.cu and
// benchmarks/l2_probe.cu.
// A barrier is addressed by its 32-bit shared-memory address (smem_addr).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace marlin {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

// One arrival, announcing `bytes` that copies or st.async stores will deliver;
// the phase completes when the arrivals are in and all the bytes have landed.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Waits until the phase of parity `parity` has completed. A barrier starts in
// phase 0; its n-th completion (n = 0, 1, ...) ends phase n, of parity n & 1.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// `bytes` (a multiple of 16) contiguous bytes from global to shared memory.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

#endif

}  // namespace marlin
