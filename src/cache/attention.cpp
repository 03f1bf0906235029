// The online-softmax attention loop over a cache's tiles, and its double-precision reference.
#include "veloxquant/cache/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <typeinfo>
#include <vector>

#include <fmt/format.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "attention_small_d.hpp"
#include "attention_threads.hpp"
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

// Tokens per tile: the cache's choice (KVCache::attention_tile_tokens), clamped.
std::int64_t tile_tokens(const KVCache& cache) {
  return std::clamp<std::int64_t>(cache.attention_tile_tokens(), 1, kAttentionMaxTileTokens);
}

// Calls with less work than this (tokens x query tokens x batch x KV heads) run their (batch,
// KV head) pairs on the calling thread: handing them to the pool costs more than they take.
constexpr std::int64_t kParallelPairsMinWork = std::int64_t{1} << 16;

// Tokens of one KV head the plain cache's loop reads before it moves to the next head (run_tiles):
// one split of the threaded loop, 512 KiB of float16 keys at D = 128.
constexpr std::int64_t kHeadMajorRunTokens = 2048;

constexpr std::size_t U(std::int64_t x) { return static_cast<std::size_t>(x); }

// Flush-to-zero and denormals-are-zero for the loop's float arithmetic on this thread, the
// caller's mode restored on exit (also when a hook throws). The online softmax makes subnormal
// floats as a matter of course: the weights of tokens far below a row's maximum (the eight-lane
// exp clamps near FLT_MIN, and its products with values underflow), accumulators rescaled by tiny
// factors. On x86 each operation that reads or writes a subnormal takes a microcode assist: at
// 64k tokens they were half of a decode step's time (one process, same caches: vq:bits=2
// 150 -> 67 ms, fp16 dense 138 -> 70 ms; docs/benchmarks.md). Flushing changes a row's terms by
// less than FLT_MIN each, against a sum of weights of at least 1 (the maximum's own exp(0)).
class FlushSubnormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtzDaz); }
  ~FlushSubnormals() { _mm_setcsr((saved_ & ~kFlags) | (_mm_getcsr() & kFlags)); }  // the mode back, the sticky flags kept

 private:
  static constexpr unsigned kFtzDaz = 0x8040;  // MXCSR bits 15 (flush to zero) and 6 (denormals are zero)
  static constexpr unsigned kFlags = 0x3F;     // MXCSR bits 0..5: the exception flags raised so far
  unsigned saved_;
#endif
};

// The shape of one attend call and what every piece of it shares.
struct Plan {
  const KVCache& cache;
  float scale;
  std::int64_t B, Hq, Sq, Dk, Dv, Hkv, G, T, rows, tile;
  detail::SmallDKernel small_d;
  std::vector<float> q;  // [B, Hkv, rows, Dk] mapped queries; row r = g * Sq + i of KV head h
};

// One piece's tile scratch, written by the cache before it is read: not zero-filled (at D = 8 the
// fill cost as much as a decode step's attention over a short context).
struct TileScratch {
  std::vector<float> s;
  std::unique_ptr<float[]> k, v, small;
  explicit TileScratch(const Plan& p)
      : s(U(p.rows * p.tile)),
        k(std::make_unique_for_overwrite<float[]>(U(p.tile * p.Dk))),
        v(std::make_unique_for_overwrite<float[]>(U(p.tile * p.Dv))) {
    if (p.small_d) small = std::make_unique_for_overwrite<float[]>(U(detail::small_d_scratch_floats(p.tile)));
  }
};

