// fp8_backends::cutlass_sm90_gemm_native and cutlass_sm90_linear_native: the CUTLASS provider's ops with a C++ body.
//
// The Python op (fp8_backends::cutlass_sm90_gemm, providers/cutlass/ops.py) picks the kernel config,
// allocates the output and calls fp8b_gemm through ctypes: ~10 µs of Python per call on a fast host, several
// times that on a slow one, paid at every call of a compiled graph (the op is opaque to Inductor). This op does
// the same work in C++, from the dispatcher, with no Python frame:
//
//   out[M, N] = x_scale * w_scale * (x[M, K] @ w[N, K]^T) (+ bias[N])     (float8_e4m3fn inputs)
//
// It knows only what Python registered through the extern "C" functions below:
//   - the loaded kernel libraries: key "config|epilogue|out_dtype|fast_accum" -> fp8b_gemm, fp8b_workspace_size,
//     whether the config is stream-K (needs a workspace);
//   - per (N, K), the M buckets of the dispatch table (config=auto).
// Anything it does not know, and every failure (an unaligned pointer, a non-zero return code), is handed to the
// fallback op (the Python one) through the dispatcher with the same arguments: that op builds or loads the
// library, registers it here and raises the library's own exceptions. So a miss costs one Python call, once.
//
// cutlass_sm90_linear_native takes the unquantized activation x [M, K] (bf16, fp16 or fp32, any strides: a row-strided
// slice, a transposed view, broadcast rows) and quantizes it to row-major float8_e4m3fn itself before the same GEMM: one dispatcher call for an eager linear instead of
// a quantization launch plus the GEMM op. Its kernels compute what fp8_backends.core.reference does:
//   static     x_q = clamp(x / s, +-448) -> e4m3, s the layer's input scale (device memory, never read on the host)
//   dynamic    s = max(amax(|x|) / 448, 1e-12) ([1]), then as static
//   per-token  s[m] = max(amax(|x[m, :]|) / 448, 1e-12) ([M, 1]), then as static per row
// with NaN propagated as torch propagates it (amax, clamp_min and clamp keep a NaN). Per call it allocates one buffer
// (x_q, then from a 16-byte boundary its fp32 words: the scale(s) and the dynamic mode's partial maxima) and launches
// one quantization kernel: blocks stride over (row, 2048-column chunk) items with 16-byte loads where every row
// starts on a 16-byte boundary and columns are contiguous (scalar loads at the column stride otherwise); dynamic per-tensor is one cooperative launch (partial
// maxima, a grid barrier, every block reduces them and quantizes), or two launches where a cooperative one fails.
// Kernels are found by config name, then by epilogue / output dtype / accumulation slot: no string is built per call.
//
// cutlass_sm90_block_gemm_native is the block-scaled family's op (fp8_backends::cutlass_sm90_block_gemm in
// providers/cutlass/block_ops.py, 1x128 activation groups x 128x128 weight blocks) done the same way: Python registers
// each loaded block library ("config|out_dtype" -> fp8b_block_gemm, fp8b_block_workspace_size, stream-K, whether it
// loads the activation scales by TMA) and the block table's M buckets per (N, K); the op checks what the Python op
// checks (dtypes, shapes, row-major 16-byte aligned operands, the activation scales' M-major layout with the padding a
// TMA config reads, K-major weight scales) and hands every other call to the Python op, which copies a scale layout the
// kernel cannot read and raises the library's errors.
//
// cutlass_sm90_block_linear_native is the block family's fused op: it takes the unquantized activation x [M, K]
// (bf16, fp16 or fp32, any strides), quantizes it per token in groups of 128 along K in one kernel (each group's scale
// max(amax(|x|) / 448, 1e-12), NaN kept, the codes as above: fp8_backends.core.reference.quantize_groups' formulas
// with correctly rounded divisions, the codes of the library's Triton group-quant kernel), writing the
// scales M-major with the column stride rounded up to 4 tokens (the layout every block config reads, TMA or not), and
// runs the block GEMM on them: one dispatcher call per linear where quantize + GEMM took a quantization launch from
// Python (the group-quant op) and the GEMM op.
//
// Built at first use by providers/cutlass/native_op.py with nvcc against torch's headers (FP8B_CPU_TEST: a
// CPU-key build with the host C++ compiler for the CPU tests: no CUDA, the stream argument null, the quantization
// through ATen ops).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#ifndef FP8B_CPU_TEST
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cooperative_groups.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#else
#include <ATen/ops/abs.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/clamp_min.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/div.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using GemmFn = int (*)(const void*, const void*, void*, int64_t, int64_t, int64_t, const void*, int, const void*, int,
                       const void*, void*, size_t, void*);
using WorkspaceFn = size_t (*)(int64_t, int64_t, int64_t);

struct Kernel {
  GemmFn gemm = nullptr;
  WorkspaceFn workspace = nullptr;
  bool stream_k = false;
};

// One config's libraries: [epilogue: tensor, rowwise][out: bfloat16, float16, float32][fast_accum: 0, 1]
struct Slots {
  Kernel k[2][3][2];
};

struct Buckets {
  std::vector<int64_t> bounds;      // inclusive upper M bound of each bucket but the last
  std::vector<std::string> names;   // one config name per bucket (bounds.size() + 1)
};

struct ShapeHash {
  size_t operator()(const std::pair<int64_t, int64_t>& p) const noexcept {
    return std::hash<int64_t>()(p.first * 1000003 + p.second);
  }
};

std::shared_mutex g_mutex;
std::unordered_map<std::string, Slots> g_kernels;  // config name -> its libraries
std::unordered_map<std::pair<int64_t, int64_t>, Buckets, ShapeHash> g_tables;
std::string g_fallback = "fp8_backends::cutlass_sm90_gemm";
std::string g_block_fallback = "fp8_backends::cutlass_sm90_block_gemm";
int64_t g_native_calls = 0;    // calls served here (for tests and diagnostics; relaxed, under no lock)
int64_t g_fallback_calls = 0;  // calls handed to the fallback op

