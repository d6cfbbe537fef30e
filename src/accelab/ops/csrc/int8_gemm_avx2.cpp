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
// (12 accumulators, as BLIS's Haswell kernel). With more rows than one block, a panel is widened
// once into a float32 buffer the blocks share (it stays in L2), instead of once per block.
// Panels are spread over torch's threads.
//
// Built only where the target has AVX2 and FMA (kernels.Library `needs`); elsewhere the operator
// says so.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ACCELAB_AVX2 1
#endif

namespace {

constexpr int64_t NR = 16;  // output rows a panel
constexpr int64_t MR = 6;   // activation rows a register block
constexpr int64_t WIDEN_FROM = 24;  // from this many rows a panel is widened once into a float32 buffer

#ifdef ACCELAB_AVX2
inline __m256 widen8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// ROWS activation rows (x, row stride ldx) times one panel of K steps: int8 values widened here
// (WIDE false) or float32 ones widened before (WIDE true); out row stride ldo.
template <int ROWS, bool WIDE>
void block(const float* x, int64_t ldx, const void* panel, int64_t k, float* out, int64_t ldo, const float* scales,
           const float* bias) {
  // one flat array, every index a constant after unrolling: GCC keeps it in 2 x ROWS registers (a
  // two-dimensional one it kept in memory too, a store after every FMA: 6 rows ran at 1/4 the speed)
  __m256 acc[2 * ROWS];
#pragma GCC unroll 12
  for (int r = 0; r < 2 * ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    __m256 w0, w1;
    if constexpr (WIDE) {
      const float* f = static_cast<const float*>(panel) + i * NR;
      w0 = _mm256_loadu_ps(f);
      w1 = _mm256_loadu_ps(f + 8);
    } else {
      const int8_t* b = static_cast<const int8_t*>(panel) + i * NR;
      w0 = widen8(b);
      w1 = widen8(b + 8);
    }
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

template <bool WIDE>
void rows_block(int64_t rows, const float* x, int64_t k, const void* panel, float* out, int64_t ldo, const float* scales,
                const float* bias) {
  switch (rows) {
    case 6: block<6, WIDE>(x, k, panel, k, out, ldo, scales, bias); break;
    case 5: block<5, WIDE>(x, k, panel, k, out, ldo, scales, bias); break;
    case 4: block<4, WIDE>(x, k, panel, k, out, ldo, scales, bias); break;
    case 3: block<3, WIDE>(x, k, panel, k, out, ldo, scales, bias); break;
    case 2: block<2, WIDE>(x, k, panel, k, out, ldo, scales, bias); break;
    case 1: block<1, WIDE>(x, k, panel, k, out, ldo, scales, bias); break;
    default: break;
  }
}

// every row of x times one panel, in blocks of at most MR rows as even as they go (8 rows: 4 + 4,
// not 6 + 2: a block of two rows has too few accumulators to hide the FMAs' latency)
template <bool WIDE>
void panel_rows(const float* x, int64_t m, int64_t k, const void* panel, float* out, int64_t ldo, const float* scales,
                const float* bias) {
  const int64_t blocks = (m + MR - 1) / MR;
  for (int64_t b = 0, r = 0; b < blocks; ++b) {
    const int64_t rows = (m - r) / (blocks - b) + ((m - r) % (blocks - b) != 0);
    rows_block<WIDE>(rows, x + r * k, k, panel, out + r * ldo, ldo, scales, bias);
    r += rows;
  }
}
#endif

at::Tensor int8_linear_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_linear_f32: x [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "int8_linear_f32: weights from int8_gemm.pack_panels ([N/16, K, 16] int8)");
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
    std::vector<float> wide(m >= WIDEN_FROM ? k * NR : 0);
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* w = ws + p * k * NR;
      const float* bias_p = bs != nullptr ? bs + p * NR : nullptr;
      if (m < WIDEN_FROM) {
        panel_rows<false>(xs, m, k, w, os + p * NR, n, sc + p * NR, bias_p);
        continue;
      }
      for (int64_t i = 0; i < k * NR; i += 8) _mm256_storeu_ps(wide.data() + i, widen8(w + i));
      panel_rows<true>(xs, m, k, wide.data(), os + p * NR, n, sc + p * NR, bias_p);
    }
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
