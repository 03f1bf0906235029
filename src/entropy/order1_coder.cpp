#include "veloxquant/entropy/order1_coder.hpp"

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/frequency_table.hpp"
#include "veloxquant/entropy/rans.hpp"

namespace vq {

namespace {

void put_varint(std::vector<std::uint8_t>& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<std::uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<std::uint8_t>(v));
}
std::uint64_t get_varint(std::span<const std::uint8_t> b, std::size_t& pos) {
  std::uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (pos >= b.size()) throw FormatError("order-1: truncated");
    const std::uint8_t byte = b[pos++];
    v |= static_cast<std::uint64_t>(byte & 0x7f) << shift;
    if (!(byte & 0x80)) return v;
  }
  throw FormatError("order-1: bad varint");
}
// Histogram: entries as in FrequencyTable's format (count > 0, or 0 then run - 1 of zeros).
void put_hist(std::vector<std::uint8_t>& out, std::span<const std::uint32_t> h) {
  for (std::size_t i = 0; i < h.size();) {
    if (h[i]) {
      put_varint(out, h[i++]);
      continue;
    }
    std::size_t run = 0;
    while (i < h.size() && !h[i]) ++i, ++run;
    put_varint(out, 0);
    put_varint(out, run - 1);
  }
}
void get_hist(std::span<const std::uint8_t> b, std::size_t& pos, std::span<std::uint32_t> h) {
  for (std::size_t i = 0; i < h.size();) {
    const std::uint64_t f = get_varint(b, pos);
    if (f) {
      h[i++] = static_cast<std::uint32_t>(f);
      continue;
    }
    const std::uint64_t run = get_varint(b, pos) + 1;
    if (run > h.size() - i) throw FormatError("order-1: bad histogram");
    for (std::uint64_t k = 0; k < run; ++k) h[i++] = 0;
  }
}

}  // namespace

std::vector<std::uint8_t> order1_encode(const Order1Codes& s, bool pooled) {
  require(s.bits >= 1 && s.bits <= 8, "order-1: bits={} must be in 1..8", s.bits);
  const int A = 1 << s.bits;
  const std::size_t n = s.tokens, d = s.channels;
  const std::size_t chans = d * s.slices.size();
  const std::size_t models = pooled ? 1 : chans;  // pooled: one set of context tables for the whole stream
  std::vector<std::uint32_t> hist(models * static_cast<std::size_t>(A) * static_cast<std::size_t>(A), 0);  // [model][ctx][sym]
  std::vector<std::uint8_t> out;
  for (std::size_t sl = 0; sl < s.slices.size(); ++sl) {
    const auto codes = s.slices[sl];
    require(codes.size() == n * d, "order-1: slice {} holds {} codes, not {} tokens x {} channels", sl, codes.size(), n, d);
    for (std::size_t c = 0; c < d; ++c) {
      std::uint32_t* h = hist.data() + (pooled ? 0 : (sl * d + c)) * static_cast<std::size_t>(A * A);
      int prev = 0;
      for (std::size_t t = 0; t < n; ++t) {
        if (codes[t * d + c] >= A) throw InvalidArgument(fmt::format("order-1: code {} needs more than {} bits", codes[t * d + c], s.bits));
        ++h[prev * A + codes[t * d + c]];
        prev = codes[t * d + c];
      }
    }
  }
  for (std::size_t k = 0; k < models * static_cast<std::size_t>(A); ++k)
    put_hist(out, std::span<const std::uint32_t>(hist).subspan(k * static_cast<std::size_t>(A), static_cast<std::size_t>(A)));
  // Symbols grouped by (channel, context), each group in token order.
  std::vector<FrequencyTable> tables;
  std::vector<std::size_t> seg_start;
  std::vector<std::size_t> offset(models * static_cast<std::size_t>(A));
  std::size_t total = 0;
  for (std::size_t k = 0; k < models * static_cast<std::size_t>(A); ++k) {
    offset[k] = total;
    for (int sym = 0; sym < A; ++sym) total += hist[k * static_cast<std::size_t>(A) + static_cast<std::size_t>(sym)];
  }
  std::vector<std::uint16_t> symbols(total);
  std::vector<std::size_t> fill = offset;
  for (std::size_t sl = 0; sl < s.slices.size(); ++sl) {
    const auto codes = s.slices[sl];
    for (std::size_t c = 0; c < d; ++c) {
      const std::size_t base = (pooled ? 0 : (sl * d + c)) * static_cast<std::size_t>(A);
      int prev = 0;
      for (std::size_t t = 0; t < n; ++t) {
        symbols[fill[base + static_cast<std::size_t>(prev)]++] = codes[t * d + c];
        prev = codes[t * d + c];
      }
    }
  }
  std::vector<RansEncodeSegment> segs;
  tables.reserve(models * static_cast<std::size_t>(A));
  for (std::size_t k = 0; k < models * static_cast<std::size_t>(A); ++k) {
    const std::size_t len = (k + 1 < offset.size() ? offset[k + 1] : total) - offset[k];
    if (!len) continue;
    tables.push_back(FrequencyTable::from_histogram(std::span<const std::uint32_t>(hist).subspan(k * static_cast<std::size_t>(A), static_cast<std::size_t>(A))));
  }
  std::size_t ti = 0;
  for (std::size_t k = 0; k < models * static_cast<std::size_t>(A); ++k) {
    const std::size_t len = (k + 1 < offset.size() ? offset[k + 1] : total) - offset[k];
    if (!len) continue;
    segs.push_back({std::span<const std::uint16_t>(symbols).subspan(offset[k], len), &tables[ti++]});
  }
  rans_encode_append(out, segs);
  return out;
}