int out_slot(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return 0;
    case at::kHalf: return 1;
    case at::kFloat: return 2;
    default: return -1;
  }
}

int out_slot(const std::string& name) {
  if (name == "bfloat16") return 0;
  if (name == "float16") return 1;
  if (name == "float32") return 2;
  return -1;
}

// Hand a call to the Python op named by `slot` (g_fallback or g_block_fallback) through the dispatcher, with the same
// operands, out_dtype and config, and fast_accum where the op takes it (the per-tensor / row-wise one).
at::Tensor call_fallback(const std::string& slot, const at::Tensor& x, const at::Tensor& w, const at::Tensor& x_scale,
                         const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                         c10::string_view config, std::optional<bool> fast_accum) {
  std::string name;
  {
    std::shared_lock<std::shared_mutex> lock(g_mutex);
    name = slot;
  }
  __atomic_add_fetch(&g_fallback_calls, 1, __ATOMIC_RELAXED);
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
  torch::jit::Stack stack;
  stack.reserve(8);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(x_scale);
  stack.emplace_back(w_scale);
  if (bias.has_value()) {
    stack.emplace_back(*bias);
  } else {
    stack.emplace_back(c10::IValue());
  }
  stack.emplace_back(static_cast<int64_t>(out_dtype));
  stack.emplace_back(std::string(config));
  if (fast_accum.has_value()) stack.emplace_back(*fast_accum);
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

at::Tensor fallback(const at::Tensor& x, const at::Tensor& w, const at::Tensor& x_scale, const at::Tensor& w_scale,
                    const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, c10::string_view config,
                    bool fast_accum) {
  return call_fallback(g_fallback, x, w, x_scale, w_scale, bias, out_dtype, config, fast_accum);
}

bool aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; }

// The registered library for this call, or false (not registered, or an operand not 16-byte aligned). Builds no
// string: "auto" reads the (N, K) bucket's name, an explicit config is looked up as given.
bool find_kernel(const void* xq, const void* wp, int64_t m, int64_t n, int64_t k, bool rowwise, at::ScalarType out_dtype,
                 c10::string_view config, bool fast_accum, Kernel* found) {
  const int slot = out_slot(out_dtype);
  if (slot < 0 || !aligned(xq) || !aligned(wp)) return false;
  std::shared_lock<std::shared_mutex> lock(g_mutex);
  decltype(g_kernels)::const_iterator kt;
  if (config == "auto") {
    auto it = g_tables.find({n, k});
    if (it == g_tables.end()) return false;
    const Buckets& b = it->second;
    const size_t i = std::lower_bound(b.bounds.begin(), b.bounds.end(), m) - b.bounds.begin();
    kt = g_kernels.find(b.names[i]);
  } else {
    kt = g_kernels.find(std::string(config));  // config names fit the small-string buffer: no allocation
  }
  if (kt == g_kernels.end()) return false;
  const Kernel& kernel = kt->second.k[rowwise ? 1 : 0][slot][fast_accum ? 1 : 0];
  if (kernel.gemm == nullptr) return false;
  *found = kernel;
  return true;
}

void* current_stream(const at::Tensor& x) {
#ifdef FP8B_CPU_TEST
  (void)x;
  return nullptr;
#else
  return c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
#endif
}

// out[M, N] from x_q (M x K e4m3, row-major at xq) through a registered library, or false (nothing ran: the caller
// hands the call to the fallback op). x_scale: 1 value, or M when x_vec.
bool gemm_native(const void* xq, int64_t m, int64_t k, const at::Tensor& w, const void* x_scale, bool x_vec,
                 const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                 c10::string_view config, bool fast_accum, const at::Tensor& like, void* stream, at::Tensor* y) {
  const int64_t n = w.size(0);
  const bool w_vec = w_scale.numel() > 1;
  Kernel kernel;
  if (!find_kernel(xq, w.data_ptr(), m, n, k, x_vec || w_vec, out_dtype, config, fast_accum, &kernel)) return false;
  at::Tensor out = at::empty({m, n}, like.options().dtype(out_dtype));
  at::Tensor workspace;
  size_t ws_bytes = 0;
  if (kernel.stream_k && kernel.workspace != nullptr) {
    ws_bytes = kernel.workspace(m, n, k);
    if (ws_bytes > 0) {
      workspace = at::empty({static_cast<int64_t>(ws_bytes)}, like.options().dtype(at::kByte));
    }
  }
  const int rc = kernel.gemm(xq, w.data_ptr(), out.data_ptr(), m, n, k, x_scale, x_vec ? 1 : 0, w_scale.data_ptr(),
                             w_vec ? 1 : 0, bias.has_value() ? bias->data_ptr() : nullptr,
                             ws_bytes > 0 ? workspace.data_ptr() : nullptr, ws_bytes, stream);
  if (rc != 0) return false;  // nothing ran: the Python op reruns the call and raises with the code's meaning
  __atomic_add_fetch(&g_native_calls, 1, __ATOMIC_RELAXED);
  *y = std::move(out);
  return true;
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& x_scale, const at::Tensor& w_scale,
                const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, c10::string_view config,
                bool fast_accum) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "cutlass_sm90_gemm_native: x and w must be 2-D");
  const int64_t m = x.size(0), k = x.size(1);
  if (m == 0) {
    if (out_slot(out_dtype) < 0) return fallback(x, w, x_scale, w_scale, bias, out_dtype, config, fast_accum);
    return at::empty({0, w.size(0)}, x.options().dtype(out_dtype));
  }
#ifndef FP8B_CPU_TEST
  const c10::cuda::CUDAGuard guard(x.device());
#endif
  at::Tensor y;
  if (gemm_native(x.data_ptr(), m, k, w, x_scale.data_ptr(), x_scale.numel() > 1, w_scale, bias, out_dtype, config,
                  fast_accum, x, current_stream(x), &y)) {
    return y;
  }
  return fallback(x, w, x_scale, w_scale, bias, out_dtype, config, fast_accum);
}


// ------------------------------------------------------------------------------------------ quantization
constexpr float kFp8Max = 448.0f;       // float8_e4m3fn
constexpr float kMinScale = 1e-12f;     // fp8_backends.core.reference.MIN_DYNAMIC_SCALE

