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
// cutlass_sm90_linear_native takes the unquantized activation x [M, K] (bf16, fp16 or fp32, unit column stride)
// and quantizes it to float8_e4m3fn itself before the same GEMM: one dispatcher call for an eager linear instead of
// a quantization launch plus the GEMM op. Its kernels compute what fp8_backends.core.reference does:
//   static     x_q = clamp(x / s, +-448) -> e4m3, s the layer's input scale (device memory, never read on the host)
//   dynamic    s = max(amax(|x|) / 448, 1e-12) ([1]), then as static
//   per-token  s[m] = max(amax(|x[m, :]|) / 448, 1e-12) ([M, 1]), then as static per row
// with NaN propagated as torch propagates it (amax, clamp_min and clamp keep a NaN).
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
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#else
#include <ATen/ops/abs.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/clamp_min.h>
#include <ATen/ops/div.h>
#endif

#include <algorithm>
#include <cstdint>
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
std::unordered_map<std::string, Kernel> g_kernels;
std::unordered_map<std::pair<int64_t, int64_t>, Buckets, ShapeHash> g_tables;
std::string g_fallback = "fp8_backends::cutlass_sm90_gemm";
int64_t g_native_calls = 0;    // calls served here (for tests and diagnostics; relaxed, under no lock)
int64_t g_fallback_calls = 0;  // calls handed to the fallback op

const char* out_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    default: return nullptr;
  }
}

at::Tensor fallback(const at::Tensor& x, const at::Tensor& w, const at::Tensor& x_scale, const at::Tensor& w_scale,
                    const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, c10::string_view config,
                    bool fast_accum) {
  std::string name;
  {
    std::shared_lock<std::shared_mutex> lock(g_mutex);
    name = g_fallback;
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
  stack.emplace_back(fast_accum);
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

bool aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; }

at::Tensor gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& x_scale, const at::Tensor& w_scale,
                const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, c10::string_view config,
                bool fast_accum) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "cutlass_sm90_gemm_native: x and w must be 2-D");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const char* out = out_name(out_dtype);
  const bool x_vec = x_scale.numel() > 1;
  const bool w_vec = w_scale.numel() > 1;
  Kernel kernel;
  bool found = false;
  if (out != nullptr && aligned(x.data_ptr()) && aligned(w.data_ptr())) {
    std::shared_lock<std::shared_mutex> lock(g_mutex);
    const std::string* name = nullptr;
    std::string explicit_name;
    if (config == "auto") {
      auto it = g_tables.find({n, k});
      if (it != g_tables.end()) {
        const Buckets& b = it->second;
        size_t i = std::lower_bound(b.bounds.begin(), b.bounds.end(), m) - b.bounds.begin();
        name = &b.names[i];
      }
    } else {
      explicit_name = std::string(config);
      name = &explicit_name;
    }
    if (name != nullptr) {
      std::string key = *name;
      key += (x_vec || w_vec) ? "|rowwise|" : "|tensor|";
      key += out;
      key += fast_accum ? "|1" : "|0";
      auto kt = g_kernels.find(key);
      if (kt != g_kernels.end()) {
        kernel = kt->second;
        found = true;
      }
    }
  }
  if (!found) {
    return fallback(x, w, x_scale, w_scale, bias, out_dtype, config, fast_accum);
  }
  at::Tensor y = at::empty({m, n}, x.options().dtype(out_dtype));
  if (m == 0) {
    return y;
  }
#ifdef FP8B_CPU_TEST
  void* stream = nullptr;
#else
  const c10::cuda::CUDAGuard guard(x.device());
  void* stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
#endif
  at::Tensor workspace;
  size_t ws_bytes = 0;
  if (kernel.stream_k && kernel.workspace != nullptr) {
    ws_bytes = kernel.workspace(m, n, k);
    if (ws_bytes > 0) {
      workspace = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
    }
  }
  const int rc = kernel.gemm(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, x_scale.data_ptr(), x_vec ? 1 : 0,
                             w_scale.data_ptr(), w_vec ? 1 : 0, bias.has_value() ? bias->data_ptr() : nullptr,
                             ws_bytes > 0 ? workspace.data_ptr() : nullptr, ws_bytes, stream);
  if (rc != 0) {
    // nothing ran: the Python op reruns the call and raises CutlassKernelError with the code's meaning
    return fallback(x, w, x_scale, w_scale, bias, out_dtype, config, fast_accum);
  }
  __atomic_add_fetch(&g_native_calls, 1, __ATOMIC_RELAXED);
  return y;
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

