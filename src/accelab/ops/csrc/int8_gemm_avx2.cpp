// int8 weights x float32 activations on AVX2 + FMA: the GEMMs of a served step from a quarter of
// the bytes, on any x86 CPU of the last ten years.
//
// accelab::int8_linear_f32(x [M, K] f32, packed [N/16, K, 16] int8, scales [N] f32, bias [N] f32?)
//   -> [M, N] f32 = x @ (packed's values * scales[:, None]).T + bias
//
// The weights keep one scale an output row (what the int8 weight-only plans' torchao quantization
// makes); `pack` (int8_gemm.py) lays them out as panels of 16 output rows, k-major, so one panel
// step reads 16 weights of one column. A panel's int8 values are widened to float32 in registers
// (sign-extend, convert) and multiplied by broadcast activations in FMA: the arithmetic of the
// dequantized weight, from int8 in memory. Register blocks of up to 6 activation rows x 16 outputs
// (12 accumulators, as BLIS's Haswell kernel); each block widens the panel again, from L1 after the
// first (widening a panel once into a float32 buffer the blocks share ran slower at every row count
// measured, 8 to 128: 140-160 against 160-170 GFLOP/s on an AVX2 EPYC, where oneDNN's float32 GEMM
// ran 100-140). Panels are spread over torch's threads.
//
// Built only where the target has AVX2 and FMA (kernels.Library `needs`); elsewhere the operator
// says so.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cstdint>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ACCELAB_AVX2 1
#endif

namespace {

constexpr int64_t NR = 16;  // output rows a panel
constexpr int64_t MR = 6;   // activation rows a register block

#ifdef ACCELAB_AVX2
inline __m256 widen8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// ROWS activation rows (x, row stride ldx) times one panel of K steps of int8 values; out row stride ldo.
template <int ROWS>
void block(const float* x, int64_t ldx, const int8_t* panel, int64_t k, float* out, int64_t ldo, const float* scales,
           const float* bias) {
  // one flat array, every index a constant after unrolling: GCC keeps it in 2 x ROWS registers (a
  // two-dimensional one it kept in memory too, a store after every FMA: 6 rows ran at 1/4 the speed)
  __m256 acc[2 * ROWS];
#pragma GCC unroll 12
  for (int r = 0; r < 2 * ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const int8_t* b = panel + i * NR;
    const __m256 w0 = widen8(b), w1 = widen8(b + 8);
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
      const __m256 v = _mm256_broadcast_ss(x + r * ldx + i);
      acc[2 * r] = _mm256_fmadd_ps(v, w0, acc[2 * r]);
      acc[2 * r + 1] = _mm256_fmadd_ps(v, w1, acc[2 * r + 1]);
    }
  }
  const __m256 s0 = _mm256_loadu_ps(scales), s1 = _mm256_loadu_ps(scales + 8);
  const __m256 b0 = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias != nullptr ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_ps(out + r * ldo, _mm256_fmadd_ps(acc[2 * r], s0, b0));
    _mm256_storeu_ps(out + r * ldo + 8, _mm256_fmadd_ps(acc[2 * r + 1], s1, b1));
  }
}

void rows_block(int64_t rows, const float* x, int64_t k, const int8_t* panel, float* out, int64_t ldo,
                const float* scales, const float* bias) {
  switch (rows) {
    case 6: block<6>(x, k, panel, k, out, ldo, scales, bias); break;
    case 5: block<5>(x, k, panel, k, out, ldo, scales, bias); break;
    case 4: block<4>(x, k, panel, k, out, ldo, scales, bias); break;
    case 3: block<3>(x, k, panel, k, out, ldo, scales, bias); break;
    case 2: block<2>(x, k, panel, k, out, ldo, scales, bias); break;
    case 1: block<1>(x, k, panel, k, out, ldo, scales, bias); break;
    default: break;
  }
}

// every row of x times one panel, in blocks of at most MR rows as even as they go (8 rows: 4 + 4,
// not 6 + 2: a block of two rows has too few accumulators to hide the FMAs' latency)
void panel_rows(const float* x, int64_t m, int64_t k, const int8_t* panel, float* out, int64_t ldo,
                const float* scales, const float* bias) {
  const int64_t blocks = (m + MR - 1) / MR;
  for (int64_t b = 0, r = 0; b < blocks; ++b) {
    const int64_t rows = (m - r) / (blocks - b) + ((m - r) % (blocks - b) != 0);
    rows_block(rows, x + r * k, k, panel, out + r * ldo, ldo, scales, bias);
    r += rows;
  }
}
#endif

at::Tensor int8_linear_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_linear_f32: x [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "int8_linear_f32: weights from int8_gemm.AVX2.pack ([N/16, K, 16] int8)");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), n = panels * NR;
  TORCH_CHECK(packed.size(1) == k, "int8_linear_f32: x has ", k, " columns, the weights ", packed.size(1));
  TORCH_CHECK(scales.numel() == n && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int8_linear_f32: one float32 scale an output row");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == n && bias->scalar_type() == at::kFloat),
              "int8_linear_f32: a float32 bias of one value an output row");
#ifdef ACCELAB_AVX2
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* xs = xc.data_ptr<float>();
  const int8_t* ws = packed.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  const float* bs = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* os = out.data_ptr<float>();
  if (m == 0) return out;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      panel_rows(xs, m, k, ws + p * k * NR, os + p * NR, n, sc + p * NR, bs != nullptr ? bs + p * NR : nullptr);
  });
  return out;
#else
  TORCH_CHECK(false, "int8_linear_f32: built for a CPU without AVX2 and FMA");
  return x;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accelab, m) {
  m.def("int8_linear_f32(Tensor x, Tensor packed, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(accelab, CPU, m) { m.impl("int8_linear_f32", &int8_linear_f32); }
