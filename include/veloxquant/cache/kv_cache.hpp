// KVCache: the plain cache protocol of mlx_lm, for one attention layer.
//
//   auto [k, v] = cache.update_and_fetch(new_keys, new_values);   // [B, H, S, D] in, [B, H, offset, D] out
//
// The returned tensors are views of the cache's own buffer (no copy). They stay valid as long as
// you hold them, but their contents are only guaranteed until the next call that changes the
// cache (update_and_fetch, trim, from_state), which may write into the same buffer.
// The buffer grows geometrically, so appending a token costs amortised O(1), and never holds
// more than about twice the tokens it was given (or announced by expect_tokens): memory follows the data held.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "veloxquant/core/tensor.hpp"

namespace vq {

// What a cache as it stands costs to store: fixed-width bytes, and bytes after entropy coding (or
// its estimate); both equal for methods that do not entropy-code. Every byte of metadata counted.
struct CacheBytes {
  double fixed_bytes = 0, estimated_bytes = 0;
};

// The largest head dim (D) a cache accepts: far past any model's (64..256), and small enough that
// per-channel arithmetic stays in int.
inline constexpr std::int64_t kMaxHeadDim = std::int64_t{1} << 16;

struct KVState {
  Tensor keys;    // [B, H, offset, D_k]
  Tensor values;  // [B, H, offset, D_v]
};

class KVCache {
 public:
  KVCache() = default;
  virtual ~KVCache() = default;
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  // Append S new tokens and return the whole cache up to offset(). keys and values are [B, H, S, D]
  // with equal B, H, S (D may differ between them) and the same dtype as earlier calls. Throws
  // InvalidArgument on any mismatch; the cache is then unchanged.
  virtual std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values);
  // Append without fetching: what a host that attends through attend() calls. Same checks, errors
  // and resulting cache as update_and_fetch. The default calls update_and_fetch and drops the
  // views; resident caches override it so that nothing dense is materialised.
  virtual void update(const Tensor& keys, const Tensor& values);

  std::int64_t offset() const { return offset_; }
  // A hint that the cache will hold about `tokens` tokens (a loader that knows the prefix it is
  // about to feed): a dense cache (this class, Fp16KVCache) then grows to at least that many at
  // its next growth instead of doubling on the way, so no row is copied twice, in huge pages when
  // the buffer is 2 MiB or more (core/page_vector.hpp map_huge: one page fault per 2 MiB instead
  // of 512). VqKVCache reserves its packed codes for its code-domain loads; other caches that hold
  // codes ignore it. Not a limit: more tokens still fit.
  virtual void expect_tokens(std::int64_t tokens) { expected_ = std::max<std::int64_t>(tokens, 0); }
  // Views of the cached keys and values up to offset().
  virtual KVState state() const;
  // Replace the contents with a copy of `state` (offset becomes its token count).
  virtual void from_state(const KVState& state);
  virtual bool is_trimmable() const { return true; }
  // Drop the last min(n, offset) tokens; returns how many were dropped. n < 0 is an error.
  virtual std::int64_t trim(std::int64_t n);
  // Bytes of memory the cache holds now (allocated buffers, not just the used part).
  virtual std::size_t nbytes() const;
  // Bytes the stored contents cost (not the memory held; see nbytes). A plain KVCache: offset()
  // tokens of K and V at their dtype's size. Methods that quantize override it.
  virtual CacheBytes stored_bytes() const;
  // Class name, as saved with a cache ("KVCache", "CacheGenKVCache").
  virtual std::string kind() const { return "KVCache"; }