// The online-softmax loop over tokens [t_begin, t_end) of batch b for KV heads [h0, h1): m, l and
// acc hold the rows of those heads (head h's rows at (h - h0) * rows), started empty or carried on.
void run_tiles(const Plan& p, std::int64_t b, std::int64_t h0, std::int64_t h1, std::int64_t t_begin, std::int64_t t_end, float* m,
               float* l, float* acc, TileScratch& sc) {
  const KVCache& cache = p.cache;
  const std::int64_t rows = p.rows, Sq = p.Sq, T = p.T, Dk = p.Dk, Dv = p.Dv;
  const float* qb = p.q.data() + b * p.Hkv * rows * Dk;
  // Runs of tiles outside, heads inside, the run's tiles of that head innermost. A run of one tile
  // (every cache but the plain one: token-major storage such as the llama.cpp blocks and fp8)
  // reads the storage front to back, each token's row used by all heads while it is in cache,
  // instead of once per head with a stride the prefetchers lose at every page. The plain cache's
  // rows are head-major, so it takes long runs: each head's rows read as one sequential stream
  // per side instead of 16 streams switched every tile. Each head's rows see the same tiles in
  // the same order either way (same bits).
  const std::int64_t run = std::max<std::int64_t>(1, (typeid(cache) == typeid(KVCache) ? kHeadMajorRunTokens : 0) / p.tile) * p.tile;
  for (std::int64_t c0 = t_begin; c0 < t_end; c0 += run)
    for (std::int64_t h = h0; h < h1; ++h)
      for (std::int64_t t0 = c0; t0 < std::min(t_end, c0 + run); t0 += p.tile) {
        const std::int64_t n = std::min(p.tile, t_end - t0);
        const float* qh = qb + h * rows * Dk;
        float *mh = m + (h - h0) * rows, *lh = l + (h - h0) * rows, *ah = acc + (h - h0) * rows * Dv;
        // Small head dims (D = 8, 16; stories260K) take a kernel that vectorises across a tile's
        // tokens (attention_small_d.hpp) over the float tiles; other dims score and accumulate
        // through the cache's hooks (score_key_tile / accumulate_value_tile, which the block caches
        // run on their codes).
        if (p.small_d) {
          const float* K = cache.read_key_tile(b, h, t0, n, sc.k.get());
          const float* V = cache.read_value_tile(b, h, t0, n, sc.v.get());
          p.small_d({qh, K, V, rows, Sq, T, t0, n, p.scale, mh, lh, ah, sc.small.get()});
          continue;
        }
        // Every row is scored against the whole tile; a row's masked tokens get weight 0.
        cache.score_key_tile(b, h, t0, n, qh, rows, sc.s.data(), sc.k.get());
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t i = r % Sq, last = T - Sq + i;  // the last token query i sees
          attn::softmax_step(sc.s.data() + r * n, n, last - t0 + 1, p.scale, mh[r], lh[r], ah + r * Dv, Dv);
        }
        cache.accumulate_value_tile(b, h, t0, n, sc.s.data(), rows, ah, sc.v.get());
      }
}

// Running state of `count` rows, empty: m = -inf, l = 0, acc = 0.
struct RowState {
  std::vector<float> m, l, acc;
  RowState(std::int64_t count, std::int64_t dv)
      : m(U(count), -std::numeric_limits<float>::infinity()), l(U(count), 0.0f), acc(U(count * dv), 0.0f) {}
};

// Writes the finished rows of batch b (rows of every KV head, in `st`) to out.
void finish(const Plan& p, std::int64_t b, RowState& st, Tensor& out) {
  for (std::int64_t h = 0; h < p.Hkv; ++h)
    for (std::int64_t g = 0; g < p.G; ++g)
      for (std::int64_t i = 0; i < p.Sq; ++i) {
        const std::int64_t r = h * p.rows + g * p.Sq + i;
        float* a = st.acc.data() + r * p.Dv;
        const float inv = 1.0f / st.l[U(r)];  // l >= 1: the max's own term is exp(0)
        for (std::int64_t d = 0; d < p.Dv; ++d) a[d] *= inv;
        p.cache.unmap_output(a);
        std::copy(a, a + p.Dv, reinterpret_cast<float*>(out.row(b, h * p.G + g, i)));
      }
}

// Folds split partials (in order) into `into`: per row, M = max of the maxima, l and acc the sums
// of each part's scaled by e^(m_s - M). A part that saw no token of a row (m = -inf) adds nothing.
void merge_splits(const RowState* parts, std::int64_t n_parts, std::int64_t dv, RowState& into) {
  for (std::size_t r = 0; r < into.m.size(); ++r) {
    float mx = -std::numeric_limits<float>::infinity();
    for (std::int64_t i = 0; i < n_parts; ++i) mx = std::max(mx, parts[i].m[r]);
    float l = 0.0f;
    float* a = into.acc.data() + r * U(dv);
    std::fill(a, a + dv, 0.0f);
    for (std::int64_t i = 0; i < n_parts; ++i) {
      const RowState& s = parts[i];
      if (s.l[r] == 0.0f) continue;
      const float c = std::exp(s.m[r] - mx);
      l += c * s.l[r];
      const float* sa = s.acc.data() + r * U(dv);
      for (std::int64_t d = 0; d < dv; ++d) a[d] += c * sa[d];
    }
    into.m[r] = mx, into.l[r] = l;
  }
}

}  // namespace

