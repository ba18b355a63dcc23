// fp8-backends: one CUTLASS 3.x SM90 FP8 GEMM configuration, exported through a plain C ABI.
//
// Computes, for x: [M, K] float8_e4m3fn row-major and w: [N, K] float8_e4m3fn row-major,
//
//   out[M, N] = (s_x * s_w) * (x @ w^T) (+ bias[N])          (FP8B_EPILOGUE == 0, per-tensor)
//   out[m, n] = s_x[m] * (s_w[n] * (x @ w^T)[m, n]) (+ bias[n]) (FP8B_EPILOGUE == 1, row-wise)
//
// out is row-major [M, N] in bf16 / fp16 / fp32 (FP8B_OUT 0 / 1 / 2); bias has the output dtype.
// Every scale is read from device memory inside the epilogue (no host round trip, graph safe).
// In the row-wise epilogue either scale may be one value (per-tensor) or a vector: the caller says
// which with the *_vec flags, so one kernel serves every mix of per-tensor / per-token / per-channel.
//
// One translation unit holds exactly one configuration, chosen at compile time by these macros
// (the Python build passes them; see providers/cutlass/configs.py):
//   FP8B_TILE_M, FP8B_TILE_N, FP8B_TILE_K   CTA tile of the kernel's own (possibly swapped) problem
//   FP8B_CLUSTER_M, FP8B_CLUSTER_N          thread-block cluster shape
//   FP8B_SCHEDULE                           0 warp-specialized, 1 ping-pong, 2 cooperative
//   FP8B_STREAM_K                           1: stream-K tile scheduler (cooperative only)
//   FP8B_SWAP_AB                            1: compute out^T = w @ x^T (small M lands on the tile's N)
//   FP8B_EPILOGUE                           0 per-tensor scalars, 1 row/column vectors
//   FP8B_OUT                                0 bf16, 1 fp16, 2 fp32
//   FP8B_FAST_ACCUM                         1: FP8 fast accumulation, 0: periodic promotion to fp32
//   FP8B_CONFIG_NAME                        a string literal, reported by fp8b_describe()
//
// Only sm_90a is targeted. SM100 (Blackwell) needs its own tcgen05 kernels and is not built here.

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tma_encode.cuh"  // before CUTLASS: its TMA descriptors through a cached driver entry point
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

#if !defined(FP8B_TILE_M) || !defined(FP8B_TILE_N) || !defined(FP8B_TILE_K) || !defined(FP8B_CLUSTER_M) || \
    !defined(FP8B_CLUSTER_N) || !defined(FP8B_SCHEDULE) || !defined(FP8B_STREAM_K) || !defined(FP8B_SWAP_AB) ||   \
    !defined(FP8B_EPILOGUE) || !defined(FP8B_OUT) || !defined(FP8B_FAST_ACCUM) || !defined(FP8B_CONFIG_NAME)
#error "fp8_gemm_sm90.cu is compiled by fp8_backends with every FP8B_* macro defined"
#endif

#define FP8B_ABI_VERSION 1
#define FP8B_STR_(x) #x
#define FP8B_STR(x) FP8B_STR_(x)

#define FP8B_EXPORT extern "C" __attribute__((visibility("default")))

