#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Eight floats (GCC / Clang vector extensions: AVX registers where the machine has them).
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline v8f load8(const uint16_t* p) {  // bfloat16: the high half of a float32
  v8h half;
  std::memcpy(&half, p, sizeof(half));
  v8u wide = __builtin_convertvector(half, v8u) << 16;
  v8f v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

// The horizontal sums of eight vectors, as one vector: three rounds of pairwise shuffles and adds
// (a sum of eight lanes, one vector at a time, cost more than the dot product it ended).
inline v8f sums8(const v8f* v) {
  const v8i even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
  const v8i low = {0, 1, 8, 9, 4, 5, 12, 13}, high = {2, 3, 10, 11, 6, 7, 14, 15};
  const v8i front = {0, 1, 2, 3, 8, 9, 10, 11}, back = {4, 5, 6, 7, 12, 13, 14, 15};
  v8f r[4];
  for (int i = 0; i < 4; ++i)
    r[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], even) + __builtin_shuffle(v[2 * i], v[2 * i + 1], odd);
  const v8f a = __builtin_shuffle(r[0], r[1], low) + __builtin_shuffle(r[0], r[1], high);
  const v8f b = __builtin_shuffle(r[2], r[3], low) + __builtin_shuffle(r[2], r[3], high);
  return __builtin_shuffle(a, b, front) + __builtin_shuffle(a, b, back);
}

// e^x for x <= 0, eight at a time (2^n by the exponent's bits times a degree-6 polynomial on
// |f| <= ln2 / 2; relative error ~1e-7); below -87 it returns ~1e-38, not 0.
inline v8f exp8(v8f x) {
  x = x < -87.0f ? v8f{} - 87.0f : x;
  const v8i n = __builtin_convertvector(x * 1.44269504f - 0.5f, v8i);  // round(x / ln2), x <= 0
  const v8f m = __builtin_convertvector(n, v8f);
  const v8f f = (x - m * 0.693359375f) + m * 2.12194440e-4f;
  v8f p = 1.9875691500e-4f + v8f{};
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  const v8i bits = (n + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One sequence: its `heads` queries (query head h * group + g reads kv head h) over positions
// first..last, walked in position order so each block is read front to back, every kv head of a
// position at once (the hardware prefetcher follows it). CHUNKS (head_dim / 8) is a constant, so
// a key's row stays in registers. A score's dot product is left as eight lanes (`partial`) and
// summed eight positions at a time; the softmax runs eight scores at a time.
template <typename T, int64_t CHUNKS>
void one(const v8f* query, const T* keys, const T* values, const int64_t* table, int64_t first, int64_t last,
         int64_t block_size, int64_t kv_heads, int64_t group, std::vector<v8f>& partial, std::vector<float>& scores,
         v8f* acc, float* out) {
  constexpr int64_t chunks = CHUNKS, dim = 8 * CHUNKS;
  const int64_t length = last - first + 1, heads = kv_heads * group, padded = (length + 7) / 8 * 8;
  const int64_t row = kv_heads * dim, block = block_size * row;
  partial.assign(heads * padded, v8f{});
  scores.resize(heads * padded);
  v8f k[CHUNKS];
  // every (position, kv head) row of `cache` from first to last, loaded into k, then `use(p, h)`;
  // positions walked block by block (a division a position cost more than its arithmetic)
  const auto walk = [&](const T* cache, auto&& use) {
    for (int64_t j = first / block_size, p = first; p <= last; ++j) {
      const T* base = cache + table[j] * block;
      for (int64_t i = p - j * block_size; i < block_size && p <= last; ++i, ++p) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          const T* at = base + i * row + h * dim;
          for (int64_t c = 0; c < chunks; ++c) k[c] = load8(at + 8 * c);
          use(p, h);
        }
      }
    }
  };
  walk(keys, [&](int64_t p, int64_t h) {
    for (int64_t g = 0; g < group; ++g) {
      const v8f* q = query + (h * group + g) * chunks;
      v8f s[4] = {};  // four chains, not one: the FMAs' latency overlaps
      for (int64_t c = 0; c < chunks; ++c) s[c & 3] += q[c] * k[c];
      partial[(h * group + g) * padded + (p - first)] = (s[0] + s[1]) + (s[2] + s[3]);
    }
  });
  std::vector<float> total(heads);
  for (int64_t qh = 0; qh < heads; ++qh) {
    float* sq = scores.data() + qh * padded;
    v8f top = v8f{} - 3.0e38f;
    for (int64_t j = 0; j < padded; j += 8) {
      v8f s = sums8(partial.data() + qh * padded + j);
      if (j + 8 > length)  // the last eight hold positions past `last`: out of the maximum and the sum
        for (int64_t i = length - j; i < 8; ++i) s[i] = -3.0e38f;
      std::memcpy(sq + j, &s, sizeof(s));
      top = top > s ? top : s;
    }
    float high = top[0];
    for (int i = 1; i < 8; ++i) high = std::max(high, top[i]);
    v8f sum = {};
    for (int64_t j = 0; j < padded; j += 8) {
      v8f e = exp8(load8(sq + j) - high);
      if (j + 8 > length)
        for (int64_t i = length - j; i < 8; ++i) e[i] = 0.f;
      std::memcpy(sq + j, &e, sizeof(e));
      sum += e;
    }
    total[qh] = ((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]));
  }
  for (int64_t i = 0; i < heads * chunks; ++i) acc[i] = v8f{};
  walk(values, [&](int64_t p, int64_t h) {
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[(h * group + g) * padded + (p - first)];
      v8f* a = acc + (h * group + g) * chunks;
      for (int64_t c = 0; c < chunks; ++c) a[c] += w * k[c];
    }
  });
  for (int64_t qh = 0; qh < heads; ++qh) {
    const float inv = 1.f / total[qh];
    for (int64_t c = 0; c < chunks; ++c) {
      const v8f v = acc[qh * chunks + c] * inv;
      std::memcpy(out + qh * dim + 8 * c, &v, sizeof(v));
    }
  }
}

