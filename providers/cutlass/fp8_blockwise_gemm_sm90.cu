// fp8-backends: one CUTLASS 3.x SM90 block-scaled FP8 GEMM configuration, exported through a plain C ABI.
//
// Computes, for x: [M, K] float8_e4m3fn row-major and w: [N, K] float8_e4m3fn row-major,
//
//   out[m, n] = sum over K blocks kb of  sx[m, kb] * sw[n / 128, kb] * (x[m, kb*128 : kb*128+128] . w[n, same])
//               (+ bias[n])
//
// with 1x128 activation groups (sx: [M, ceil(K/128)] fp32) and 128x128 weight blocks (sw: [ceil(N/128),
// ceil(K/128)] fp32). The scale is applied per K block in fp32, as CUTLASS's blockwise-scaling mainloop does: each
// 128-deep K tile is accumulated by wgmma into a fresh fp32 accumulator, which is then multiplied by its scales and
// added to the running one (no FP8 fast accumulation across blocks). out is row-major [M, N] in bf16 / fp16 / fp32
// (FP8B_OUT 0 / 1 / 2); bias, when given, has the output dtype.
//
// Scale layouts (what the caller passes; nothing is copied here):
// - activation scales M-major: group kb of token m at x_scale[kb * x_scale_ld + m], x_scale_ld >= M (the transpose
//   of a contiguous [ceil(K/128), ld] buffer). Configs that load them with TMA (fp8b_block_act_scale_tma() == 1)
//   also need x_scale_ld % 4 == 0 and a 16-byte aligned pointer: the "m_major padded to 4" layout, whose padding
//   rows (m in [M, round_up(M, 4))) are read and never used.
// - weight scales K-major: block (nb, kb) at w_scale[nb * w_scale_ld + kb], w_scale_ld >= ceil(K/128) (the
//   checkpoint's row-major [ceil(N/128), ceil(K/128)] as it is).
//
// Ragged shapes: any M >= 1; N and K with 16-byte aligned rows for TMA (K % 16 == 0; N % 8 for a 2-byte output,
// N % 4 for fp32). A last K block shorter than 128 is read zero-filled by TMA and scaled by its own group / block
// scale; a last N block shorter than 128 rows uses its block's scale. Every scale is read from device memory inside
// the kernel (no host round trip, graph safe).
//
// One translation unit holds exactly one configuration, chosen at compile time by these macros (the Python build
// passes them; see providers/cutlass/block_configs.py):
//   FP8B_TILE_M, FP8B_TILE_N, FP8B_TILE_K   CTA tile of the kernel's own (possibly swapped) problem; TILE_K == 128
//   FP8B_CLUSTER_M, FP8B_CLUSTER_N          thread-block cluster shape
//   FP8B_SCHEDULE                           1 ping-pong, 2 cooperative (the blockwise mainloop has no plain schedule)
//   FP8B_STREAM_K                           1: stream-K tile scheduler (cooperative only)
//   FP8B_SWAP_AB                            1: compute out^T = w @ x^T (small M lands on the tile's N)
//   FP8B_OUT                                0 bf16, 1 fp16, 2 fp32
//   FP8B_CONFIG_NAME                        a string literal, reported by fp8b_block_describe()
//
// Only sm_90a is targeted (wgmma, TMA multicast).

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tma_encode.cuh"  // before CUTLASS: its TMA descriptors through a cached driver entry point
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
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
    !defined(FP8B_OUT) || !defined(FP8B_CONFIG_NAME)
#error "fp8_blockwise_gemm_sm90.cu is compiled by fp8_backends with every FP8B_* macro defined"
#endif

#define FP8B_BLOCK_ABI_VERSION 1
#define FP8B_STR_(x) #x
#define FP8B_STR(x) FP8B_STR_(x)

#define FP8B_EXPORT extern "C" __attribute__((visibility("default")))

