// fp8_backends::cutlass_sm90_gemm_native: the CUTLASS provider's GEMM op with a C++ body.
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
// Built at first use by providers/cutlass/native_op.py with the host C++ compiler against torch's headers
// (FP8B_CPU_TEST: a CPU-key build for the CPU tests, no CUDA headers, the stream argument null).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#ifndef FP8B_CPU_TEST
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
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

}  // namespace

extern "C" {

// ABI of this file's extern "C" functions (providers/cutlass/native_op.py checks it)
int fp8b_native_abi_version() { return 1; }

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
}

#ifdef FP8B_CPU_TEST
TORCH_LIBRARY_IMPL(fp8_backends, CPU, m) { m.impl("cutlass_sm90_gemm_native", &gemm); }
#else
TORCH_LIBRARY_IMPL(fp8_backends, CUDA, m) { m.impl("cutlass_sm90_gemm_native", &gemm); }
#endif