enum class Mode { kStatic, kDynamic, kToken };

bool mode_of(c10::string_view mode, Mode* out) {
  if (mode == "per_tensor_static") { *out = Mode::kStatic; return true; }
  if (mode == "per_tensor_dynamic") { *out = Mode::kDynamic; return true; }
  if (mode == "per_token") { *out = Mode::kToken; return true; }
  return false;
}

// One buffer per call for x_q ([M, K] e4m3, row-major, at offset 0) and its fp32 words (from a 16-byte boundary):
// the scale ([1] dynamic, [M] per token; none static) and the dynamic mode's per-block partial maxima.
int64_t fp32_offset(int64_t m, int64_t k) { return (m * k + 15) / 16 * 16; }

#ifndef FP8B_CPU_TEST
constexpr int kThreads = 256;
constexpr int kVec = 8;                      // elements per thread per step (16 bytes of bf16 / fp16)
constexpr int64_t kChunk = kThreads * kVec;  // elements of one row a block covers per step

__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

__device__ __forceinline__ float scale_of(float amax) {  // (amax / fmax).clamp_min(1e-12), NaN kept
  const float v = amax / kFp8Max;
  return (v != v || v >= kMinScale) ? v : kMinScale;
}

__device__ __forceinline__ uint8_t to_fp8(float x, float s) {  // clamp(x / s, +-fmax) -> e4m3 (NaN kept)
  float v = x / s;
  if (v == v) v = fminf(fmaxf(v, -kFp8Max), kFp8Max);
  return __nv_fp8_e4m3(v).__x;
}

// kVec elements of a row from `src` (16-byte aligned and contiguous when Vec; else `cs` elements apart) into v; past
// `left` (the row's remaining elements) 0.
template <typename T, bool Vec>
__device__ __forceinline__ void load8(const T* src, int64_t left, int64_t cs, float* v) {
  if (Vec && left >= kVec) {
    alignas(16) T tmp[kVec];
#pragma unroll
    for (int w = 0; w < int(sizeof(tmp) / 16); ++w) reinterpret_cast<uint4*>(tmp)[w] = reinterpret_cast<const uint4*>(src)[w];
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = static_cast<float>(tmp[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = i < left ? static_cast<float>(src[i * cs]) : 0.0f;
  }
}

template <bool Vec>
__device__ __forceinline__ void store8(uint8_t* dst, int64_t left, const float* v, float s) {
  if (Vec && left >= kVec) {
    alignas(8) uint8_t tmp[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) tmp[i] = to_fp8(v[i], s);
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(tmp);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      if (i < left) dst[i] = to_fp8(v[i], s);
    }
  }
}

__device__ __forceinline__ float block_nan_max(float v, float* shared) {  // blockDim.x a multiple of 32, <= 1024
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // shared may still be read by an earlier call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? shared[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}

// Work items: (row, chunk of kChunk columns), items = M * chunks_per_row, strided over the grid. x's element (r, c) is
// at r * row_stride + c * col_stride; x_q is row-major (r * k + c).
struct Items {
  int64_t k, row_stride, col_stride, per_row, total;
};

template <typename T, bool Vec>
__device__ float items_amax(const T* __restrict__ x, const Items& it) {
  float v = 0.0f;
  for (int64_t item = blockIdx.x; item < it.total; item += gridDim.x) {
    const int64_t r = item / it.per_row, c = (item - r * it.per_row) * kChunk + threadIdx.x * kVec;
    if (c < it.k) {
      float e[kVec];
      load8<T, Vec>(x + r * it.row_stride + c * it.col_stride, it.k - c, it.col_stride, e);
#pragma unroll
      for (int i = 0; i < kVec; ++i) v = nan_max(v, fabsf(e[i]));
    }
  }
  return v;
}

template <typename T, bool Vec>
__device__ void items_quant(const T* __restrict__ x, uint8_t* __restrict__ q, const Items& it, float s) {
  for (int64_t item = blockIdx.x; item < it.total; item += gridDim.x) {
    const int64_t r = item / it.per_row, c = (item - r * it.per_row) * kChunk + threadIdx.x * kVec;
    if (c < it.k) {
      float e[kVec];
      load8<T, Vec>(x + r * it.row_stride + c * it.col_stride, it.k - c, it.col_stride, e);
      store8<Vec>(q + r * it.k + c, it.k - c, e, s);
    }
  }
}

template <typename T, bool Vec>
__global__ void __launch_bounds__(kThreads) quant_static_kernel(const T* __restrict__ x, Items it,
                                                                const float* __restrict__ scale,
                                                                uint8_t* __restrict__ q) {
  items_quant<T, Vec>(x, q, it, *scale);
}

// Dynamic per-tensor. Phase 0: the whole thing in one cooperative launch (partial maxima, grid barrier, every block
// reduces the partials, quantizes); 1: partial maxima only; 2: reduce them and quantize (phases 1 + 2: two launches
// where a cooperative one is not possible). partial[b] is block b's maximum; *scale is written by block 0.
template <typename T, bool Vec, int Phase>
__global__ void __launch_bounds__(kThreads) quant_dynamic_kernel(const T* __restrict__ x, Items it,
                                                                 float* __restrict__ partial, int n_partial,
                                                                 float* __restrict__ scale, uint8_t* __restrict__ q) {
  __shared__ float shared[32];
  if constexpr (Phase != 2) {
    const float v = block_nan_max(items_amax<T, Vec>(x, it), shared);
    if (threadIdx.x == 0) partial[blockIdx.x] = v;
    if constexpr (Phase == 1) {
      return;
    } else {
      __threadfence();
      cooperative_groups::this_grid().sync();
    }
  }
  float v = 0.0f;
  for (int i = threadIdx.x; i < n_partial; i += blockDim.x) v = nan_max(v, partial[i]);
  const float s = scale_of(block_nan_max(v, shared));
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale = s;
  items_quant<T, Vec>(x, q, it, s);
}

template <typename T, bool Vec>
__global__ void __launch_bounds__(kThreads) quant_token_kernel(const T* __restrict__ x, int64_t row_stride,
                                                               int64_t col_stride, int64_t k,
                                                               float* __restrict__ scale, uint8_t* __restrict__ q) {
  __shared__ float shared[32];  // one block per row
  const T* row = x + blockIdx.x * row_stride;
  uint8_t* out = q + blockIdx.x * k;
  float v = 0.0f;
  for (int64_t c = threadIdx.x * kVec; c < k; c += kChunk) {
    float e[kVec];
    load8<T, Vec>(row + c * col_stride, k - c, col_stride, e);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v = nan_max(v, fabsf(e[i]));
  }
  const float s = scale_of(block_nan_max(v, shared));
  if (threadIdx.x == 0) scale[blockIdx.x] = s;
  for (int64_t c = threadIdx.x * kVec; c < k; c += kChunk) {
    float e[kVec];
    load8<T, Vec>(row + c * col_stride, k - c, col_stride, e);
    store8<Vec>(out + c, k - c, e, s);
  }
}

constexpr int kMaxDevices = 64;
constexpr int kMaxBlocks = 4096;  // grid cap of the item loops

// Blocks of a cooperative dynamic launch that fit the device at once (cached per device and instantiation; 0: none).
template <typename T, bool Vec>
int cooperative_blocks(int device) {
  static std::atomic<int> cache[kMaxDevices];  // 0 unknown, -1 no cooperative launch, else the block count
  int n = cache[device].load(std::memory_order_relaxed);
  if (n == 0) {
    int coop = 0, sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, quant_dynamic_kernel<T, Vec, 0>, kThreads, 0) !=
            cudaSuccess) {
      cudaGetLastError();
      coop = 0;
    }
    n = (coop && sms > 0 && per_sm > 0) ? std::min(sms * per_sm, kMaxBlocks) : -1;
    cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

int blocks_for(int64_t items) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, kMaxBlocks))); }

