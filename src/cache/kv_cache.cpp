#include "veloxquant/cache/kv_cache.hpp"

#include <cmath>

#include <algorithm>
#include <cstring>
#include <typeinfo>

#include <fmt/format.h>

#include "veloxquant/cache/attention.hpp"
#include "veloxquant/cache/attention_kernels.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/page_vector.hpp"

namespace vq {

namespace {
// Capacity is allocated in multiples of this many tokens (as mlx_lm's step of 256).
constexpr std::int64_t kStep = 256;

void copy_tokens(const Tensor& src, Tensor& dst, std::int64_t dst_start) {
  const std::size_t row_bytes = static_cast<std::size_t>(src.dim(3)) * dtype_size(src.dtype());
  for (std::int64_t b = 0; b < src.dim(0); ++b)
    for (std::int64_t h = 0; h < src.dim(1); ++h) {
      if (src.strides()[2] == src.dim(3) && dst.strides()[2] == dst.dim(3)) {  // rows adjacent: one copy
        // A chunk of many tokens lands on pages not written yet: back them in one call first
        // (core/page_vector.hpp; a decode step's single row is below its minimum and skips it).
        const std::size_t bytes = row_bytes * static_cast<std::size_t>(src.dim(2));
        detail::populate_for_write(dst.row(b, h, dst_start), bytes);
        std::memcpy(dst.row(b, h, dst_start), src.row(b, h, 0), bytes);
      } else {
        for (std::int64_t s = 0; s < src.dim(2); ++s) std::memcpy(dst.row(b, h, dst_start + s), src.row(b, h, s), row_bytes);
      }
    }
}
// A cache buffer; `huge`: one its owner will write whole, mapped in huge pages when 2 MiB or more
// (core/page_vector.hpp map_huge; the pages of a buffer written front to back cost a fault each,
// ~10 us on a virtual machine: most of a loader's time into fp32 hosts). Falls back to the heap.
Tensor new_buffer(const Shape4& shape, DType dtype, bool huge) {
  const std::size_t bytes = static_cast<std::size_t>(checked_numel(shape)) * dtype_size(dtype);
  if (huge && bytes >= (std::size_t{2} << 20))
    if (std::byte* p = detail::map_huge(bytes))
      return Tensor::wrap(p, shape, dtype, std::shared_ptr<void>(p, [bytes](void* q) { detail::unmap_huge(static_cast<std::byte*>(q), bytes); }));
  return Tensor::uninitialized(shape, dtype);
}
}  // namespace

void KVCache::check_chunk(const Tensor& keys, const Tensor& values) const {
  // Called on every decode step: messages are formatted only on failure.
  const auto& k = keys.shape();
  const auto& v = values.shape();
  if (k[0] != v[0] || k[1] != v[1] || k[2] != v[2])
    throw InvalidArgument(fmt::format("keys {} and values {} must agree in batch, heads and tokens", shape_string(k), shape_string(v)));
  if (keys.dtype() != values.dtype())
    throw InvalidArgument(fmt::format("keys are {} but values are {}", dtype_name(keys.dtype()), dtype_name(values.dtype())));
  if (k[0] < 1 || k[1] < 1 || k[3] < 1 || v[3] < 1)
    throw InvalidArgument(fmt::format("keys {} / values {}: batch, heads and head dim must be >= 1", shape_string(k), shape_string(v)));
  if (k[3] > kMaxHeadDim || v[3] > kMaxHeadDim)
    throw InvalidArgument(fmt::format("keys {} / values {}: head dim must be at most {}", shape_string(k), shape_string(v), kMaxHeadDim));
  if (offset_ > 0) {
    const auto& ck = keys_buf_.shape();
    const auto& cv = values_buf_.shape();
    if (k[0] != ck[0] || k[1] != ck[1] || k[3] != ck[3] || v[3] != cv[3])
      throw InvalidArgument(fmt::format("new keys {} / values {} do not match the cache's [B={}, H={}, D_k={}, D_v={}]",
                                        shape_string(k), shape_string(v), ck[0], ck[1], ck[3], cv[3]));
    if (keys.dtype() != keys_buf_.dtype())
      throw InvalidArgument(fmt::format("new keys are {} but the cache holds {}", dtype_name(keys.dtype()), dtype_name(keys_buf_.dtype())));
  }
}

void KVCache::reserve(std::int64_t tokens, const Tensor& keys, const Tensor& values) {
  const bool same_layout = !keys_buf_.empty() && keys_buf_.dtype() == keys.dtype() && keys_buf_.dim(0) == keys.dim(0) &&
                           keys_buf_.dim(1) == keys.dim(1) && keys_buf_.dim(3) == keys.dim(3) &&
                           values_buf_.dim(3) == values.dim(3);
  if (same_layout && keys_buf_.dim(2) >= tokens) return;
  const std::int64_t grown = same_layout ? std::max(tokens, keys_buf_.dim(2) * 2) : tokens;
  // A buffer sized by expect_tokens will be written whole: in huge pages when 2 MiB or more.
  const bool whole = expected_ >= grown;
  std::int64_t cap = std::max(grown, expected_);
  // Round to whole steps only past the first step, so that a few tokens (or a very wide slice of
  // B * H * D) never reserve a step's worth: capacity stays below twice what growth requires.
  if (cap >= kStep) cap = (cap + kStep - 1) / kStep * kStep;
  Tensor nk = new_buffer({keys.dim(0), keys.dim(1), cap, keys.dim(3)}, keys.dtype(), whole);
  Tensor nv = new_buffer({values.dim(0), values.dim(1), cap, values.dim(3)}, values.dtype(), whole);
  if (same_layout && offset_ > 0) {
    copy_tokens(keys_buf_.slice(2, 0, offset_), nk, 0);
    copy_tokens(values_buf_.slice(2, 0, offset_), nv, 0);
  }
  keys_buf_ = std::move(nk);
  values_buf_ = std::move(nv);
}

void KVCache::make_room(const Tensor& keys, const Tensor& values) {
  if (offset_ == 0) {  // an empty cache adopts the layout of its first chunk
    keys_buf_ = Tensor();
    values_buf_ = Tensor();
  }
  reserve(offset_ + keys.dim(2), keys, values);
}

void KVCache::append(const Tensor& keys, const Tensor& values) {
  make_room(keys, values);
  copy_tokens(keys, keys_buf_, offset_);
  copy_tokens(values, values_buf_, offset_);
  offset_ += keys.dim(2);
}

void KVCache::update(const Tensor& keys, const Tensor& values) { (void)update_and_fetch(keys, values); }

std::pair<Tensor, Tensor> KVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  check_chunk(keys, values);
  append(keys, values);
  return {keys_buf_.slice(2, 0, offset_), values_buf_.slice(2, 0, offset_)};
}

