// The online-softmax attention loop over a cache's tiles, and its double-precision reference.
#include "veloxquant/cache/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "veloxquant/cache/attention_kernels.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

void check_attention_queries(const KVCache& cache, const Tensor& queries, double scale) {
  require(std::isfinite(scale), "attend: scale must be finite, got {}", scale);
  const auto& q = queries.shape();
  require(cache.offset() > 0, "attend: the cache is empty (append the queries' own keys and values first)");
  require(queries.dtype() == DType::F32 || queries.dtype() == cache.dtype(), "attend: queries are {} but must be float32 or the cache's {}",
          dtype_name(queries.dtype()), dtype_name(cache.dtype()));
  require(q[0] == cache.batch(), "attend: queries {} have batch {} but the cache holds batch {}", shape_string(q), q[0], cache.batch());
  require(q[3] == cache.key_dim(), "attend: queries {} have head dim {} but the cache's keys have {}", shape_string(q), q[3],
          cache.key_dim());
  require(q[1] >= 1 && q[1] % cache.kv_heads() == 0, "attend: queries {} have {} heads, not a positive multiple of the cache's {} KV heads",
          shape_string(q), q[1], cache.kv_heads());
  require(q[2] >= 1 && q[2] <= cache.offset(),
          "attend: queries {} have {} tokens but must have 1 .. offset = {} (the queries' own tokens are the cache's last)", shape_string(q),
          q[2], cache.offset());
  require(queries.all_finite(), "attend: queries must be finite (no NaN or Inf)");
}

namespace {

// Tokens per tile for rows of d float32 values.
std::int64_t tile_tokens(std::int64_t d) {
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(kAttentionTileBytes / 4) / std::max<std::int64_t>(d, 1), 16, 256);
}

}  // namespace

Tensor attend_tiled(const KVCache& cache, const Tensor& queries, float scale) {
  check_attention_queries(cache, queries, scale);
  const std::int64_t B = queries.dim(0), Hq = queries.dim(1), Sq = queries.dim(2), Dk = cache.key_dim(), Dv = cache.value_dim();
  const std::int64_t Hkv = cache.kv_heads(), G = Hq / Hkv, T = cache.offset(), rows = G * Sq;
  const std::int64_t tile = tile_tokens(std::max(Dk, Dv));
  Tensor out = Tensor::uninitialized({B, Hq, Sq, Dv}, DType::F32);
  const auto U = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  // Per KV head h: its rows' mapped queries, accumulators, running maxima and sums.
  std::vector<float> q(U(Hkv * rows * Dk)), acc(U(Hkv * rows * Dv)), m(U(Hkv * rows)), l(U(Hkv * rows));
  std::vector<float> kscratch(U(tile * Dk)), vscratch(U(tile * Dv)), s(U(rows * tile));
  for (std::int64_t b = 0; b < B; ++b) {
    // Row r = g * Sq + i of KV head h: query head h * G + g, query token i.
    for (std::int64_t h = 0; h < Hkv; ++h)
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t i = 0; i < Sq; ++i) {
          float* qr = q.data() + (h * rows + g * Sq + i) * Dk;
          to_f32(queries.row(b, h * G + g, i), queries.dtype(), qr, U(Dk));
          cache.map_query(qr);
        }
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.end(), 0.0f);
    // Tiles outside, heads inside: caches that store token-major (a token's row of every head
    // together: the llama.cpp blocks, fp8) are then read front to back, each token's row used by
    // all heads while it is in cache, instead of once per head with a stride the prefetchers
    // lose at every page.
    for (std::int64_t t0 = 0; t0 < T; t0 += tile) {
      const std::int64_t n = std::min(tile, T - t0);
      for (std::int64_t h = 0; h < Hkv; ++h) {
        float* ah = acc.data() + h * rows * Dv;
        // Every row is scored against the whole tile; a row's masked tokens get weight 0.
        cache.score_key_tile(b, h, t0, n, q.data() + h * rows * Dk, rows, s.data(), kscratch.data());
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t i = r % Sq, last = T - Sq + i;  // the last token query i sees
          attn::softmax_step(s.data() + r * n, n, last - t0 + 1, scale, m[U(h * rows + r)], l[U(h * rows + r)], ah + r * Dv, Dv);
        }
        cache.accumulate_value_tile(b, h, t0, n, s.data(), rows, ah, vscratch.data());
      }
    }
    for (std::int64_t h = 0; h < Hkv; ++h)
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t i = 0; i < Sq; ++i) {
          const std::int64_t r = h * rows + g * Sq + i;
          float* a = acc.data() + r * Dv;
          const float inv = 1.0f / l[U(r)];  // l >= 1: the max's own term is exp(0)
          for (std::int64_t d = 0; d < Dv; ++d) a[d] *= inv;
          cache.unmap_output(a);
          std::copy(a, a + Dv, reinterpret_cast<float*>(out.row(b, h * G + g, i)));
        }
  }
  return out;
}

Tensor attend_ref(const KVCache& cache, const Tensor& queries, double scale) {
  check_attention_queries(cache, queries, scale);
  const KVState st = cache.state();
  const std::int64_t B = queries.dim(0), Hq = queries.dim(1), Sq = queries.dim(2), Dk = st.keys.dim(3), Dv = st.values.dim(3);
  const std::int64_t G = Hq / st.keys.dim(1), T = st.keys.dim(2);
  Tensor out = Tensor::uninitialized({B, Hq, Sq, Dv}, DType::F32);
  std::vector<double> w(static_cast<std::size_t>(T)), o(static_cast<std::size_t>(Dv));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t hq = 0; hq < Hq; ++hq)
      for (std::int64_t i = 0; i < Sq; ++i) {
        const std::int64_t visible = T - Sq + i + 1;
        double mx = -std::numeric_limits<double>::infinity();
        for (std::int64_t t = 0; t < visible; ++t) {
          double dotp = 0;
          for (std::int64_t d = 0; d < Dk; ++d)
            dotp += static_cast<double>(queries.at(b, hq, i, d)) * static_cast<double>(st.keys.at(b, hq / G, t, d));
          w[static_cast<std::size_t>(t)] = scale * dotp;
          mx = std::max(mx, w[static_cast<std::size_t>(t)]);
        }
        double sum = 0;
        for (std::int64_t t = 0; t < visible; ++t) sum += (w[static_cast<std::size_t>(t)] = std::exp(w[static_cast<std::size_t>(t)] - mx));
        std::fill(o.begin(), o.end(), 0.0);
        for (std::int64_t t = 0; t < visible; ++t)
          for (std::int64_t d = 0; d < Dv; ++d)
            o[static_cast<std::size_t>(d)] += w[static_cast<std::size_t>(t)] * static_cast<double>(st.values.at(b, hq / G, t, d));
        for (std::int64_t d = 0; d < Dv; ++d) out.set(b, hq, i, d, static_cast<float>(o[static_cast<std::size_t>(d)] / sum));
      }
  return out;
}

}  // namespace vq