template <typename T, bool Vec>
void launch_quant(Mode mode, const at::Tensor& x, const float* static_scale, uint8_t* q, float* f32,
                  cudaStream_t stream) {
  const int64_t m = x.size(0), k = x.size(1);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const int64_t per_row = (k + kChunk - 1) / kChunk;
  const Items it{k, x.stride(0), x.stride(1), per_row, m * per_row};
  if (mode == Mode::kStatic) {
    quant_static_kernel<T, Vec><<<blocks_for(it.total), kThreads, 0, stream>>>(xp, it, static_scale, q);
  } else if (mode == Mode::kToken) {
    quant_token_kernel<T, Vec><<<static_cast<unsigned int>(m), kThreads, 0, stream>>>(xp, it.row_stride,
                                                                                      it.col_stride, k, f32, q);
  } else {
    float* scale = f32;
    float* partial = f32 + 1;
    const int coop = cooperative_blocks<T, Vec>(x.device().index());
    if (coop > 0) {
      int grid = static_cast<int>(std::min<int64_t>(it.total, coop));
      void* args[] = {const_cast<T**>(&xp), const_cast<Items*>(&it), &partial, &grid, &scale, &q};
      if (cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(quant_dynamic_kernel<T, Vec, 0>), dim3(grid),
                                      dim3(kThreads), args, 0, stream) == cudaSuccess) {
        return;
      }
      cudaGetLastError();  // not possible here (e.g. this capture): the two-launch form below
    }
    const int grid = blocks_for(it.total);
    quant_dynamic_kernel<T, Vec, 1><<<grid, kThreads, 0, stream>>>(xp, it, partial, grid, scale, q);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    quant_dynamic_kernel<T, Vec, 2><<<grid, kThreads, 0, stream>>>(xp, it, partial, grid, scale, q);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether the quantization kernels read x [M, K] with 16-byte loads: columns contiguous, every row on a 16-byte
// boundary (and x_q's rows on 8: K % 8 == 0); else scalar loads at the column stride (a transposed view, a column
// slice).
template <typename T>
bool vector_loads(const at::Tensor& x) {
  return x.stride(1) == 1 && aligned(x.data_ptr()) && (x.stride(0) * int64_t(sizeof(T))) % 16 == 0 &&
         x.size(1) % kVec == 0;
}

template <typename T>
void launch_quant(Mode mode, const at::Tensor& x, const float* static_scale, uint8_t* q, float* f32,
                  cudaStream_t stream) {
  if (vector_loads<T>(x)) {
    launch_quant<T, true>(mode, x, static_scale, q, f32, stream);
  } else {
    launch_quant<T, false>(mode, x, static_scale, q, f32, stream);
  }
}
#endif

// fp32 words the buffer holds after x_q: the per-token scales, or the dynamic scale and its partial maxima
int64_t fp32_words(Mode mode, int64_t m) {
  if (mode == Mode::kToken) return m;
#ifdef FP8B_CPU_TEST
  if (mode == Mode::kDynamic) return 1;
#else
  if (mode == Mode::kDynamic) return 1 + kMaxBlocks;
#endif
  return 0;
}

// Quantize x into buf (x_q at 0, fp32 words at fp32_offset); returns the scale's address (the static one as given).
const float* quantize(Mode mode, const at::Tensor& x, const std::optional<at::Tensor>& input_scale,
                      const at::Tensor& buf, void* stream) {
  const int64_t m = x.size(0), k = x.size(1);
  uint8_t* q = reinterpret_cast<uint8_t*>(buf.data_ptr());
  float* f32 = reinterpret_cast<float*>(q + fp32_offset(m, k));
  const float* static_scale = mode == Mode::kStatic ? input_scale->data_ptr<float>() : nullptr;
#ifdef FP8B_CPU_TEST
  (void)stream;
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor scale;
  if (mode == Mode::kStatic) {
    scale = *input_scale;
  } else if (mode == Mode::kDynamic) {
    scale = at::clamp_min(at::div(at::amax(at::abs(xf)), kFp8Max), kMinScale).reshape({1});
  } else {
    scale = at::clamp_min(at::div(at::amax(at::abs(xf), {-1}, true), kFp8Max), kMinScale);
  }
  const at::Tensor codes = at::clamp(at::div(xf, scale), -kFp8Max, kFp8Max).to(at::kFloat8_e4m3fn).contiguous();
  std::memcpy(q, codes.data_ptr(), static_cast<size_t>(m * k));
  if (mode != Mode::kStatic) std::memcpy(f32, scale.contiguous().data_ptr(), sizeof(float) * scale.numel());
#else
  auto s = static_cast<cudaStream_t>(stream);
  switch (x.scalar_type()) {
    case at::kBFloat16: launch_quant<c10::BFloat16>(mode, x, static_scale, q, f32, s); break;
    case at::kHalf: launch_quant<c10::Half>(mode, x, static_scale, q, f32, s); break;
    default: launch_quant<float>(mode, x, static_scale, q, f32, s); break;
  }
#endif
  return mode == Mode::kStatic ? static_scale : f32;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                  const std::optional<at::Tensor>& input_scale, const std::optional<at::Tensor>& bias,
                  at::ScalarType out_dtype, c10::string_view mode, c10::string_view config, bool fast_accum) {
  Mode md;
  TORCH_CHECK(mode_of(mode, &md), "cutlass_sm90_linear_native: unknown activation scale mode ", mode);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "cutlass_sm90_linear_native: x must be [M, K] (any strides) and w [N, K]");
  const at::ScalarType xt = x.scalar_type();
  TORCH_CHECK(xt == at::kBFloat16 || xt == at::kHalf || xt == at::kFloat,
              "cutlass_sm90_linear_native: x must be bfloat16, float16 or float32");
  TORCH_CHECK(md != Mode::kStatic || (input_scale.has_value() && input_scale->numel() == 1 &&
                                      input_scale->scalar_type() == at::kFloat),
              "cutlass_sm90_linear_native: the static mode needs a one-value fp32 input scale");
  const int64_t m = x.size(0), k = x.size(1);
  if (m == 0) {
    return at::empty({0, w.size(0)}, x.options().dtype(out_dtype));
  }
#ifndef FP8B_CPU_TEST
  const c10::cuda::CUDAGuard guard(x.device());
#endif
  void* stream = current_stream(x);
  const int64_t words = fp32_words(md, m);
  at::Tensor buf = at::empty({words > 0 ? fp32_offset(m, k) + 4 * words : m * k}, x.options().dtype(at::kByte));
  const float* scale = quantize(md, x, input_scale, buf, stream);
  const bool x_vec = md == Mode::kToken && m > 1;
  at::Tensor y;
  if (gemm_native(buf.data_ptr(), m, k, w, scale, x_vec, w_scale, bias, out_dtype, config, fast_accum, x, stream, &y)) {
    return y;
  }
  // the fallback op takes tensors: views of the buffer
  at::Tensor x_q = buf.narrow(0, 0, m * k).view(at::kFloat8_e4m3fn).view({m, k});
  at::Tensor x_scale = md == Mode::kStatic ? *input_scale
                       : buf.narrow(0, fp32_offset(m, k), 4 * (md == Mode::kToken ? m : 1))
                             .view(at::kFloat)
                             .view(md == Mode::kToken ? std::vector<int64_t>{m, 1} : std::vector<int64_t>{1});
  return fallback(x_q, w, x_scale, w_scale, bias, out_dtype, config, fast_accum);
}

