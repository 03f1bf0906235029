// VqKVCache's resident storage with resident=coded: full 64-token tiles of quantized tokens sealed
// into Rice-coded bytes (seal_coder.hpp) between updates, read back row by row, and unsealed when
// an update must re-pack ("Sealed tiles" in vq/vq_cache.hpp).
#include "veloxquant/vq/vq_cache.hpp"


#include <algorithm>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include <fmt/format.h>

#include "../core/dtype_round.hpp"
#include "code_pack.hpp"
#include "reconstruct_kernels.hpp"
#include "seal_coder.hpp"
#include "veloxquant/vq/vq_reconstruct_at.hpp"
#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/kernel_clones.hpp"
#include "quantizer.hpp"
#include "transform.hpp"
#include "vq_attention_kernels.hpp"
#include "vq_cache_internal.hpp"

namespace vq {

namespace {
// Appends n bytes to a sealed buffer. On the heap it grows to exactly its new size (one copy per
// tile: PageVector's growth by an eighth would leave up to 1/8 of the sealed bytes as spare
// capacity, and nbytes bills it); in its mapping (past kPageVectorHeapBytes) only pages are billed.
std::uint8_t* append_exact(PageVector<std::uint8_t>& v, std::size_t n) {
  if (v.mapped() || v.size() == 0 || v.size() + n > kPageVectorHeapBytes) return v.append(n);
  PageVector<std::uint8_t> grown;
  std::uint8_t* p = grown.append(v.size() + n);  // a first append allocates exactly its size
  std::memcpy(p, v.data(), v.size());
  const std::size_t old = v.size();
  v = std::move(grown);
  return v.data() + old;
}



// resident=coded, between updates: the offsets go when the means give them back exactly (they
// always do but for offsets near kVqMaxOffset, where the float32 product may round), as codes() reads them.
template <class SideQuantT>
void drop_offsets(SideQuantT& sq) {
  if (sq.offset.empty() || sq.mean.size() != sq.offset.size()) return;
  for (std::size_t c = 0; c < sq.offset.size(); ++c)
    if (offset_of_mean(sq.mean[c], sq.step) != sq.offset[c] || vq_offset(sq.offset[c], sq.step) != sq.mean[c]) return;
  std::vector<std::int32_t>().swap(sq.offset);
}

// The packed layout (and the widths it came from: packed rows exist only inside an update, where
// 16-bit fields do) of a resident=coded cache between updates.
template <class SideQuantT>
void drop_layout(SideQuantT& sq) {
  std::vector<std::uint8_t>().swap(sq.width);
  std::vector<std::uint32_t>().swap(sq.bit_at);
  std::vector<std::int32_t>().swap(sq.order);
  std::vector<std::uint32_t>().swap(sq.group_byte);
  std::vector<std::uint8_t>().swap(sq.group_width);
  std::vector<float>().swap(sq.field_mean);
}
}  // namespace

void VqKVCache::ensure_layout() {
  if (!calibrated_ || !layer_) return;
  const int H = layer_->kv_heads;
  for (SideQuant* sq : {&kq_, &vq_}) {
    const int n = sq == &kq_ ? layer_->k.n : layer_->v.n;
    if (!sq->bit_at.empty()) continue;
    if (sq->width.empty()) sq->width.assign(sz(n), 16);  // 16 bits: every code fits (|q| <= 32640), nothing escapes
    lay_out(*sq, n, H);
  }
}

void VqKVCache::seal_due() {
  if (!config_.coded) return;
  if (quantized_ > sealed_) {
    const std::int64_t first = sealed_ / kSealTokens * kSealTokens;  // the open tile's first token (or sealed_)
    const std::int64_t rows = quantized_ - first, tiles = rows / kSealTokens, rest = rows % kSealTokens;
    // The open tile's codes (decoded) and the packed rows', after the full tile before them (rows copy from it).
    const std::int64_t from = first >= kSealTokens ? first - kSealTokens : first, all = quantized_ - from;
    const VqLayerCodes lc = codes(from, quantized_);
    const std::int64_t B = lc.batch;
    std::vector<std::uint8_t> bytes;
    for (int side = 0; side < 2; ++side) {
      const VqSideCodes& sc = side == 0 ? lc.k : lc.v;
      SideStore& st = side == 0 ? ks_ : vs_;
      const int n = sc.n;
      if (st.sealed.size() != sz(B)) st.sealed.resize(sz(B)), st.tile_at.resize(sz(B)), st.open.resize(sz(B));
      for (std::int64_t b = 0; b < B; ++b) {
        const std::int16_t* q = sc.codes.data() + sz(b * all + (first - from)) * sz(n);
        // The tile before each new one and its rows that copy from the tile before it.
        const std::int16_t* prev = from < first ? q - sz(kSealTokens) * sz(n) : nullptr;
        std::uint64_t prev_back = prev ? seal::copies_back(st.sealed[sz(b)].data() + st.tile_at[sz(b)].back(), kSealTokens) : 0;
        if (tiles > 0) {
          bytes.clear();
          auto& at = st.tile_at[sz(b)];
          auto& sealed = st.sealed[sz(b)];
          const std::size_t end = sealed.size() >= 8 ? sealed.size() - 8 : 0;  // past the last tile: the 8 zero bytes
          for (std::int64_t i = 0; i < tiles; ++i) {
            at.push_back(static_cast<std::uint32_t>(end + bytes.size()));
            const std::int16_t* tile = q + sz(i * kSealTokens) * sz(n);
            prev_back = seal::encode_tile(tile, kSealTokens, n, bytes, prev, prev_back);
            prev = tile;
          }
          if (sealed.size() >= 8) sealed.shrink(sealed.size() - 8);
          std::uint8_t* dst = append_exact(sealed, bytes.size() + 8);
          std::memcpy(dst, bytes.data(), bytes.size());
          std::memset(dst + bytes.size(), 0, 8);
          if (at.capacity() > at.size()) at.shrink_to_fit();
        }
        // The open tile, coded whole again into a buffer of its size (+ 8 zero bytes), or released.
        bytes.clear();
        if (rest > 0) {
          seal::encode_tile(q + sz(tiles * kSealTokens) * sz(n), rest, n, bytes, prev, prev_back);
          bytes.resize(bytes.size() + 8, 0);
        }
        std::vector<std::uint8_t>(bytes).swap(st.open[sz(b)]);
      }
      // Every packed row and its escapes leave, their per-batch lists too (update makes them again).
      std::vector<PackedRows>().swap(st.packed);
      std::vector<std::vector<Escape>>().swap(st.escapes);
    }
    sealed_ = quantized_;
  }
  drop_layout(kq_);
  drop_layout(vq_);
  drop_offsets(kq_);
  drop_offsets(vq_);
}

void VqKVCache::unseal() {
  if (sealed_ == 0) return;
  ensure_layout();
  const VqLayerCodes lc = codes(0, quantized_);
  const std::int64_t B = lc.batch, Q = quantized_;
  const int H = static_cast<int>(keys_buf_.dim(1));
  std::vector<code_pack::Escape> esc;
  for (int side = 0; side < 2; ++side) {
    const VqSideCodes& sc = side == 0 ? lc.k : lc.v;
    const SideQuant& sq = side == 0 ? kq_ : vq_;
    SideStore& st = side == 0 ? ks_ : vs_;
    st.packed.resize(sz(B)), st.escapes.resize(sz(B));
    for (std::int64_t b = 0; b < B; ++b) {
      PackedRows buf;
      buf.resize(packed_bytes(Q, sq.bit_at[sz(sc.n)]));
      esc.clear();
      code_pack::pack_rows(pack_layout(sq, sc.n, H), sc.codes.data() + sz(b * Q) * sz(sc.n), Q, 0, buf.data(), esc);
      st.packed[sz(b)] = std::move(buf);
      std::vector<Escape> kept;
      append_escapes(kept, esc);
      st.escapes[sz(b)] = std::move(kept);
    }
    st.sealed.clear();
    st.tile_at.clear();
    st.open.clear();
  }
  sealed_ = 0;
  seal_gen_ = detail::next_seal_gen();
}

const std::int16_t* VqKVCache::sealed_row(int side, std::int64_t b, std::int64_t t) const {
  // Two decoded tiles per side per thread, each named by (contents, batch row, tile, its tokens: the
  // open tile grows, and its first tokens' codes stay what they were) and whether it is whole (a
  // tile decoded only as the one before another has its own copies from the tile before it unset).
  // Tiles read in order find the tile before in the other slot.
  struct Slot {
    std::uint64_t gen = 0;
    std::int64_t b = -1, tile = -1, rows = 0;
    bool whole = false;
    std::vector<std::int16_t> codes;
  };
  thread_local Slot slots[2][2];
  Slot* s = slots[side];
  const std::int64_t tile = t / kSealTokens, rows = std::min(kSealTokens, sealed_ - tile * kSealTokens);
  const int n = side == 0 ? layer_->k.n : layer_->v.n;
  const SideStore& st = side == 0 ? ks_ : vs_;
  auto holds = [&](const Slot& x, std::int64_t i, std::int64_t r) { return x.gen == seal_gen_ && x.b == b && x.tile == i && x.rows == r; };
  auto bytes_of = [&](std::int64_t i) {
    const auto& at = st.tile_at[sz(b)];
    return sz(i) < at.size() ? st.sealed[sz(b)].data() + at[sz(i)] : st.open[sz(b)].data();
  };
  auto decode = [&](Slot& x, std::int64_t i, std::int64_t r, const std::int16_t* prev, bool whole) {
    x.codes.resize(sz(kSealTokens) * sz(n));
    seal::decode_tile(bytes_of(i), r, n, x.codes.data(), prev);
    x.gen = seal_gen_, x.b = b, x.tile = i, x.rows = r, x.whole = whole;
  };
  const std::int64_t at_row = t - tile * kSealTokens;
  for (int i = 0; i < 2; ++i)
    if (holds(s[i], tile, rows) && s[i].whole) return s[i].codes.data() + sz(at_row) * sz(n);
  // s[1] becomes the tile before (when this one copies from it), s[0] this tile.
  const std::uint8_t* src = bytes_of(tile);
  const std::int16_t* prev = nullptr;
  if (tile > 0 && seal::copies_back(src, rows) != 0) {
    if (holds(s[0], tile - 1, kSealTokens)) std::swap(s[0], s[1]);
    if (!holds(s[1], tile - 1, kSealTokens)) {
      const std::uint8_t* before = bytes_of(tile - 1);
      decode(s[1], tile - 1, kSealTokens, nullptr, tile - 1 == 0 || seal::copies_back(before, kSealTokens) == 0);
    }
    prev = s[1].codes.data();
  } else if (holds(s[0], tile - 1, kSealTokens)) {
    std::swap(s[0], s[1]);  // keep the tile before for the reader's next tile
  }
  decode(s[0], tile, rows, prev, true);
  return s[0].codes.data() + sz(at_row) * sz(n);
}


}  // namespace vq
