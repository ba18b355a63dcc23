// fp8-backends: the driver's cuTensorMapEncodeTiled for CUTLASS's TMA descriptors, looked up once per process.
//
// Include this before any CUTLASS header. Without it CUTLASS (4.2, built with nvcc > 12 and without
// CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL) asks the runtime for the driver's entry point by name
// (cudaGetDriverEntryPointByVersion) every time it encodes a TMA descriptor: several times per GEMM call, on the
// host path of every call. With CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL CUTLASS calls cuTensorMapEncodeTiled by name
// instead, which would link the library against libcuda; the name is mapped here to fp8b_encode_tiled, which calls
// the driver through a pointer looked up on first use (a function-local static: thread-safe, once). A failed lookup
// answers CUDA_ERROR_UNKNOWN, as CUTLASS's own wrapper does, and the GEMM reports a failed launch.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

namespace fp8b_tma {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn lookup_encode_tiled() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<EncodeTiledFn>(fn);
}

}  // namespace fp8b_tma

inline CUresult fp8b_encode_tiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
                                  const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                  const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                  CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
  static const fp8b_tma::EncodeTiledFn encode = fp8b_tma::lookup_encode_tiled();
  if (encode == nullptr) return CUDA_ERROR_UNKNOWN;
  return encode(map, type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, oob);
}

#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1
#define cuTensorMapEncodeTiled fp8b_encode_tiled