// ------------------------------------------------------------------------------------------ block-scaled GEMM
using BlockGemmFn = int (*)(const void*, const void*, void*, int64_t, int64_t, int64_t, const float*, int64_t,
                            const float*, int64_t, const void*, void*, size_t, void*);

constexpr int64_t kGroupK = 128;      // activation group size along K (block_configs.GROUP_K)
constexpr int64_t kBlockN = 128;      // weight block rows (block_configs.WEIGHT_BLOCK[0])
constexpr int64_t kScaleRows = 4;     // a TMA config's activation-scale column stride is a multiple of 4 rows

struct BlockKernel {
  BlockGemmFn gemm = nullptr;
  WorkspaceFn workspace = nullptr;
  bool stream_k = false;
  bool act_scale_tma = false;  // loads the activation scales with TMA: ld % 4 == 0, 16-byte aligned, padded rows
};

struct BlockSlots {
  BlockKernel k[3];  // [out: bfloat16, float16, float32]
};

std::unordered_map<std::string, BlockSlots> g_block_kernels;  // block config name -> its libraries
std::unordered_map<std::pair<int64_t, int64_t>, Buckets, ShapeHash> g_block_tables;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

at::Tensor block_fallback(const at::Tensor& x, const at::Tensor& w, const at::Tensor& x_scale,
                          const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                          c10::string_view config) {
  return call_fallback(g_block_fallback, x, w, x_scale, w_scale, bias, out_dtype, config, std::nullopt);
}

bool row_major_2d(const at::Tensor& t) {
  return t.stride(1) == 1 && (t.size(0) <= 1 || t.stride(0) == t.size(1));
}

// The registered block library for this call (config "auto": the (N, K) bucket of M), or false.
bool find_block_kernel(int64_t m, int64_t n, int64_t k, int slot, c10::string_view config, BlockKernel* found) {
  std::shared_lock<std::shared_mutex> lock(g_mutex);
  decltype(g_block_kernels)::const_iterator kt;
  if (config == "auto") {
    auto it = g_block_tables.find({n, k});
    if (it == g_block_tables.end()) return false;
    const Buckets& b = it->second;
    const size_t i = std::lower_bound(b.bounds.begin(), b.bounds.end(), m) - b.bounds.begin();
    kt = g_block_kernels.find(b.names[i]);
  } else {
    kt = g_block_kernels.find(std::string(config));
  }
  if (kt == g_block_kernels.end() || kt->second.k[slot].gemm == nullptr) return false;
  *found = kt->second.k[slot];
  return true;
}