#ifndef FP8B_CPU_TEST
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

template <typename T>
__global__ void quant_static_kernel(const T* __restrict__ x, int64_t row_stride, const float* __restrict__ scale,
                                    uint8_t* __restrict__ q, int64_t m, int64_t k) {
  const float s = *scale;
  const int64_t total = m * k;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / k, c = i - r * k;
    q[i] = to_fp8(static_cast<float>(x[r * row_stride + c]), s);
  }
}

__device__ __forceinline__ float block_nan_max(float v, float* shared) {  // blockDim.x a multiple of 32, <= 1024
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
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

template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t row_stride, int64_t m, int64_t k,
                            unsigned int* __restrict__ amax_bits) {
  __shared__ float shared[32];
  float v = 0.0f;
  const int64_t total = m * k;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / k, c = i - r * k;
    v = nan_max(v, fabsf(static_cast<float>(x[r * row_stride + c])));
  }
  v = block_nan_max(v, shared);
  // |x| >= 0 (a NaN's sign cleared): its bits order as unsigned integers do, a NaN above +inf
  if (threadIdx.x == 0) atomicMax(amax_bits, __float_as_uint(v));
}

template <typename T>
__global__ void quant_dynamic_kernel(const T* __restrict__ x, int64_t row_stride, const unsigned int* amax_bits,
                                     float* __restrict__ scale, uint8_t* __restrict__ q, int64_t m, int64_t k) {
  const float s = scale_of(__uint_as_float(*amax_bits));
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale = s;
  const int64_t total = m * k;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / k, c = i - r * k;
    q[i] = to_fp8(static_cast<float>(x[r * row_stride + c]), s);
  }
}

template <typename T>
__global__ void quant_token_kernel(const T* __restrict__ x, int64_t row_stride, float* __restrict__ scale,
                                   uint8_t* __restrict__ q, int64_t k) {  // one block per row
  __shared__ float shared[32];
  const T* row = x + blockIdx.x * row_stride;
  float v = 0.0f;
  for (int64_t c = threadIdx.x; c < k; c += blockDim.x) v = nan_max(v, fabsf(static_cast<float>(row[c])));
  const float s = scale_of(block_nan_max(v, shared));
  if (threadIdx.x == 0) scale[blockIdx.x] = s;
  uint8_t* out = q + blockIdx.x * k;
  for (int64_t c = threadIdx.x; c < k; c += blockDim.x) out[c] = to_fp8(static_cast<float>(row[c]), s);
}

