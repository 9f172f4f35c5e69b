// Memory helpers shared by the CUDA kernels: streaming global loads that skip L1 (read-once data
// such as weights), cp.async and Hopper's mbarrier-counted bulk copies into shared memory, the
// multiprocessor count that sizes grids, and a kernel's shared-memory limit raised. .cu files only.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace kiln::kernels {

// 16 bytes (16-byte aligned) through L2 only, with a 256-byte L2 prefetch of the line around it.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// 8 bytes (8-byte aligned) through L2 only.
__device__ __forceinline__ uint2 ld_stream8(const void* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// cp.async: 16 bytes global -> shared (both 16-byte aligned) through L2 only; with fill false
// nothing is read and the 16 bytes become zeros. Committed as a group, waited for by count.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool fill = true) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(fill ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>  // wait until at most kPending committed groups are still in flight
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory"); }

// Hopper's bulk copy (sm_90): `bytes` (a multiple of 16, both addresses 16-byte aligned) global ->
// shared at shared address `dst`, its completion counted on the mbarrier at shared address `bar`.
// The barrier's phase completes once its one arrival (mbar_expect) and all the bytes it was told to
// expect have landed; mbar_wait(bar, parity) waits for the phase of that parity to complete.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// 16 bytes from shared address `addr` (16-byte aligned); volatile, so it stays after the waits.
__device__ __forceinline__ uint4 ld_shared16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint2 ld_shared8(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

// Multiprocessors of the current device, read once (132 if the query fails).
inline int num_sms() {
  static int n = 0;
  if (n == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    if (n <= 0) n = 132;
  }
  return n;
}

// Raises `kernel`'s dynamic shared-memory limit to `bytes` (past the default 48 KB) the first time
// it is launched on each device: the attribute is per device and per kernel, so `raised` holds the
// caller's flags for that one kernel, by device.
constexpr int kMaxDevices = 64;
template <typename Kernel>
cudaError_t raise_smem_limit(Kernel kernel, int bytes, std::atomic<bool> (&raised)[kMaxDevices]) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < kMaxDevices && raised[device].load(std::memory_order_acquire)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && device < kMaxDevices) raised[device].store(true, std::memory_order_release);
  return err;
}

}  // namespace kiln::kernels