// The activation scales' column stride (token t of group g at ptr[g * ld + t]) when x_scale [M, Kb] is M-major in a
// layout `kernel` reads as it is (a TMA config: ld % 4 == 0, 16-byte aligned, storage for the rows padded to 4), else
// false (block_ops.act_scale_operand copies it). The same rules as act_scale_operand.
bool act_scale_ld(const at::Tensor& s, int64_t m, int64_t kb, bool tma, int64_t* ld) {
  if (!(m == 1 || s.stride(0) == 1)) return false;
  const int64_t rows = ceil_div(m, kScaleRows) * kScaleRows;
  *ld = kb > 1 ? s.stride(1) : (tma ? rows : m);
  if (!tma) return *ld >= m;
  if (*ld % kScaleRows != 0 || *ld < m || !aligned(s.data_ptr())) return false;
  const int64_t floats = static_cast<int64_t>(s.storage().nbytes() / sizeof(float)) - s.storage_offset();
  return rows == m || floats >= (kb - 1) * *ld + rows;
}

// What the weight side of a block GEMM needs to run as it is: w [N, K] row-major and 16-byte aligned, its scales
// [ceil(N/128), ceil(K/128)] K-major (the row stride in *w_ld), a bias of the output dtype [N] contiguous or none.
bool block_weight_ok(const at::Tensor& w, const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
                     at::ScalarType out_dtype, int64_t kb, int64_t* w_ld) {
  const int64_t n = w.size(0), nb = ceil_div(n, kBlockN);
  if (w_scale.size(0) != nb || w_scale.size(1) != kb || !row_major_2d(w) || !aligned(w.data_ptr())) return false;
  if (!(w_scale.stride(1) == 1 || kb == 1)) return false;
  *w_ld = nb > 1 ? w_scale.stride(0) : kb;
  return *w_ld >= kb && (!bias.has_value() || (bias->scalar_type() == out_dtype && bias->dim() == 1 &&
                                               bias->size(0) == n && bias->stride(0) == 1));
}

// out[M, N] through `kernel` from x_q (M x K e4m3, row-major at xq) and its M-major scales (column stride x_ld), or
// false (nothing ran: the caller hands the call to the fallback op, which raises with the return code's meaning).
bool run_block(const BlockKernel& kernel, const void* xq, int64_t m, int64_t k, const at::Tensor& w,
               const float* x_scale, int64_t x_ld, const at::Tensor& w_scale, int64_t w_ld,
               const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, const at::Tensor& like, void* stream,
               at::Tensor* y) {
  const int64_t n = w.size(0);
  at::Tensor out = at::empty({m, n}, like.options().dtype(out_dtype));
  at::Tensor workspace;
  size_t ws_bytes = 0;
  if (kernel.stream_k && kernel.workspace != nullptr) {
    ws_bytes = kernel.workspace(m, n, k);
    if (ws_bytes > 0) workspace = at::empty({static_cast<int64_t>(ws_bytes)}, like.options().dtype(at::kByte));
  }
  const int rc = kernel.gemm(xq, w.data_ptr(), out.data_ptr(), m, n, k, x_scale, x_ld,
                             static_cast<const float*>(w_scale.data_ptr()), w_ld,
                             bias.has_value() ? bias->data_ptr() : nullptr,
                             ws_bytes > 0 ? workspace.data_ptr() : nullptr, ws_bytes, stream);
  if (rc != 0) return false;
  __atomic_add_fetch(&g_native_calls, 1, __ATOMIC_RELAXED);
  *y = std::move(out);
  return true;
}

at::Tensor block_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& x_scale, const at::Tensor& w_scale,
                      const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, c10::string_view config) {
  const int slot = out_slot(out_dtype);
  if (slot < 0 || x.dim() != 2 || w.dim() != 2 || x_scale.dim() != 2 || w_scale.dim() != 2 || x.size(0) == 0 ||
      x.scalar_type() != at::kFloat8_e4m3fn || w.scalar_type() != at::kFloat8_e4m3fn ||
      x_scale.scalar_type() != at::kFloat || w_scale.scalar_type() != at::kFloat || w.size(1) != x.size(1)) {
    return block_fallback(x, w, x_scale, w_scale, bias, out_dtype, config);
  }
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t kb = ceil_div(k, kGroupK);
  BlockKernel kernel;
  int64_t x_ld = 0, w_ld = 0;
  if (x_scale.size(0) != m || x_scale.size(1) != kb || !row_major_2d(x) || !aligned(x.data_ptr()) ||
      !block_weight_ok(w, w_scale, bias, out_dtype, kb, &w_ld) || !find_block_kernel(m, n, k, slot, config, &kernel) ||
      !act_scale_ld(x_scale, m, kb, kernel.act_scale_tma, &x_ld)) {
    return block_fallback(x, w, x_scale, w_scale, bias, out_dtype, config);
  }
#ifndef FP8B_CPU_TEST
  const c10::cuda::CUDAGuard guard(x.device());
#endif
  at::Tensor y;
  if (run_block(kernel, x.data_ptr(), m, k, w, static_cast<const float*>(x_scale.data_ptr()), x_ld, w_scale, w_ld,
                bias, out_dtype, x, current_stream(x), &y)) {
    return y;
  }
  return block_fallback(x, w, x_scale, w_scale, bias, out_dtype, config);  // raises with the return code's meaning
}

// ------------------------------------------------------------------------------------------ block: fused quantization
// One buffer per call: x_q ([M, K] e4m3, row-major, at 0), then from a 16-byte boundary the group scales, M-major
// with the column stride ld = round_up(M, 4) ([ceil(K/128), ld] fp32: token t of group g at g * ld + t; the padding
// tokens are never written and never used).
#ifndef FP8B_CPU_TEST
constexpr int kGroupLanes = static_cast<int>(kGroupK) / kVec;  // threads per group: 16, kVec elements each
constexpr int kGroupIter = 4;  // groups per 16 threads, their loads issued together (bytes in flight per thread)
constexpr int kGroupsPerBlock = kThreads / kGroupLanes * kGroupIter;

