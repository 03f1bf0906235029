// A vq layer's codes packed off the cache, at a packed layout a VqKVCache holds or will hold
// (vq_cache.hpp, "Packed layout"), for VqKVCache::append_packed.
//
// Why: the store's code-domain loads (store/prefix_loader.hpp) decode chunks on decoder threads
// and feed them in order on one thread. Packing the codes on the decoder thread, right after their
// decode (while they are in its cache), leaves the feeding thread a copy of the packed rows and
// the escapes; the code arrays go back to the decoders at once.
//
// A packed chunk is exact whatever its layout: append_packed copies its rows where the layout is
// the cache's (or the cache is empty and takes it), and otherwise unpacks and appends the codes as
// append_codes does. Layouts only change memory, never values.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "veloxquant/vq/codec.hpp"

namespace vq {

// One side's packed layout: per coefficient its field width (its group's: 1..8 or 16) and the
// field order, bit positions and groups derived from the widths (the cache's lay_out, one
// definition). Two layouts pack alike when their widths and orders are equal.
struct VqFieldLayout {
  int n = 0, heads = 0;
  std::vector<std::uint8_t> width;        // [n]
  std::vector<std::int32_t> order;        // [n]: coefficient at field position p of head h (h*d + p)
  std::vector<std::uint32_t> bit_at;      // [n + 1]: first bit of coefficient c in a row; [n] = row bits
  std::vector<std::uint32_t> group_byte;  // per group of 8 field positions (head-major)
  std::vector<std::uint8_t> group_width;
  std::uint32_t row_bytes() const { return bit_at.empty() ? 0 : bit_at.back() / 8; }
  bool same(const VqFieldLayout& o) const { return n == o.n && heads == o.heads && width == o.width && order == o.order; }
  // The layout of preferred widths (n = widths.size(), each 1..16), e.g. a cache's key_widths().
  // Throws InvalidArgument on heads that do not divide n or a width outside 1..16.
  static VqFieldLayout from_widths(std::vector<std::uint8_t> widths, int heads);
};

struct VqPackedEscape {
  std::int32_t row, c, q;  // row (b * tokens + t), coefficient, code
};

struct VqPackedSide {
  std::shared_ptr<const VqFieldLayout> layout;
  std::vector<std::uint8_t> rows;         // batch * tokens rows of layout->row_bytes() (b-major), + 8 zero bytes
  std::vector<VqPackedEscape> escapes;    // codes outside their fields, sorted by (row, c)
};

// Made by vq_pack_codes only (append_packed trusts its rows).
struct VqPackedCodes {
  VqLayerCodes meta;  // batch, tokens and each side's n, step, offsets and shifts (filled); no codes
  VqPackedSide k, v;
};

// Packs `codes` at the two layouts (of codes.k.n / codes.v.n coefficients). The code arrays are
// only read (the caller reuses them). Throws InvalidArgument (as append_codes) on inconsistent
// arrays or a code beyond the coder's reach (|q| > vq_max_code(kVqMaxShift)).
// `reuse`: a packed chunk no longer needed, whose arrays are written over (no allocation or zeroing
// when they are the size needed: a loader's chunks of one shape all are).
VqPackedCodes vq_pack_codes(const VqLayerCodes& codes, std::shared_ptr<const VqFieldLayout> k, std::shared_ptr<const VqFieldLayout> v,
                            VqPackedCodes&& reuse = {});
// The codes back (escapes in their places): the codes vq_pack_codes was given.
VqLayerCodes vq_unpack_codes(const VqPackedCodes& packed);

}  // namespace vq