template <typename T>
void attend(const T* q, const T* keys, const T* values, const int64_t* tables, const int64_t* positions,
            float* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
            int64_t columns, float scale, int64_t window) {
  const int64_t group = heads / kv_heads, chunks = dim / 8;
  const auto run = chunks == 8 ? one<T, 8> : chunks == 16 ? one<T, 16> : chunks == 4 ? one<T, 4>
                 : chunks == 12 ? one<T, 12> : chunks == 10 ? one<T, 10> : chunks == 2 ? one<T, 2>
                 : chunks == 1 ? one<T, 1> : one<T, 32>;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<v8f> query(heads * chunks), acc(heads * chunks), partial;
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t last = positions[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      for (int64_t i = 0; i < heads * chunks; ++i) query[i] = load8(q + b * heads * dim + 8 * i) * scale;
      run(query.data(), keys, values, tables + b * columns, first, last, block_size, kv_heads, group, partial,
          scores, acc.data(), out + b * heads * dim);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& tables, const at::Tensor& positions, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: q [B, heads, dim], caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: contiguous caches");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "decode_attention: head sizes do not match");
  TORCH_CHECK(dim == 8 || dim == 16 || dim == 32 || dim == 64 || dim == 80 || dim == 96 || dim == 128 || dim == 256,
              "decode_attention: head_dim 8, 16, 32, 64, 80, 96, 128 or 256, not ", dim);
  auto qc = q.contiguous();
  auto tc = tables.to(at::kLong).contiguous();
  auto pc = positions.to(at::kLong).contiguous();
  TORCH_CHECK(tc.size(0) == batch && pc.numel() == batch, "decode_attention: one table and position a query");
  auto out = at::empty({batch, heads, dim}, q.options().dtype(at::kFloat));
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    attend<float>(qc.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tc.data_ptr<int64_t>(),
                  pc.data_ptr<int64_t>(), out.data_ptr<float>(), batch, heads, kv_heads, dim, k_cache.size(1),
                  tc.size(1), s, window);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend<uint16_t>(reinterpret_cast<const uint16_t*>(qc.data_ptr()),
                     reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                     reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), tc.data_ptr<int64_t>(),
                     pc.data_ptr<int64_t>(), out.data_ptr<float>(), batch, heads, kv_heads, dim, k_cache.size(1),
                     tc.size(1), s, window);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accelab, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor positions, "
        "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(accelab, CPU, m) { m.impl("decode_attention", &decode_attention); }