namespace fp8bw {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

using ElemAB = cutlass::float_e4m3_t;
using ElemAcc = float;
using ElemD = std::conditional_t<FP8B_OUT == 0, cutlass::bfloat16_t,
                                 std::conditional_t<FP8B_OUT == 1, cutlass::half_t, float>>;

constexpr bool kSwap = FP8B_SWAP_AB != 0;
constexpr bool kStreamK = FP8B_STREAM_K != 0;
constexpr int kGroupK = 128;   // activation group along K == weight block along K
constexpr int kBlockN = 128;   // weight block along N
constexpr int kAlignAB = 16;   // elements: 16 bytes of fp8
constexpr int kAlignD = 16 / sizeof(ElemD);
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

static_assert(FP8B_SCHEDULE == 1 || FP8B_SCHEDULE == 2, "FP8B_SCHEDULE must be 1 (ping-pong) or 2 (cooperative)");
static_assert(!kStreamK || FP8B_SCHEDULE == 2, "the stream-K scheduler needs the cooperative schedule");
static_assert(FP8B_SCHEDULE != 2 || FP8B_TILE_M >= 128, "the cooperative schedule needs a tile M >= 128");
static_assert(FP8B_TILE_K == kGroupK, "one K tile is one scale block: FP8B_TILE_K must be 128");

using TileShape = Shape<Int<FP8B_TILE_M>, Int<FP8B_TILE_N>, Int<FP8B_TILE_K>>;
using ClusterShape = Shape<Int<FP8B_CLUSTER_M>, Int<FP8B_CLUSTER_N>, _1>;

// ---------------------------------------------------------------- scale layouts
// The kernel's A is x (no swap) or w (swap); its B the other one. Granularity along the kernel's M and N:
// 1 for the activation (one scale per token), 128 for the weight (one per 128-row block).
constexpr int kGranM = kSwap ? kBlockN : 1;
constexpr int kGranN = kSwap ? 1 : kBlockN;
// activation scales M-major (tokens contiguous), weight scales K-major (K blocks contiguous)
constexpr auto kMajorSFA = kSwap ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
constexpr auto kMajorSFB = kSwap ? cute::GMMA::Major::MN : cute::GMMA::Major::K;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<kGranM, kGranN, kGroupK, kMajorSFA, kMajorSFB>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

static_assert(FP8B_TILE_M % kGranM == 0 && FP8B_TILE_N % kGranN == 0,
              "the tile must cover whole weight blocks: 128 | tile M (swap) or 128 | tile N (no swap)");

// ---------------------------------------------------------------- epilogue: out = acc (+ bias[n])
// The output channel n runs along the kernel's N (no swap) or M (swap). A missing bias pointer reads as zeros.
using Bias = std::conditional_t<
    !kSwap, fusion::Sm90RowBroadcast<0, TileShape, ElemD, float, Stride<_0, _1, int64_t>, 1>,
    fusion::Sm90ColBroadcast<0, TileShape, ElemD, float, Stride<_1, _0, int64_t>, 1>>;
using Tree = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::plus, ElemD, float, kRound>, fusion::Sm90AccFetch, Bias>;

// ---------------------------------------------------------------- kernel
// A is always K-major row-major, B K-major column-major. Swap: A = w [N, K], B = x [M, K], and the kernel's D is
// the column-major [N, M] view of the row-major [M, N] output.
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = std::conditional_t<kSwap, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;

using MainSchedule = std::conditional_t<FP8B_SCHEDULE == 2,
                                        cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
                                        cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8BlockScaledAccum>;
using EpiSchedule = std::conditional_t<FP8B_SCHEDULE == 2, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                       cutlass::epilogue::TmaWarpSpecialized>;
using TileScheduler = std::conditional_t<kStreamK, cutlass::gemm::StreamKScheduler, void>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElemAcc, float, void, LayoutD, kAlignD, ElemD, LayoutD,
    kAlignD, EpiSchedule, Tree>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElemAB, cute::tuple<LayoutA, LayoutSFA>, kAlignAB, ElemAB,
    cute::tuple<LayoutB, LayoutSFB>, kAlignAB, ElemAcc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    MainSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue, TileScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using Arguments = typename Gemm::Arguments;

// Whether the activation scales travel by TMA (then they need a 16-byte aligned K-block stride and pointer) or by
// cp.async (any stride): the mainloop decides from the tile; the Python side predicts it and checks the describe
// string at load time.
constexpr bool kActScaleTma = kSwap ? CollectiveMainloop::IsTmaLoadSFB : CollectiveMainloop::IsTmaLoadSFA;
constexpr bool kWeightScaleTma = kSwap ? CollectiveMainloop::IsTmaLoadSFA : CollectiveMainloop::IsTmaLoadSFB;
static_assert(!kWeightScaleTma, "K-major weight scales are loaded with cp.async");
static_assert(kActScaleTma == (!kSwap || FP8B_TILE_N >= 32),
              "the activation-scale load path differs from what block_configs.py predicts");

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

// Gemm::run's launch (grid, block, shared memory and cluster shape are its own) without its per-call
// cudaFuncSetAttribute(NonPortableClusterSizeAllowed), which the portable cluster sizes used here never need.
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

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Activation scales, M-major: group kb of token t at ptr[kb * ld + t]. `rows` is the token extent the kernel's
// layout states: M for cp.async loads, round_up(M, 4) for TMA loads (the TMA box and stride checks want whole
// 16-byte rows; the padding rows are loaded and never used).
template <class Layout>
Layout act_scale_layout(int rows, int kb, int ld) {
  return make_layout(make_shape(make_shape(_1{}, rows), make_shape(Int<kGroupK>{}, kb), 1),
                     make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, ld), ld * kb));
}