namespace fp8b {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

using ElemAB = cutlass::float_e4m3_t;
using ElemAcc = float;
using ElemD = std::conditional_t<FP8B_OUT == 0, cutlass::bfloat16_t,
                                 std::conditional_t<FP8B_OUT == 1, cutlass::half_t, float>>;

constexpr bool kSwap = FP8B_SWAP_AB != 0;
constexpr bool kRowwise = FP8B_EPILOGUE != 0;
constexpr bool kStreamK = FP8B_STREAM_K != 0;
constexpr bool kFastAccum = FP8B_FAST_ACCUM != 0;
constexpr int kAlignAB = 16;                   // elements: 16 bytes of fp8
constexpr int kAlignD = 16 / sizeof(ElemD);    // 16 bytes of the output type
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

static_assert(FP8B_SCHEDULE >= 0 && FP8B_SCHEDULE <= 2, "FP8B_SCHEDULE must be 0, 1 or 2");
static_assert(!kStreamK || FP8B_SCHEDULE == 2, "the stream-K scheduler needs the cooperative schedule");
static_assert(FP8B_SCHEDULE != 2 || FP8B_TILE_M >= 128, "the cooperative schedule needs a tile M >= 128");

using TileShape = Shape<Int<FP8B_TILE_M>, Int<FP8B_TILE_N>, Int<FP8B_TILE_K>>;
using ClusterShape = Shape<Int<FP8B_CLUSTER_M>, Int<FP8B_CLUSTER_N>, _1>;

// ---------------------------------------------------------------- schedules
template <int Schedule, bool Fast>
struct Schedules;
template <>
struct Schedules<0, true> {
  using Main = cutlass::gemm::KernelTmaWarpSpecializedFP8FastAccum;
  using Epi = cutlass::epilogue::TmaWarpSpecialized;
};
template <>
struct Schedules<0, false> {
  using Main = cutlass::gemm::KernelTmaWarpSpecialized;
  using Epi = cutlass::epilogue::TmaWarpSpecialized;
};
template <>
struct Schedules<1, true> {
  using Main = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;
  using Epi = cutlass::epilogue::TmaWarpSpecialized;
};
template <>
struct Schedules<1, false> {
  using Main = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epi = cutlass::epilogue::TmaWarpSpecialized;
};
template <>
struct Schedules<2, true> {
  using Main = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
  using Epi = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
template <>
struct Schedules<2, false> {
  using Main = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epi = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
using Sched = Schedules<FP8B_SCHEDULE, kFastAccum>;
using TileScheduler = std::conditional_t<kStreamK, cutlass::gemm::StreamKScheduler, void>;

// ---------------------------------------------------------------- epilogue trees
// The output channel n runs along the kernel's N (no swap) or M (swap); the token m the other way.
constexpr bool kChannelAlongN = !kSwap;
constexpr bool kTokenAlongN = kSwap;

// A vector over output channels (the bias), always a vector; a missing pointer reads as zeros.
template <class T, bool AlongN>
using ChannelVector =
    std::conditional_t<AlongN, fusion::Sm90RowBroadcast<0, TileShape, T, float, Stride<_0, _1, int64_t>, 1>,
                       fusion::Sm90ColBroadcast<0, TileShape, T, float, Stride<_1, _0, int64_t>, 1>>;
// A scale that is either one value or a vector, decided per call (dynamic broadcast stride).
template <bool AlongN>
using ScalarOrVector =
    std::conditional_t<AlongN, fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, bool, int64_t>, 1>,
                       fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<bool, _0, int64_t>, 1>>;

using Bias = ChannelVector<ElemD, kChannelAlongN>;

// per-tensor: out = (s_x * s_w) * acc + bias; the scalar node multiplies its two device scalars
using AlphaProduct = fusion::Sm90ScalarBroadcast<float, Stride<_0, _0, int64_t>, 2>;
using PerTensorTree = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElemD, float, kRound>,
                                      AlphaProduct, fusion::Sm90AccFetch, Bias>;

// row-wise: out = s_x[m] * (s_w[n] * acc) + bias[n]
using TokenScale = ScalarOrVector<kTokenAlongN>;
using ChannelScale = ScalarOrVector<kChannelAlongN>;
using ChannelScaled =
    fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, ChannelScale, fusion::Sm90AccFetch>;
using RowwiseTree = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElemD, float, kRound>,
                                    TokenScale, ChannelScaled, Bias>;

using Tree = std::conditional_t<kRowwise, RowwiseTree, PerTensorTree>;

// ---------------------------------------------------------------- kernel
// Operand layouts of the kernel's problem: A is always K-major row-major, B K-major column-major.
// No swap: A = x [M, K], B = w [N, K]. Swap: A = w [N, K], B = x [M, K], and the kernel's D is the
// column-major [N, M] view of the row-major [M, N] output.
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = std::conditional_t<kSwap, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElemAcc, float, void, LayoutD, kAlignD, ElemD, LayoutD,
    kAlignD, typename Sched::Epi, Tree>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElemAB, LayoutA, kAlignAB, ElemAB, LayoutB, kAlignAB,
    ElemAcc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    typename Sched::Main>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue, TileScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using Arguments = typename Gemm::Arguments;

// ---------------------------------------------------------------- per-device state
constexpr int kMaxDevices = 64;
std::atomic<int> g_sm_count[kMaxDevices];
std::atomic<bool> g_smem_attr_set[kMaxDevices];

int sm_count(int device) {
  int n = g_sm_count[device].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      return 0;
    }
    g_sm_count[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// The kernel's dynamic shared memory exceeds the 48 KB default: raise the limit once per device.
bool ensure_smem_attribute(int device) {
  if (g_smem_attr_set[device].load(std::memory_order_acquire)) return true;
  constexpr int smem = GemmKernel::SharedStorageSize;
  if (smem >= (48 << 10)) {
    if (cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess) {
      cudaGetLastError();
      return false;
    }
  }
  g_smem_attr_set[device].store(true, std::memory_order_release);
  return true;
}

// Gemm::run's launch, minus what it does at every call that a launch needs once: its cluster path calls
// cudaFuncSetAttribute(NonPortableClusterSizeAllowed) before each launch (a driver call on the host's hot path), an
// attribute the portable cluster sizes used here (at most 2) never need. Grid, block, shared memory and the cluster
// shape are Gemm::run's own.
cudaError_t launch_gemm(typename GemmKernel::Params& params, cudaStream_t stream) {
  constexpr int kClusterM = cute::size<0>(ClusterShape{});
  constexpr int kClusterN = cute::size<1>(ClusterShape{});
  cudaLaunchConfig_t config{};
  config.gridDim = Gemm::get_grid_shape(params);
  config.blockDim = GemmKernel::get_block_shape();
  config.dynamicSmemBytes = GemmKernel::SharedStorageSize;
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  if constexpr (kClusterM * kClusterN > 1) {
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = kClusterM;
    cluster[0].val.clusterDim.y = kClusterN;
    cluster[0].val.clusterDim.z = 1;
    config.attrs = cluster;
    config.numAttrs = 1;
  }
  void* args[] = {&params};
  return cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(cutlass::device_kernel<GemmKernel>), args);
}

template <class Bcast>
typename Bcast::StrideMNL dynamic_stride(bool vector) {
  using S = typename Bcast::StrideMNL;
  if constexpr (std::is_same_v<std::remove_cv_t<std::remove_reference_t<decltype(get<0>(S{}))>>, bool>) {
    return S{vector, _0{}, int64_t(0)};
  } else {
    return S{_0{}, vector, int64_t(0)};
  }
}

// A template so that `if constexpr` discards the epilogue branch this configuration does not use.
template <bool Rowwise = kRowwise>
Arguments make_arguments(const void* x, const void* w, void* out, int m, int n, int k, const float* x_scale,
                         bool x_vec, const float* w_scale, bool w_vec, const void* bias, int device, int sms) {
  const int km = kSwap ? n : m;
  const int kn = kSwap ? m : n;
  const auto* a = static_cast<const ElemAB*>(kSwap ? w : x);
  const auto* b = static_cast<const ElemAB*>(kSwap ? x : w);
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideC = typename GemmKernel::StrideC;
  using StrideD = typename GemmKernel::StrideD;

  Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {km, kn, k, 1};
  args.mainloop.ptr_A = a;
  args.mainloop.dA = cutlass::make_cute_packed_stride(StrideA{}, make_shape(km, k, 1));
  args.mainloop.ptr_B = b;
  args.mainloop.dB = cutlass::make_cute_packed_stride(StrideB{}, make_shape(kn, k, 1));
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = cutlass::make_cute_packed_stride(StrideC{}, make_shape(km, kn, 1));
  args.epilogue.ptr_D = static_cast<ElemD*>(out);
  args.epilogue.dD = cutlass::make_cute_packed_stride(StrideD{}, make_shape(km, kn, 1));

  const auto* bias_ptr = static_cast<const ElemD*>(bias);
  if constexpr (Rowwise) {
    // tree arguments: {token scale, {channel scale, acc, multiply}, bias, multiply-add}
    args.epilogue.thread = {
        {x_scale, 0.f, dynamic_stride<TokenScale>(x_vec)},
        {{w_scale, 0.f, dynamic_stride<ChannelScale>(w_vec)}, {}, {}},
        {bias_ptr, ElemD(0), {}},
        {}};
  } else {
    (void)x_vec;
    (void)w_vec;
    args.epilogue.thread = {{{1.f, 1.f}, {x_scale, w_scale}, {}}, {}, {bias_ptr, ElemD(0), {}}, {}};
  }
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sms;
  return args;
}

}  // namespace fp8b

// ---------------------------------------------------------------- C ABI

// Return codes of fp8b_gemm (the Python side turns them into messages).
enum : int {
  FP8B_OK = 0,
  FP8B_ERR_ARGS = 1,         // a null pointer, a non-positive size, or vector scales given to the per-tensor epilogue
  FP8B_ERR_DEVICE = 2,       // cudaGetDevice / the SM count failed, or the device index is out of range
  FP8B_ERR_IMPLEMENT = 3,    // CUTLASS cannot run this problem (alignment, shape)
  FP8B_ERR_WORKSPACE = 4,    // the workspace given is smaller than fp8b_workspace_size asks for
  FP8B_ERR_INIT = 5,         // workspace initialisation failed
  FP8B_ERR_SMEM = 6,         // raising the dynamic shared memory limit failed
  FP8B_ERR_LAUNCH = 7,       // the launch failed
};

FP8B_EXPORT int fp8b_abi_version(void) { return FP8B_ABI_VERSION; }

// "name;swap;epilogue;out;fast_accum" for the loader's sanity check.
FP8B_EXPORT const char* fp8b_describe(void) {
  return FP8B_CONFIG_NAME ";swap=" FP8B_STR(FP8B_SWAP_AB) ";epilogue=" FP8B_STR(FP8B_EPILOGUE) ";out=" FP8B_STR(
      FP8B_OUT) ";fast_accum=" FP8B_STR(FP8B_FAST_ACCUM);
}

FP8B_EXPORT size_t fp8b_workspace_size(int64_t m, int64_t n, int64_t k) {
  if (m <= 0 || n <= 0 || k <= 0) return 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= fp8b::kMaxDevices) {
    cudaGetLastError();
    return 0;
  }
  int sms = fp8b::sm_count(device);
  float one = 1.f;
  auto args = fp8b::make_arguments(nullptr, nullptr, nullptr, static_cast<int>(m), static_cast<int>(n),
                                   static_cast<int>(k), &one, false, &one, false, nullptr, device, sms);
  return fp8b::Gemm::get_workspace_size(args);
}

// x: [m, k] fp8 row-major; w: [n, k] fp8 row-major; out: [m, n] row-major in the compiled output type.
// x_scale: 1 value, or m values when x_scale_vec; w_scale: 1 value, or n values when w_scale_vec.
// bias: n values of the output type, or null. stream: a cudaStream_t (0 = legacy default stream).
FP8B_EXPORT int fp8b_gemm(const void* x, const void* w, void* out, int64_t m, int64_t n, int64_t k,
                          const float* x_scale, int x_scale_vec, const float* w_scale, int w_scale_vec,
                          const void* bias, void* workspace, size_t workspace_bytes, void* stream) {
  if (x == nullptr || w == nullptr || out == nullptr || x_scale == nullptr || w_scale == nullptr) return FP8B_ERR_ARGS;
  if (m <= 0 || n <= 0 || k <= 0 || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) return FP8B_ERR_ARGS;
  if (!fp8b::kRowwise && (x_scale_vec || w_scale_vec)) return FP8B_ERR_ARGS;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= fp8b::kMaxDevices) {
    cudaGetLastError();
    return FP8B_ERR_DEVICE;
  }
  int sms = fp8b::sm_count(device);
  if (sms <= 0) return FP8B_ERR_DEVICE;
  auto args = fp8b::make_arguments(x, w, out, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), x_scale,
                                   x_scale_vec != 0, w_scale, w_scale_vec != 0, bias, device, sms);
  if (fp8b::Gemm::can_implement(args) != cutlass::Status::kSuccess) return FP8B_ERR_IMPLEMENT;
  if (fp8b::Gemm::get_workspace_size(args) > workspace_bytes) return FP8B_ERR_WORKSPACE;
  auto cu_stream = static_cast<cudaStream_t>(stream);
  if (fp8b::GemmKernel::initialize_workspace(args, workspace, cu_stream, nullptr) != cutlass::Status::kSuccess) {
    return FP8B_ERR_INIT;
  }
  auto params = fp8b::GemmKernel::to_underlying_arguments(args, workspace);
  if (!fp8b::ensure_smem_attribute(device)) return FP8B_ERR_SMEM;
  if (fp8b::launch_gemm(params, cu_stream) != cudaSuccess) {
    cudaGetLastError();
    return FP8B_ERR_LAUNCH;
  }
  if (cudaGetLastError() != cudaSuccess) return FP8B_ERR_LAUNCH;
  return FP8B_OK;
}