std::vector<std::uint8_t> order1_decode(std::span<const std::uint8_t> bytes, const Order1Codes& shape, bool pooled) {
  require(shape.bits >= 1 && shape.bits <= 8, "order-1: bits={} must be in 1..8", shape.bits);
  const int A = 1 << shape.bits;
  const std::size_t n = shape.tokens, d = shape.channels;
  const std::size_t chans = d * shape.slices.size(), K = (pooled ? 1 : chans) * static_cast<std::size_t>(A);
  std::vector<std::uint32_t> hist(K * static_cast<std::size_t>(A));
  std::size_t pos = 0;
  for (std::size_t k = 0; k < K; ++k) get_hist(bytes, pos, std::span<std::uint32_t>(hist).subspan(k * static_cast<std::size_t>(A), static_cast<std::size_t>(A)));
  std::vector<std::size_t> offset(K + 1, 0);
  for (std::size_t k = 0; k < K; ++k) {
    std::size_t len = 0;
    for (int sym = 0; sym < A; ++sym) len += hist[k * static_cast<std::size_t>(A) + static_cast<std::size_t>(sym)];
    offset[k + 1] = offset[k] + len;
  }
  if (offset[K] != n * chans) throw FormatError("order-1: histograms disagree with the shape");
  std::vector<std::uint16_t> symbols(offset[K]);
  std::vector<FrequencyTable> tables;
  tables.reserve(K);
  std::vector<RansDecodeSegment> segs;
  for (std::size_t k = 0; k < K; ++k) {
    if (offset[k + 1] == offset[k]) continue;
    tables.push_back(FrequencyTable::from_histogram(std::span<const std::uint32_t>(hist).subspan(k * static_cast<std::size_t>(A), static_cast<std::size_t>(A))));
    segs.push_back({std::span<std::uint16_t>(symbols).subspan(offset[k], offset[k + 1] - offset[k]), &tables.back()});
  }
  rans_decode(bytes.subspan(pos), segs);
  // Rebuild channel-major codes by following the contexts.
  std::vector<std::uint8_t> out(n * chans);
  std::vector<std::size_t> next(offset.begin(), offset.end() - 1);
  for (std::size_t ch = 0; ch < chans; ++ch) {
    int prev = 0;
    for (std::size_t t = 0; t < n; ++t) {
      const std::size_t k = (pooled ? 0 : ch) * static_cast<std::size_t>(A) + static_cast<std::size_t>(prev);
      if (next[k] >= offset[k + 1]) throw FormatError("order-1: context overrun");
      prev = symbols[next[k]++];
      out[ch * n + t] = static_cast<std::uint8_t>(prev);
    }
  }
  return out;
}

}  // namespace vq