KVState KVCache::state() const {
  if (keys_buf_.empty()) return {};
  return {keys_buf_.slice(2, 0, offset_), values_buf_.slice(2, 0, offset_)};
}

void KVCache::from_state(const KVState& state) {
  offset_ = 0;
  keys_buf_ = Tensor();
  values_buf_ = Tensor();
  if (state.keys.empty() && state.values.empty()) return;
  check_chunk(state.keys, state.values);
  append(state.keys, state.values);
}

void KVCache::refeed_state(const KVState& state, const std::function<void()>& forget) {
  const KVState copy{state.keys.contiguous(true), state.values.contiguous(true)};
  offset_ = 0;
  keys_buf_ = Tensor();
  values_buf_ = Tensor();
  forget();
  if (copy.keys.empty() && copy.values.empty()) return;
  update_and_fetch(copy.keys, copy.values);
}

std::int64_t KVCache::trim(std::int64_t n) {
  require(n >= 0, "trim: n must be >= 0, got {}", n);
  n = std::min(n, offset_);
  offset_ -= n;
  return n;
}

Tensor KVCache::attend(const Tensor& queries, float scale) const {
  check_attention_queries(*this, queries, scale);
  Tensor out;
  if (!attend_own(queries, scale, out)) out = detail::attend_tiled_checked(*this, queries, scale);
  // Finite queries over finite K/V whose products overflow float32 (|x| near 1e19 and above, or a
  // lossy method's scales that do) would give inf/NaN: an error, never a result (issue 36).
  if (!out.all_finite())
    throw InvalidArgument(fmt::format("attention over this {} cache is not finite: its keys, values or the queries are too large "
                                      "for float32 arithmetic (scale them down)", kind()));
  return out;
}