Tensor attend_tiled(const KVCache& cache, const Tensor& queries, float scale) {
  check_attention_queries(cache, queries, scale);
  return detail::attend_tiled_checked(cache, queries, scale);
}

Tensor detail::attend_tiled_checked(const KVCache& cache, const Tensor& queries, float scale) {
  const std::int64_t B = queries.dim(0), Hq = queries.dim(1), Sq = queries.dim(2), Dk = cache.key_dim(), Dv = cache.value_dim();
  const std::int64_t Hkv = cache.kv_heads(), G = Hq / Hkv, T = cache.offset(), rows = G * Sq;
  Plan p{cache, scale, B, Hq, Sq, Dk, Dv, Hkv, G, T, rows, tile_tokens(cache), detail::pick_small_d_kernel(Dk, Dv), {}};
  Tensor out = Tensor::uninitialized({B, Hq, Sq, Dv}, DType::F32);
  [[maybe_unused]] FlushSubnormals flush;
  // Every row's query, converted to float32 and mapped into the cache's attention space once.
  p.q.resize(U(B * Hkv * rows * Dk));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hkv; ++h)
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t i = 0; i < Sq; ++i) {
          float* qr = p.q.data() + ((b * Hkv + h) * rows + g * Sq + i) * Dk;
          to_f32(queries.row(b, h * G + g, i), queries.dtype(), qr, U(Dk));
          cache.map_query(qr);
        }

  const std::int64_t split = std::max<std::int64_t>(1, kAttentionSplitTokens / p.tile) * p.tile;
  if (Sq <= kAttentionSplitMaxQueries && T > split) {
    // Flash decoding across threads: split s of batch b covers tokens [s * split, (s + 1) * split).
    const std::int64_t n_splits = (T + split - 1) / split;
    std::vector<RowState> parts(U(B * n_splits), RowState(0, Dv));
    detail::attention_parallel_for(U(B * n_splits), [&](std::size_t item) {
      [[maybe_unused]] FlushSubnormals flush;  // on the thread that runs the piece
      const auto b = static_cast<std::int64_t>(item) / n_splits, s = static_cast<std::int64_t>(item) % n_splits;
      RowState st(Hkv * rows, Dv);
      TileScratch sc(p);
      run_tiles(p, b, 0, Hkv, s * split, std::min(T, (s + 1) * split), st.m.data(), st.l.data(), st.acc.data(), sc);
      parts[item] = std::move(st);
    });
    for (std::int64_t b = 0; b < B; ++b) {
      RowState st(Hkv * rows, Dv);
      merge_splits(parts.data() + b * n_splits, n_splits, Dv, st);
      finish(p, b, st, out);
    }
    return out;
  }

  // Otherwise the (batch, KV head) pairs are independent: each runs the whole loop for its rows,
  // side by side when there is work enough (the same arithmetic as running them in turn).
  std::vector<RowState> states;
  states.reserve(U(B));
  for (std::int64_t b = 0; b < B; ++b) states.emplace_back(Hkv * rows, Dv);
  const bool pairs = B * Hkv > 1 && T * Sq * B * Hkv >= kParallelPairsMinWork && attention_threads() > 1;
  if (pairs) {
    detail::attention_parallel_for(U(B * Hkv), [&](std::size_t item) {
      [[maybe_unused]] FlushSubnormals flush;
      const auto b = static_cast<std::int64_t>(item) / Hkv, h = static_cast<std::int64_t>(item) % Hkv;
      RowState& st = states[U(b)];
      TileScratch sc(p);
      run_tiles(p, b, h, h + 1, 0, T, st.m.data() + h * rows, st.l.data() + h * rows, st.acc.data() + h * rows * Dv, sc);
    });
  } else {
    TileScratch sc(p);
    for (std::int64_t b = 0; b < B; ++b) run_tiles(p, b, 0, Hkv, 0, T, states[U(b)].m.data(), states[U(b)].l.data(), states[U(b)].acc.data(), sc);
  }
  for (std::int64_t b = 0; b < B; ++b) finish(p, b, states[U(b)], out);
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