// Weight scales, K-major: block (nb, kb) at ptr[nb * ld + kb].
template <class Layout>
Layout weight_scale_layout(int nb, int kb, int ld) {
  return make_layout(make_shape(make_shape(Int<kBlockN>{}, nb), make_shape(Int<kGroupK>{}, kb), 1),
                     make_stride(make_stride(_0{}, ld), make_stride(_0{}, _1{}), ld * nb));
}

// The token extent of the activation-scale layout, or -1 when (ld, pointer) cannot serve this config.
int64_t act_scale_rows(int64_t m, int64_t ld, const void* ptr) {
  if (ld < m) return -1;
  if constexpr (kActScaleTma) {
    if (ld % 4 != 0 || reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return -1;
    return round_up(m, 4);
  } else {
    return m;
  }
}

Arguments make_arguments(const void* x, const void* w, void* out, int m, int n, int k, const float* x_scale,
                         int act_rows, int x_scale_ld, const float* w_scale, int w_scale_ld, const void* bias,
                         int device, int sms) {
  const int km = kSwap ? n : m;
  const int kn = kSwap ? m : n;
  const int kb = static_cast<int>(ceil_div(k, kGroupK));
  const int nb = static_cast<int>(ceil_div(n, kBlockN));
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideC = typename GemmKernel::StrideC;
  using StrideD = typename GemmKernel::StrideD;

  Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {km, kn, k, 1};
  auto& ml = args.mainloop;
  ml.ptr_A = static_cast<const ElemAB*>(kSwap ? w : x);
  ml.dA = cutlass::make_cute_packed_stride(StrideA{}, make_shape(km, k, 1));
  ml.ptr_B = static_cast<const ElemAB*>(kSwap ? x : w);
  ml.dB = cutlass::make_cute_packed_stride(StrideB{}, make_shape(kn, k, 1));
  if constexpr (kSwap) {
    ml.ptr_SFA = w_scale;
    ml.layout_SFA = weight_scale_layout<LayoutSFA>(nb, kb, w_scale_ld);
    ml.ptr_SFB = x_scale;
    ml.layout_SFB = act_scale_layout<LayoutSFB>(act_rows, kb, x_scale_ld);
  } else {
    ml.ptr_SFA = x_scale;
    ml.layout_SFA = act_scale_layout<LayoutSFA>(act_rows, kb, x_scale_ld);
    ml.ptr_SFB = w_scale;
    ml.layout_SFB = weight_scale_layout<LayoutSFB>(nb, kb, w_scale_ld);
  }
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = cutlass::make_cute_packed_stride(StrideC{}, make_shape(km, kn, 1));
  args.epilogue.ptr_D = static_cast<ElemD*>(out);
  args.epilogue.dD = cutlass::make_cute_packed_stride(StrideD{}, make_shape(km, kn, 1));
  // tree arguments: {acc, bias, plus}
  args.epilogue.thread = {{}, {static_cast<const ElemD*>(bias), ElemD(0), {}}, {}};
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sms;
  return args;
}

}  // namespace fp8bw

// ---------------------------------------------------------------- C ABI

// Return codes of fp8b_block_gemm (the Python side turns them into messages).
enum : int {
  FP8B_OK = 0,
  FP8B_ERR_ARGS = 1,          // a null pointer or a non-positive / too large size
  FP8B_ERR_DEVICE = 2,        // cudaGetDevice / the SM count failed, or the device index is out of range
  FP8B_ERR_IMPLEMENT = 3,     // CUTLASS cannot run this problem (alignment, shape)
  FP8B_ERR_WORKSPACE = 4,     // the workspace given is smaller than fp8b_block_workspace_size asks for
  FP8B_ERR_INIT = 5,          // workspace initialisation failed
  FP8B_ERR_SMEM = 6,          // raising the dynamic shared memory limit failed
  FP8B_ERR_LAUNCH = 7,        // the launch failed
  FP8B_ERR_SCALE_LAYOUT = 8,  // a scale stride too small, or (TMA configs) an activation-scale stride or pointer
                              // that is not 16-byte aligned
};

FP8B_EXPORT int fp8b_block_abi_version(void) { return FP8B_BLOCK_ABI_VERSION; }

