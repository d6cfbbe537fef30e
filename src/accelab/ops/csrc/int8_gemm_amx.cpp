#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ACCELAB_AMX 1
#endif

namespace {

#ifdef ACCELAB_AMX
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands a process AMX's tile state only when asked (ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// bf16 of 0..127 as byte tables (its high and its low bytes), 64 entries a register.
struct Tables {
  __m512i high0, high1, low0, low1;
};
const Tables& tables() {
  static const Tables t = [] {
    alignas(64) uint8_t high[128], low[128];
    for (int m = 0; m < 128; ++m) {
      const float f = static_cast<float>(m);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof(bits));
      high[m] = static_cast<uint8_t>(bits >> 24);
      low[m] = static_cast<uint8_t>(bits >> 16);
    }
    return Tables{_mm512_load_si512(high), _mm512_load_si512(high + 64), _mm512_load_si512(low),
                  _mm512_load_si512(low + 64)};
  }();
  return t;
}

// One slab of 64 output rows: for each 16 rows of x, four 16 x 16 tiles of sums over K (tiles
// 0-3), x's 16 x 32 tile (4), weight tiles (5-7). The slab's weights, a sign bit and 7 bits of
// magnitude a byte (`pack`; -128 is the spare "-0"), are widened to bf16 by two byte lookups (the
// magnitude's bf16 high and low bytes; the sign ORed into the high one) and one interleave, 64
// values in 7 instructions (through float32: 16, and the widening was most of the kernel's time:
// 3072 x 576 at 16 rows 88 against 98 us); one k block ahead of the
// tiles that read it, in the first 16 rows' pass (all of it first, then the tiles, took 1.2x as
// long: the two did not overlap); later rows reuse it. With no later rows (a decoding step's 16 or
// fewer) two k blocks of room take turns, so the widened values never leave L1 (the whole slab's
// room had the core write back 2 bytes to L2 for each int8 read), and each 64 bytes of weights are
// prefetched 8 KB ahead: Llama-1B's GEMMs at 8 rows 13-17 -> 17-23 GB/s, this VM's read rate.
constexpr int64_t PREFETCH = 8192;

void slab_rows(const uint16_t* x, const int8_t* w, const float* scales, const uint16_t* bias, uint16_t* out,
               int64_t m, int64_t padded_m, int64_t k, int64_t n, int64_t nb, uint16_t* slab, float* sums) {
  const int64_t kblocks = k / 32;
  const Tables& t = tables();
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i minus128 = _mm512_set1_epi8(static_cast<char>(0xC3));  // bf16 -128 is 0xC300
  const bool ring = padded_m == 16;
  const auto at = [&](int64_t kb) { return slab + (ring ? (kb & 1) : kb) * 2048; };
  const auto widen = [&](int64_t kb) {  // 4 tiles of 16 x 32: 2048 values
    const int8_t* from = w + kb * 2048;
    uint16_t* to = at(kb);
    for (int64_t i = 0; i < 2048; i += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(from + i + PREFETCH), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(from + i);
      const __m512i low = _mm512_permutex2var_epi8(t.low0, v, t.low1);
      __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.high0, v, t.high1), v, sign, 0xF8);
      high = _mm512_mask_mov_epi8(high, _mm512_cmpeq_epi8_mask(v, sign), minus128);  // "-0" is -128
      _mm512_storeu_si512(to + i, _mm512_unpacklo_epi8(low, high));
      _mm512_storeu_si512(to + i + 32, _mm512_unpackhi_epi8(low, high));
    }
  };
  for (int64_t mb = 0; mb < padded_m; mb += 16) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (mb == 0) widen(0);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      if (mb == 0 && kb + 1 < kblocks) widen(kb + 1);
      const uint16_t* b = at(kb);
      _tile_loadd(4, x + mb * k + kb * 32, k * 2);
      _tile_loadd(5, b, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + 512, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, b + 1024, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 1536, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, sums, 256);
    _tile_stored(1, sums + 16, 256);
    _tile_stored(2, sums + 32, 256);
    _tile_stored(3, sums + 48, 256);
    for (int64_t r = 0; r < 16 && mb + r < m; ++r) {
      for (int64_t j = 0; j < 64; j += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sums + r * 64 + j), _mm512_loadu_ps(scales + nb * 64 + j));
        if (bias != nullptr) {
          const __m256i half = _mm256_loadu_si256((const __m256i*)(bias + nb * 64 + j));
          v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
        }
        _mm256_storeu_si256((__m256i*)(out + (mb + r) * n + nb * 64 + j), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}
#endif

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_linear: x [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 6 && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "int8_linear: weights from int8_gemm.pack");
  const int64_t m = x.size(0), k = x.size(1), nblocks = packed.size(0), n = nblocks * 64;
  TORCH_CHECK(packed.size(1) * 32 == k, "int8_linear: x has ", k, " columns, the weights ", packed.size(1) * 32);
  TORCH_CHECK(scales.numel() == n && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int8_linear: one float32 scale an output row");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == n && bias->scalar_type() == at::kBFloat16),
              "int8_linear: a bfloat16 bias of one value an output row");
#ifdef ACCELAB_AMX
  TORCH_CHECK(amx_granted(), "int8_linear: the kernel did not grant this process AMX's tile state");
  const int64_t padded_m = (m + 15) / 16 * 16;
  auto xc = x.contiguous();
  if (padded_m != m) xc = at::cat({xc, at::zeros({padded_m - m, k}, x.options())});
  auto out = at::empty({m, n}, x.options());
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* ws = packed.data_ptr<int8_t>();
  const auto* bs = bias.has_value() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr;
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float* sc = scales.data_ptr<float>();
  at::parallel_for(0, nblocks, 1, [&](int64_t begin, int64_t end) {
    TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
      config.colsb[t] = 64;
      config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
    std::vector<uint16_t> slab(k / 32 * 4 * 512);
    alignas(64) float sums[16 * 64];
    for (int64_t nb = begin; nb < end; ++nb)
      slab_rows(xs, ws + nb * k * 64, sc, bs, os, m, padded_m, k, n, nb, slab.data(), sums);
    _tile_release();
  });
  return out;
#else
  TORCH_CHECK(false, "int8_linear: built for a CPU without AMX (amx_bf16), AVX512-BF16 and AVX512-VBMI");
  return x;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accelab, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(accelab, CPU, m) { m.impl("int8_linear", &int8_linear); }
