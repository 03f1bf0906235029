// The online-softmax attention loop over a cache's tiles, and its double-precision reference.
#include "veloxquant/cache/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "attention_small_d.hpp"
#include "veloxquant/cache/attention_kernels.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

void check_attention_queries(const KVCache& cache, const Tensor& queries, double scale) {
  // Runs on every attend call (once per layer per decoded token): messages, and the shape strings
  // in them, are formatted only on failure.
  require(std::isfinite(scale), "attend: scale must be finite, got {}", scale);
  const auto& q = queries.shape();
  require(cache.offset() > 0, "attend: the cache is empty (append the queries' own keys and values first)");
  if (queries.dtype() != DType::F32 && queries.dtype() != cache.dtype())
    throw InvalidArgument(fmt::format("attend: queries are {} but must be float32 or the cache's {}", dtype_name(queries.dtype()),
                                      dtype_name(cache.dtype())));
  if (q[0] != cache.batch())
    throw InvalidArgument(
        fmt::format("attend: queries {} have batch {} but the cache holds batch {}", shape_string(q), q[0], cache.batch()));
  if (q[3] != cache.key_dim())
    throw InvalidArgument(
        fmt::format("attend: queries {} have head dim {} but the cache's keys have {}", shape_string(q), q[3], cache.key_dim()));
  if (!(q[1] >= 1 && q[1] % cache.kv_heads() == 0))
    throw InvalidArgument(fmt::format("attend: queries {} have {} heads, not a positive multiple of the cache's {} KV heads",
                                      shape_string(q), q[1], cache.kv_heads()));
  if (!(q[2] >= 1 && q[2] <= cache.offset()))
    throw InvalidArgument(fmt::format(
        "attend: queries {} have {} tokens but must have 1 .. offset = {} (the queries' own tokens are the cache's last)",
        shape_string(q), q[2], cache.offset()));
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
  std::vector<float> s(U(rows * tile));
  // Tile scratch, written by the cache before it is read: not zero-filled (at D = 8 the fill cost
  // as much as a decode step's attention over a short context).
  const auto kscratch = std::make_unique_for_overwrite<float[]>(U(tile * Dk));
  const auto vscratch = std::make_unique_for_overwrite<float[]>(U(tile * Dv));
  // Small head dims (D = 8, 16; stories260K) take a kernel that vectorises across a tile's tokens
  // (attention_small_d.hpp) over the float tiles; other dims score and accumulate through the
  // cache's hooks (score_key_tile / accumulate_value_tile, which the block caches run on their codes).
  const detail::SmallDKernel small_d = detail::pick_small_d_kernel(Dk, Dv);
  std::unique_ptr<float[]> small_scratch;
  if (small_d) small_scratch = std::make_unique_for_overwrite<float[]>(U(detail::small_d_scratch_floats(tile)));
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
        if (small_d) {
          const float* K = cache.read_key_tile(b, h, t0, n, kscratch.get());
          const float* V = cache.read_value_tile(b, h, t0, n, vscratch.get());
          small_d({q.data() + h * rows * Dk, K, V, rows, Sq, T, t0, n, scale, m.data() + h * rows, l.data() + h * rows, ah, small_scratch.get()});
          continue;
        }
        // Every row is scored against the whole tile; a row's masked tokens get weight 0.
        cache.score_key_tile(b, h, t0, n, q.data() + h * rows * Dk, rows, s.data(), kscratch.get());
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t i = r % Sq, last = T - Sq + i;  // the last token query i sees
          attn::softmax_step(s.data() + r * n, n, last - t0 + 1, scale, m[U(h * rows + r)], l[U(h * rows + r)], ah + r * Dv, Dv);
        }
        cache.accumulate_value_tile(b, h, t0, n, s.data(), rows, ah, vscratch.get());
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