// Grid (M, ceil(Kb / kGroupsPerBlock)): block (r, b) quantizes groups [b * 64, b * 64 + 64) of row r, 16 threads per
// group, each thread kVec elements of kGroupIter groups (no integer division on the way to an address).
template <typename T, bool Vec>
__global__ void __launch_bounds__(kThreads) quant_group_kernel(const T* __restrict__ x, int64_t k, int64_t kb,
                                                               int64_t row_stride, int64_t col_stride, int64_t ld,
                                                               float* __restrict__ scale, uint8_t* __restrict__ q) {
  const int64_t r = blockIdx.x;
  const int lane = threadIdx.x % kGroupLanes;
  const int64_t g0 = static_cast<int64_t>(blockIdx.y) * kGroupsPerBlock + (threadIdx.x / kGroupLanes) * kGroupIter;
  const T* row = x + r * row_stride;
  float e[kGroupIter][kVec];
  int64_t left[kGroupIter];
#pragma unroll
  for (int j = 0; j < kGroupIter; ++j) {  // every load first
    const int64_t c = (g0 + j) * kGroupK + lane * kVec;
    left[j] = g0 + j < kb ? k - c : 0;  // <= 0: nothing of this row is this thread's (a ragged last group)
    load8<T, Vec>(row + c * col_stride, left[j], col_stride, e[j]);
  }
#pragma unroll
  for (int j = 0; j < kGroupIter; ++j) {
    float v = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) v = nan_max(v, fabsf(e[j][i]));
    // the group's maximum over its 16 lanes (every lane of the warp takes part: inactive ones hold 0)
#pragma unroll
    for (int o = kGroupLanes / 2; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (g0 + j < kb) {
      const float s = scale_of(v);
      if (lane == 0) scale[(g0 + j) * ld + r] = s;
      if (left[j] > 0) store8<Vec>(q + r * k + (g0 + j) * kGroupK + lane * kVec, left[j], e[j], s);
    }
  }
}

template <typename T>
void launch_quant_groups(const at::Tensor& x, int64_t kb, int64_t ld, uint8_t* q, float* scale, cudaStream_t stream) {
  const int64_t m = x.size(0), k = x.size(1);
  const dim3 grid(static_cast<unsigned int>(m),
                  static_cast<unsigned int>((kb + kGroupsPerBlock - 1) / kGroupsPerBlock));
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  if (vector_loads<T>(x)) {
    quant_group_kernel<T, true><<<grid, kThreads, 0, stream>>>(xp, k, kb, x.stride(0), x.stride(1), ld, scale, q);
  } else {
    quant_group_kernel<T, false><<<grid, kThreads, 0, stream>>>(xp, k, kb, x.stride(0), x.stride(1), ld, scale, q);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif

void quantize_groups(const at::Tensor& x, int64_t kb, int64_t ld, uint8_t* q, float* scale, void* stream) {
  const int64_t m = x.size(0), k = x.size(1);
#ifdef FP8B_CPU_TEST
  (void)stream;
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor groups = (kb * kGroupK == k ? xf : at::constant_pad_nd(xf, {0, kb * kGroupK - k})).reshape({m, kb, kGroupK});
  const at::Tensor s = at::clamp_min(at::div(at::amax(at::abs(groups), {-1}, true), kFp8Max), kMinScale);
  const at::Tensor codes =
      at::clamp(at::div(groups, s), -kFp8Max, kFp8Max).to(at::kFloat8_e4m3fn).reshape({m, kb * kGroupK}).narrow(1, 0, k)
          .contiguous();
  std::memcpy(q, codes.data_ptr(), static_cast<size_t>(m * k));
  const at::Tensor st = s.reshape({m, kb}).t().contiguous();  // [kb, m]
  for (int64_t g = 0; g < kb; ++g) {
    std::memcpy(scale + g * ld, st.data_ptr<float>() + g * m, sizeof(float) * m);
  }
#else
  auto s = static_cast<cudaStream_t>(stream);
  switch (x.scalar_type()) {
    case at::kBFloat16: launch_quant_groups<c10::BFloat16>(x, kb, ld, q, scale, s); break;
    case at::kHalf: launch_quant_groups<c10::Half>(x, kb, ld, q, scale, s); break;
    default: launch_quant_groups<float>(x, kb, ld, q, scale, s); break;
  }
#endif
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                        const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, c10::string_view config) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w_scale.dim() == 2,
              "cutlass_sm90_block_linear_native: x must be [M, K] (any strides), w [N, K] and w_scale 2-D");
  const at::ScalarType xt = x.scalar_type();
  TORCH_CHECK(xt == at::kBFloat16 || xt == at::kHalf || xt == at::kFloat,
              "cutlass_sm90_block_linear_native: x must be bfloat16, float16 or float32");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  if (m == 0) return at::empty({0, n}, x.options().dtype(out_dtype));
#ifndef FP8B_CPU_TEST
  const c10::cuda::CUDAGuard guard(x.device());
#endif
  void* stream = current_stream(x);
  const int64_t kb = ceil_div(k, kGroupK), ld = ceil_div(m, kScaleRows) * kScaleRows, off = fp32_offset(m, k);
  at::Tensor buf = at::empty({off + 4 * kb * ld}, x.options().dtype(at::kByte));
  uint8_t* q = reinterpret_cast<uint8_t*>(buf.data_ptr());
  float* scale = reinterpret_cast<float*>(q + off);
  quantize_groups(x, kb, ld, q, scale, stream);
  const int slot = out_slot(out_dtype);
  BlockKernel kernel;
  int64_t w_ld = 0;
  at::Tensor y;
  if (slot >= 0 && w.scalar_type() == at::kFloat8_e4m3fn && w_scale.scalar_type() == at::kFloat &&
      block_weight_ok(w, w_scale, bias, out_dtype, kb, &w_ld) && find_block_kernel(m, n, k, slot, config, &kernel) &&
      run_block(kernel, q, m, k, w, scale, ld, w_scale, w_ld, bias, out_dtype, x, stream, &y)) {
    return y;
  }
  // the fallback op takes tensors: views of the buffer (x_q row-major, the scales [M, Kb] with strides (1, ld))
  const at::Tensor x_q = buf.narrow(0, 0, m * k).view(at::kFloat8_e4m3fn).view({m, k});
  const at::Tensor x_scale = buf.narrow(0, off, 4 * kb * ld).view(at::kFloat).view({kb, ld}).narrow(1, 0, m).t();
  return block_fallback(x_q, w, x_scale, w_scale, bias, out_dtype, config);
}

}  // namespace

