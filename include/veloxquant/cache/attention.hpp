// Attention over a cache: out = softmax(scale * Q K^T) V, causal, grouped-query, computed by the
// cache's own storage a tile of tokens at a time (flash decoding).
//
// What a reader must know first:
// - The loop knows nothing of codes. Per tile of tokens and KV head it asks the cache to score
//   the tile's K rows against every query row that shares the KV head
//   (KVCache::score_key_tile), runs the online-softmax step per row (attention_kernels.hpp: a
//   running max m, a running sum l and an accumulator acc[Dv]; after each tile, acc and l are
//   rescaled by exp(m_old - m_new)), and asks the cache to add the tile's weighted V rows
//   (KVCache::accumulate_value_tile). The defaults of those two read float32 tiles
//   (KVCache::read_key_tile / read_value_tile, kTileBytes of float32 per side: in L1/L2); a cache
//   may override them to work on its codes in registers. Never the whole K or V at once.
// - Order: batch, then runs of tiles, then KV heads, then the run's tiles of that head. Caches
//   other than the plain KVCache (token-major storage: a token's row of every head together)
//   run one tile at a time, so they are read front to back; the plain cache's head-major rows are
//   read in runs of 2048 tokens per head, one sequential stream per side. The order never
//   changes a head's arithmetic. A cache may store in a transformed space (a rotation): it maps the query once
//   before the loop and the output once after it (KVCache::map_query / unmap_output).
// - Causality: the queries are the cache's last Sq tokens. Query i (0-based) sees tokens
//   0 .. offset - Sq + i, inclusive.
// - Grouped-query: Hq = G * Hkv; query head q reads KV head q / G (llama.cpp, llama2.c and
//   mlx_lm's order). Each K/V tile is read once per KV head for all its G * Sq query rows.
// - Arithmetic is float32 (scores, exp, accumulation), so results agree with attend_ref (double)
//   within float32 rounding, not bit for bit.
// - Threads (flash decoding across cores). A decode-sized call (Sq <= kAttentionSplitMaxQueries)
//   over a long context (offset > kAttentionSplitTokens) cuts the tokens into splits of
//   kAttentionSplitTokens (whole tiles; the split points depend on offset and D only). Each
//   split runs the same tile loop from an empty state and leaves per row its own (m, l, acc);
//   the partials are then merged in split order: M = max m_s, l = sum l_s e^(m_s - M),
//   acc = sum acc_s e^(m_s - M). Any other call, above a work threshold, runs its (batch, KV
//   head) pairs side by side, each exactly as the single loop does. The splits or pairs run on
//   attention_threads() threads (set_attention_threads; 1, the default, runs them in order on
//   the calling thread), and the result is bit for bit the same for every thread count: which
//   thread runs a piece never changes its arithmetic or the order of the merge. The hooks a
//   cache overrides (read_*_tile, score_key_tile, accumulate_value_tile, map_query,
//   unmap_output) are const and must be safe to call from several threads at once, each with its
//   own scratch.
//
// Errors (InvalidArgument, the cache unchanged; attention never changes a cache): queries not
// [B, Hq, Sq, D_k] with the cache's B and D_k, Hq not a positive multiple of the cache's KV heads,
// Sq < 1 or Sq > offset, a dtype other than float32 or the cache's own, non-finite queries, or a
// non-finite scale.
#pragma once
#include <cstddef>
#include <cstdint>

#include "veloxquant/core/tensor.hpp"

namespace vq {

class KVCache;

// Float32 bytes of one side's tile: tokens per tile = clamp(kTileBytes / (4 * D), 16, 256), the
// default of KVCache::attention_tile_tokens().
inline constexpr std::size_t kAttentionTileBytes = 16 * 1024;
// The longest tile a cache may ask for (KVCache::attention_tile_tokens, clamped to 1 .. this):
// one split of the threaded loop.
inline constexpr std::int64_t kAttentionMaxTileTokens = 2048;

// Tokens per split of a long decode-sized call (a multiple of every tile size up to 256 tokens
// when D is a power of two; otherwise rounded down to whole tiles): 2048 tokens of D = 128 in
// float16 are 1 MiB of K and V per KV head, enough work per split to pay for handing it to a
// thread, and 64k tokens make 32 splits, enough to keep 16 cores busy.
inline constexpr std::int64_t kAttentionSplitTokens = 2048;
// The most query tokens (Sq) a call may have for its tokens to be split: each split keeps its own
// accumulators for every query row, so a prefill-sized call runs (batch, KV head) pairs instead.
inline constexpr std::int64_t kAttentionSplitMaxQueries = 16;
// The largest thread count set_attention_threads accepts.
inline constexpr int kMaxAttentionThreads = 1024;

// Threads that attend() uses in this process (default 1: everything on the calling thread; the
// model's eval/rd run their own windows on threads and leave it at 1). set_attention_threads(n)
// returns the previous count; n = 0 means every hardware thread. Throws InvalidArgument for
// n < 0 or n > kMaxAttentionThreads. Set it between calls, not while another thread attends.
int attention_threads();
int set_attention_threads(int n);

// Throws InvalidArgument naming the problem when `queries` or `scale` cannot attend over `cache`.
void check_attention_queries(const KVCache& cache, const Tensor& queries, double scale);

// The shared online-softmax loop (what KVCache::attend runs): [B, Hq, Sq, D_v] float32.
Tensor attend_tiled(const KVCache& cache, const Tensor& queries, float scale);
namespace detail {
// attend_tiled without check_attention_queries (KVCache::attend has checked them).
Tensor attend_tiled_checked(const KVCache& cache, const Tensor& queries, float scale);
}  // namespace detail

// The reference: plain softmax(scale Q K^T) V over cache.state() (the cache's reconstruction),
// scores, softmax and weighted sum in double, with the same causal mask and head grouping and the
// same errors. Slow (materialises K and V); for tests and checks.
Tensor attend_ref(const KVCache& cache, const Tensor& queries, double scale);

}  // namespace vq