int elementwise_blocks(int64_t total) {
  const int64_t blocks = (total + 255) / 256;
  return static_cast<int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

template <typename T>
void launch_quant(Mode mode, const at::Tensor& x, const at::Tensor& scale, const at::Tensor& x_q, cudaStream_t stream) {
  const int64_t m = x.size(0), k = x.size(1), rs = x.stride(0);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  uint8_t* qp = reinterpret_cast<uint8_t*>(x_q.data_ptr());
  float* sp = scale.data_ptr<float>();
  if (mode == Mode::kStatic) {
    quant_static_kernel<T><<<elementwise_blocks(m * k), 256, 0, stream>>>(xp, rs, sp, qp, m, k);
  } else if (mode == Mode::kDynamic) {
    at::Tensor bits = at::empty({1}, x.options().dtype(at::kInt));
    C10_CUDA_CHECK(cudaMemsetAsync(bits.data_ptr(), 0, sizeof(unsigned int), stream));
    unsigned int* bp = reinterpret_cast<unsigned int*>(bits.data_ptr());
    const int blocks = std::min(elementwise_blocks(m * k), 264);
    amax_kernel<T><<<blocks, 256, 0, stream>>>(xp, rs, m, k, bp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    quant_dynamic_kernel<T><<<elementwise_blocks(m * k), 256, 0, stream>>>(xp, rs, bp, sp, qp, m, k);
  } else {
    quant_token_kernel<T><<<static_cast<unsigned int>(m), 256, 0, stream>>>(xp, rs, sp, qp, k);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif

// x_q [M, K] e4m3 and its scale ([1] or [M, 1] fp32): the static scale as given, the dynamic ones computed
std::pair<at::Tensor, at::Tensor> quantize(Mode mode, const at::Tensor& x, const std::optional<at::Tensor>& input_scale) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor x_q = at::empty({m, k}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale = mode == Mode::kStatic ? *input_scale
                     : at::empty(mode == Mode::kDynamic ? std::vector<int64_t>{1} : std::vector<int64_t>{m, 1},
                                 x.options().dtype(at::kFloat));
#ifdef FP8B_CPU_TEST
  const at::Tensor xf = x.to(at::kFloat);
  if (mode == Mode::kDynamic) {
    scale.copy_(at::clamp_min(at::div(at::amax(at::abs(xf)), kFp8Max), kMinScale).reshape({1}));
  } else if (mode == Mode::kToken) {
    scale.copy_(at::clamp_min(at::div(at::amax(at::abs(xf), {-1}, true), kFp8Max), kMinScale));
  }
  x_q.copy_(at::clamp(at::div(xf, scale), -kFp8Max, kFp8Max).to(at::kFloat8_e4m3fn));
#else
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  switch (x.scalar_type()) {
    case at::kBFloat16: launch_quant<c10::BFloat16>(mode, x, scale, x_q, stream); break;
    case at::kHalf: launch_quant<c10::Half>(mode, x, scale, x_q, stream); break;
    default: launch_quant<float>(mode, x, scale, x_q, stream); break;
  }
#endif
  return {x_q, scale};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                  const std::optional<at::Tensor>& input_scale, const std::optional<at::Tensor>& bias,
                  at::ScalarType out_dtype, c10::string_view mode, c10::string_view config, bool fast_accum) {
  Mode md;
  TORCH_CHECK(mode_of(mode, &md), "cutlass_sm90_linear_native: unknown activation scale mode ", mode);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && (x.size(1) <= 1 || x.stride(1) == 1),
              "cutlass_sm90_linear_native: x must be [M, K] with unit column stride and w [N, K]");
  const at::ScalarType xt = x.scalar_type();
  TORCH_CHECK(xt == at::kBFloat16 || xt == at::kHalf || xt == at::kFloat,
              "cutlass_sm90_linear_native: x must be bfloat16, float16 or float32");
  TORCH_CHECK(md != Mode::kStatic || (input_scale.has_value() && input_scale->numel() == 1 &&
                                      input_scale->scalar_type() == at::kFloat),
              "cutlass_sm90_linear_native: the static mode needs a one-value fp32 input scale");
  if (x.size(0) == 0) {
    return at::empty({0, w.size(0)}, x.options().dtype(out_dtype));
  }
#ifndef FP8B_CPU_TEST
  const c10::cuda::CUDAGuard guard(x.device());
#endif
  auto [x_q, scale] = quantize(md, x, input_scale);
  return gemm(x_q, w, scale, w_scale, bias, out_dtype, config, fast_accum);
}

}  // namespace

extern "C" {

// ABI of this file's extern "C" functions (providers/cutlass/native_op.py checks it)
int fp8b_native_abi_version() { return 2; }

// Register (or replace) a loaded kernel library under "config|epilogue|out_dtype|fast_accum" (fast_accum: 0 or 1).
void fp8b_native_register_kernel(const char* key, void* gemm_fn, void* workspace_fn, int stream_k) {
  Kernel k;
  k.gemm = reinterpret_cast<GemmFn>(gemm_fn);
  k.workspace = reinterpret_cast<WorkspaceFn>(workspace_fn);
  k.stream_k = stream_k != 0;
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_kernels[key] = k;
}

// Register the M buckets of (N, K): count config names, count - 1 bounds (ascending).
void fp8b_native_register_buckets(int64_t n, int64_t k, int count, const int64_t* bounds, const char* const* names) {
  Buckets b;
  for (int i = 0; i + 1 < count; ++i) b.bounds.push_back(bounds[i]);
  for (int i = 0; i < count; ++i) b.names.emplace_back(names[i]);
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_tables[{n, k}] = std::move(b);
}

// Forget every registered kernel and bucket list (the next call of each shape goes to the fallback op).
void fp8b_native_reset() {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_kernels.clear();
  g_tables.clear();
}

// The op misses go to (default fp8_backends::cutlass_sm90_gemm).
void fp8b_native_set_fallback(const char* op_name) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_fallback = op_name;
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
}

#ifdef FP8B_CPU_TEST
TORCH_LIBRARY_IMPL(fp8_backends, CPU, m) {
  m.impl("cutlass_sm90_gemm_native", &gemm);
  m.impl("cutlass_sm90_linear_native", &linear);
}
#else
TORCH_LIBRARY_IMPL(fp8_backends, CUDA, m) {
  m.impl("cutlass_sm90_gemm_native", &gemm);
  m.impl("cutlass_sm90_linear_native", &linear);
}
#endif
