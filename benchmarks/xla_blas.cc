// An XLA custom call that runs a float32 matrix product in OpenBLAS (NumPy's copy),
// for benchmarks/micro.py: can a TensorFlow XLA program run its products faster
// through OpenBLAS than through XLA's own?
//
// Operands: a, b, and an int64 vector (m, k, n, transpose_a, transpose_b); the
// result is op(a) @ op(b), (m, n), row-major. The product's rows are cut in one
// part per core, each an OpenBLAS call on its own thread; xla_blas.py sets OpenBLAS
// to one thread while it times them: OpenBLAS's own threads spin after each call
// and would slow XLA's threads that run next.
#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "xla/service/custom_call_target_registry.h"

namespace {

using Sgemm = void (*)(int order, int transpose_a, int transpose_b, int64_t m, int64_t n,
                       int64_t k, float alpha, const float* a, int64_t lda, const float* b,
                       int64_t ldb, float beta, float* c, int64_t ldc);

Sgemm sgemm = nullptr;
int parts = 1;

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

void Rows(const float* a, const float* b, float* c, int64_t first, int64_t last, int64_t m,
          int64_t k, int64_t n, bool transpose_a, bool transpose_b) {
  const float* a_rows = transpose_a ? a + first : a + first * k;
  sgemm(kRowMajor, transpose_a ? kTrans : kNoTrans, transpose_b ? kTrans : kNoTrans,
        last - first, n, k, 1.0f, a_rows, transpose_a ? m : k, b, transpose_b ? k : n, 0.0f,
        c + first * n, n);
}

}  // namespace

extern "C" void keras_vit_bench_set_blas(void* sgemm_address, int threads) {
  sgemm = reinterpret_cast<Sgemm>(sgemm_address);
  parts = threads;
}

// XLA's CPU calling convention for custom calls: output buffer, operand buffers, status.
extern "C" void keras_vit_bench_sgemm(void* out, const void** in, void* status) {
  (void)status;
  const auto* dims = static_cast<const int64_t*>(in[2]);
  const int64_t m = dims[0], k = dims[1], n = dims[2];
  const bool transpose_a = dims[3] != 0, transpose_b = dims[4] != 0;
  const auto* a = static_cast<const float*>(in[0]);
  const auto* b = static_cast<const float*>(in[1]);
  auto* c = static_cast<float*>(out);
  const int64_t step = ((m + parts - 1) / parts + 15) / 16 * 16;  // whole 16-row panels
  std::vector<std::thread> threads;
  for (int64_t first = step; first < m; first += step) {
    threads.emplace_back(Rows, a, b, c, first, std::min(m, first + step), m, k, n,
                         transpose_a, transpose_b);
  }
  Rows(a, b, c, 0, std::min(m, step), m, k, n, transpose_a, transpose_b);
  for (auto& thread : threads) thread.join();
}

namespace {
struct Register {
  Register() {
    xla::CustomCallTargetRegistry::Global()->Register(
        "keras_vit_bench_sgemm", reinterpret_cast<void*>(&keras_vit_bench_sgemm), "Host");
  }
} register_at_load;
}  // namespace