// "name;swap=S;out=O" for the loader's sanity check.
FP8B_EXPORT const char* fp8b_block_describe(void) {
  return FP8B_CONFIG_NAME ";swap=" FP8B_STR(FP8B_SWAP_AB) ";out=" FP8B_STR(FP8B_OUT);
}

// 1: the activation scales travel by TMA (x_scale_ld % 4 == 0 and a 16-byte aligned pointer needed); 0: cp.async.
FP8B_EXPORT int fp8b_block_act_scale_tma(void) { return fp8bw::kActScaleTma ? 1 : 0; }

FP8B_EXPORT size_t fp8b_block_workspace_size(int64_t m, int64_t n, int64_t k) {
  if (m <= 0 || n <= 0 || k <= 0 || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) return 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= fp8bw::kMaxDevices) {
    cudaGetLastError();
    return 0;
  }
  int sms = fp8bw::sm_count(device);
  const int kb = static_cast<int>(fp8bw::ceil_div(k, fp8bw::kGroupK));
  const int ld = static_cast<int>(fp8bw::round_up(m, 4));
  auto args = fp8bw::make_arguments(nullptr, nullptr, nullptr, static_cast<int>(m), static_cast<int>(n),
                                    static_cast<int>(k), nullptr, ld, ld, nullptr, kb, nullptr, device, sms);
  return fp8bw::Gemm::get_workspace_size(args);
}

// x: [m, k] fp8 row-major; w: [n, k] fp8 row-major; out: [m, n] row-major in the compiled output type.
// x_scale: M-major activation group scales, (t, kb) at x_scale[kb * x_scale_ld + t]; w_scale: K-major weight block
// scales, (nb, kb) at w_scale[nb * w_scale_ld + kb]; both fp32 on the device. bias: n values of the output type, or
// null. workspace: fp8b_block_workspace_size bytes (stream-K configs; may be null when that is 0).
// stream: a cudaStream_t (0 = legacy default stream).
FP8B_EXPORT int fp8b_block_gemm(const void* x, const void* w, void* out, int64_t m, int64_t n, int64_t k,
                                const float* x_scale, int64_t x_scale_ld, const float* w_scale, int64_t w_scale_ld,
                                const void* bias, void* workspace, size_t workspace_bytes, void* stream) {
  if (x == nullptr || w == nullptr || out == nullptr || x_scale == nullptr || w_scale == nullptr) return FP8B_ERR_ARGS;
  if (m <= 0 || n <= 0 || k <= 0 || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) return FP8B_ERR_ARGS;
  const int64_t kb = fp8bw::ceil_div(k, fp8bw::kGroupK);
  const int64_t nb = fp8bw::ceil_div(n, fp8bw::kBlockN);
  const int64_t act_rows = fp8bw::act_scale_rows(m, x_scale_ld, x_scale);
  if (act_rows < 0 || w_scale_ld < kb) return FP8B_ERR_SCALE_LAYOUT;
  if (x_scale_ld * kb > INT32_MAX || w_scale_ld * nb > INT32_MAX) return FP8B_ERR_ARGS;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= fp8bw::kMaxDevices) {
    cudaGetLastError();
    return FP8B_ERR_DEVICE;
  }
  int sms = fp8bw::sm_count(device);
  if (sms <= 0) return FP8B_ERR_DEVICE;
  auto args = fp8bw::make_arguments(x, w, out, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), x_scale,
                                    static_cast<int>(act_rows), static_cast<int>(x_scale_ld), w_scale,
                                    static_cast<int>(w_scale_ld), bias, device, sms);
  if (fp8bw::Gemm::can_implement(args) != cutlass::Status::kSuccess) return FP8B_ERR_IMPLEMENT;
  if (fp8bw::Gemm::get_workspace_size(args) > workspace_bytes) return FP8B_ERR_WORKSPACE;
  auto cu_stream = static_cast<cudaStream_t>(stream);
  if (fp8bw::GemmKernel::initialize_workspace(args, workspace, cu_stream, nullptr) != cutlass::Status::kSuccess) {
    return FP8B_ERR_INIT;
  }
  auto params = fp8bw::GemmKernel::to_underlying_arguments(args, workspace);
  if (!fp8bw::ensure_smem_attribute(device)) return FP8B_ERR_SMEM;
  if (fp8bw::launch_gemm(params, cu_stream) != cudaSuccess) {
    cudaGetLastError();
    return FP8B_ERR_LAUNCH;
  }
  if (cudaGetLastError() != cudaSuccess) return FP8B_ERR_LAUNCH;
  return FP8B_OK;
}