extern "C" {

// ABI of this file's extern "C" functions (providers/cutlass/native_op.py checks it)
int fp8b_native_abi_version() { return 5; }

// Register (or replace) a loaded kernel library under "config|epilogue|out_dtype|fast_accum" (epilogue: tensor or
// rowwise; out_dtype: bfloat16, float16 or float32; fast_accum: 0 or 1). Returns 0, or -1 for a key it cannot parse.
int fp8b_native_register_kernel(const char* key, void* gemm_fn, void* workspace_fn, int stream_k) {
  std::vector<std::string> parts;
  std::string part;
  for (const char* c = key; ; ++c) {
    if (*c == '|' || *c == '\0') {
      parts.push_back(part);
      part.clear();
      if (*c == '\0') break;
    } else {
      part += *c;
    }
  }
  if (parts.size() != 4 || parts[0].empty()) return -1;
  const int epi = parts[1] == "tensor" ? 0 : parts[1] == "rowwise" ? 1 : -1;
  const int out = out_slot(parts[2]);
  const int fast = parts[3] == "0" ? 0 : parts[3] == "1" ? 1 : -1;
  if (epi < 0 || out < 0 || fast < 0) return -1;
  Kernel k;
  k.gemm = reinterpret_cast<GemmFn>(gemm_fn);
  k.workspace = reinterpret_cast<WorkspaceFn>(workspace_fn);
  k.stream_k = stream_k != 0;
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_kernels[parts[0]].k[epi][out][fast] = k;
  return 0;
}

// Register the M buckets of (N, K): count config names, count - 1 bounds (ascending).
void fp8b_native_register_buckets(int64_t n, int64_t k, int count, const int64_t* bounds, const char* const* names) {
  Buckets b;
  for (int i = 0; i + 1 < count; ++i) b.bounds.push_back(bounds[i]);
  for (int i = 0; i < count; ++i) b.names.emplace_back(names[i]);
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_tables[{n, k}] = std::move(b);
}

// Register (or replace) a loaded block-scaled library under "config|out_dtype" (out_dtype: bfloat16, float16 or
// float32). Returns 0, or -1 for a key it cannot parse.
int fp8b_native_register_block_kernel(const char* key, void* gemm_fn, void* workspace_fn, int stream_k,
                                      int act_scale_tma) {
  const char* bar = std::strchr(key, '|');
  if (bar == nullptr || bar == key) return -1;
  const int out = out_slot(std::string(bar + 1));
  if (out < 0) return -1;
  BlockKernel k;
  k.gemm = reinterpret_cast<BlockGemmFn>(gemm_fn);
  k.workspace = reinterpret_cast<WorkspaceFn>(workspace_fn);
  k.stream_k = stream_k != 0;
  k.act_scale_tma = act_scale_tma != 0;
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_block_kernels[std::string(key, bar - key)].k[out] = k;
  return 0;
}

// Register the block table's M buckets of (N, K) (as fp8b_native_register_buckets).
void fp8b_native_register_block_buckets(int64_t n, int64_t k, int count, const int64_t* bounds,
                                        const char* const* names) {
  Buckets b;
  for (int i = 0; i + 1 < count; ++i) b.bounds.push_back(bounds[i]);
  for (int i = 0; i < count; ++i) b.names.emplace_back(names[i]);
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_block_tables[{n, k}] = std::move(b);
}

// Forget every registered kernel and bucket list (the next call of each shape goes to the fallback op).
void fp8b_native_reset() {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_kernels.clear();
  g_tables.clear();
  g_block_kernels.clear();
  g_block_tables.clear();
}

// The op misses go to (default fp8_backends::cutlass_sm90_gemm).
void fp8b_native_set_fallback(const char* op_name) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_fallback = op_name;
}

// The block op's misses go to (default fp8_backends::cutlass_sm90_block_gemm).
void fp8b_native_set_block_fallback(const char* op_name) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_block_fallback = op_name;
}

int64_t fp8b_native_calls() { return __atomic_load_n(&g_native_calls, __ATOMIC_RELAXED); }
int64_t fp8b_native_fallback_calls() { return __atomic_load_n(&g_fallback_calls, __ATOMIC_RELAXED); }

}  // extern "C"

TORCH_LIBRARY_FRAGMENT(fp8_backends, m) {
  m.def(
      "cutlass_sm90_gemm_native(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias, "
      "ScalarType out_dtype, str config, bool fast_accum) -> Tensor");
  m.def(
      "cutlass_sm90_linear_native(Tensor x, Tensor w, Tensor w_scale, Tensor? input_scale, Tensor? bias, "
      "ScalarType out_dtype, str mode, str config, bool fast_accum) -> Tensor");
  m.def(
      "cutlass_sm90_block_gemm_native(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias, "
      "ScalarType out_dtype, str config) -> Tensor");
  m.def(
      "cutlass_sm90_block_linear_native(Tensor x, Tensor w, Tensor w_scale, Tensor? bias, ScalarType out_dtype, "
      "str config) -> Tensor");
}

#ifdef FP8B_CPU_TEST
TORCH_LIBRARY_IMPL(fp8_backends, CPU, m) {
  m.impl("cutlass_sm90_gemm_native", &gemm);
  m.impl("cutlass_sm90_linear_native", &linear);
  m.impl("cutlass_sm90_block_gemm_native", &block_gemm);
  m.impl("cutlass_sm90_block_linear_native", &block_linear);
}
#else
TORCH_LIBRARY_IMPL(fp8_backends, CUDA, m) {
  m.impl("cutlass_sm90_gemm_native", &gemm);
  m.impl("cutlass_sm90_linear_native", &linear);
  m.impl("cutlass_sm90_block_gemm_native", &block_gemm);
  m.impl("cutlass_sm90_block_linear_native", &block_linear);
}
#endif