std::int64_t KVCache::attention_tile_tokens() const {
  const std::int64_t d = std::max<std::int64_t>({key_dim(), value_dim(), 1});
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(kAttentionTileBytes / 4) / d, 16, 256);
}

namespace {
const float* dense_tile(const Tensor& buf, std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) {
  const std::int64_t D = buf.dim(3);
  const auto Ds = static_cast<std::size_t>(D);
  if (buf.strides()[2] != D) {  // rows not adjacent (a subclass's own buffer): one at a time
    for (std::int64_t i = 0; i < n; ++i) to_f32(buf.row(b, h, t0 + i), buf.dtype(), scratch + i * D, Ds);
    return scratch;
  }
  // A (b, h)'s rows are adjacent: float32 is read in place, other dtypes converted in one call.
  if (buf.dtype() == DType::F32) return reinterpret_cast<const float*>(buf.row(b, h, t0));
  to_f32(buf.row(b, h, t0), buf.dtype(), scratch, static_cast<std::size_t>(n) * Ds);
  return scratch;
}
}  // namespace

const float* KVCache::read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const {
  return dense_tile(keys_buf_, b, h, t0, n, scratch);
}

const float* KVCache::read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const {
  return dense_tile(values_buf_, b, h, t0, n, scratch);
}

namespace {
// The plain cache's float16 rows are scored and summed in registers, with no float32 tile. Only
// for the class itself: a subclass may hold other rows in these buffers than its read_*_tile
// returns (or none at all), so it gets the defaults' tile path.
bool dense_f16_rows(const KVCache& c, const Tensor& buf) {
  return typeid(c) == typeid(KVCache) && buf.dtype() == DType::F16 && buf.strides()[2] == buf.dim(3);
}

// While a tile of one head's float16 rows is worked on, fetch the head's next tile (the rows are
// contiguous, and the loop takes the head's next tile right after this one: attention.cpp's head runs;
// the hardware prefetchers stop at every 4 KiB page, the software prefetch carries the stream
// across them).
void prefetch_next_rows(const Tensor& buf, std::int64_t b, std::int64_t h, std::int64_t t1, std::int64_t n, std::int64_t offset) {
  const std::int64_t rows = std::min(n, offset - t1);
  if (rows <= 0) return;
  const std::byte* p = buf.row(b, h, t1);
  const std::int64_t bytes = rows * buf.dim(3) * 2;
  for (std::int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}
}  // namespace

void KVCache::score_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* queries, std::int64_t nq,
                             float* scores, float* scratch) const {
  const std::int64_t D = key_dim();
  if (dense_f16_rows(*this, keys_buf_)) {
    prefetch_next_rows(keys_buf_, b, h, t0 + n, n, offset_);
    return attn::score_f16(reinterpret_cast<const std::uint16_t*>(keys_buf_.row(b, h, t0)), n, D, D, queries, nq, scores);
  }
  attn::score_f32(read_key_tile(b, h, t0, n, scratch), n, D, D, queries, nq, scores);
}

void KVCache::accumulate_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* weights,
                                    std::int64_t nq, float* acc, float* scratch) const {
  const std::int64_t D = value_dim();
  if (dense_f16_rows(*this, values_buf_)) {
    prefetch_next_rows(values_buf_, b, h, t0 + n, n, offset_);
    return attn::accumulate_f16(reinterpret_cast<const std::uint16_t*>(values_buf_.row(b, h, t0)), n, D, D, weights, nq, acc);
  }
  attn::accumulate_f32(read_value_tile(b, h, t0, n, scratch), n, D, D, weights, nq, acc);
}

std::size_t KVCache::nbytes() const { return keys_buf_.nbytes() + values_buf_.nbytes(); }

CacheBytes KVCache::stored_bytes() const {
  const KVState s = state();
  const double bytes = static_cast<double>(s.keys.nbytes() + s.values.nbytes());
  return {bytes, bytes};
}

}  // namespace vq