  // --- attention over the cache (cache/attention.hpp) ---------------------------------------
  // softmax(scale * Q K^T) V for `queries` [B, Hq, Sq, D_k] (float32 or the cache's dtype), causal
  // over the cache's tokens (the last Sq are the queries' own: query i sees tokens
  // 0 .. offset - Sq + i), grouped-query (Hq a multiple of kv_heads(); query head q reads KV head
  // q / (Hq / kv_heads())). Returns [B, Hq, Sq, D_v] float32. Never materialises the whole K or V:
  // it reads tiles through read_key_tile / read_value_tile. Throws InvalidArgument on bad queries or
  // a non-finite scale; the cache never changes.
  Tensor attend(const Tensor& queries, float scale) const;
  // A cache whose storage mixes its heads (our `vq` with a cross-head transform: one code row
  // serves every head) may compute a whole attend() call itself, all heads at once, rather than
  // through the per-head tile loop below: it writes `out` ([B, Hq, Sq, D_v] float32, the same
  // result within float32 rounding) and returns true. Called by attend() after the queries are
  // checked; the default declines.
  virtual bool attend_own(const Tensor& /*queries*/, float /*scale*/, Tensor& /*out*/) const { return false; }
  // The layout attention reads (0 while the cache is empty).
  std::int64_t batch() const { return keys_buf_.dim(0); }
  std::int64_t kv_heads() const { return keys_buf_.dim(1); }
  std::int64_t key_dim() const { return keys_buf_.dim(3); }
  std::int64_t value_dim() const { return values_buf_.dim(3); }
  DType dtype() const { return keys_buf_.dtype(); }
  // Tokens [t0, t0 + n) of batch b, KV head h as float32 rows, in the cache's attention space (see
  // map_query): returns a pointer to n * key_dim() (value_dim()) contiguous floats. The pointer may
  // be into the cache's own storage (valid until the cache changes) or into `scratch`, which must
  // hold that many floats. Rows are what state() holds, converted to float32 (exactly). The
  // default reads the dense buffers; resident caches override. The caller checks the range.
  virtual const float* read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const;
  virtual const float* read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const;
  // A cache whose tiles are an orthogonal transform R of its rows (k' = R k, v' = R v) maps each
  // query q -> R q once before scoring (q . k = Rq . Rk) and each output o' -> R^T o' once after.
  // Defaults: identity. `q` has key_dim() floats, `out` value_dim().
  virtual void map_query(float* /*q*/) const {}
  virtual void unmap_output(float* /*out*/) const {}
  // Tokens per tile of the attend loop (it clamps the answer to 1 .. kAttentionMaxTileTokens). The
  // default sizes a float32 tile of the wider side to kAttentionTileBytes (16 .. 256 tokens, the
  // float tiles' size for L1/L2); a cache that scores and accumulates on its codes, with per-tile
  // work of its own to amortise, may ask for longer tiles. Only the tiling changes, so the result
  // may differ from the default's in float32 rounding (the online softmax rescales per tile).
  virtual std::int64_t attention_tile_tokens() const;
  // The two steps of a tile that touch K and V, for caches that can do them on their codes
  // without a float32 tile (optional: the defaults read tiles through read_key_tile /
  // read_value_tile into `scratch` and run attention_kernels.hpp's float kernels). `queries`
  // holds nq mapped query rows of key_dim() floats; `scores` gets nq rows of n: scores[r * n + j]
  // = q_r . k_{t0+j}, unscaled. `weights` holds nq rows of n (0 for tokens a row does not see);
  // acc[r * value_dim() + e] += sum_j weights[r * n + j] * v_{t0+j}[e]. `scratch` holds
  // n * key_dim() (value_dim()) floats. Results equal the defaults' within float32 rounding (the
  // order of sums may differ). The caller checks the range.
  virtual void score_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* queries, std::int64_t nq,
                              float* scores, float* scratch) const;
  virtual void accumulate_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* weights,
                                     std::int64_t nq, float* acc, float* scratch) const;

 protected:
  // from_state for caches that quantize what they are fed: empties the buffers, calls `forget` to
  // drop the subclass's own contents, then feeds `state` (copied first: it may view our own
  // buffer) as one update_and_fetch call. An empty state leaves the cache empty.
  void refeed_state(const KVState& state, const std::function<void()>& forget);
  // Check a new chunk against each other and against what the cache holds; throws InvalidArgument.
  void check_chunk(const Tensor& keys, const Tensor& values) const;
  // Append a checked chunk to the buffers (growing them) and advance offset.
  void append(const Tensor& keys, const Tensor& values);
  // Make room for a checked chunk after offset (an empty cache adopts the chunk's layout);
  // the caller writes the rows and advances offset_.
  void make_room(const Tensor& keys, const Tensor& values);
  // The buffers: [B, H, capacity, D]; tokens [0, offset) are valid.
  Tensor keys_buf_;
  Tensor values_buf_;
  std::int64_t offset_ = 0;

 private:
  void reserve(std::int64_t tokens, const Tensor& keys, const Tensor& values);
  std::int64_t expected_ = 0;  // expect_tokens
};

}  // namespace vq
