#include "veloxquant/entropy/context_coder.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <string>

#include "byte_io.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

constexpr int kMaxContexts = (1 << kContextMaxBits) + 1;
using Histogram = std::array<std::uint64_t, 1 << kContextMaxBits>;

void check_layout(const ContextLayout& l) {
  require(l.bits >= 1 && l.bits <= kContextMaxBits,
          "context coder: bits " + std::to_string(l.bits) + " is outside 1.." + std::to_string(kContextMaxBits));
  require(l.group_start.size() == l.tokens, "context coder: group_start must hold one flag per token");
  require(l.tokens == 0 || l.group_start[0] != 0, "context coder: a group must start at token 0");
  require(l.dim == 0 || l.slices == 0 || l.tokens <= (std::size_t{1} << 40) / l.dim / l.slices, "context coder: stream too large");
}

// Calls f(row, start) for every token row of every slice, in (slice, token) order: row is the
// index of the row's first code, start whether a quantization group starts at that token. Within a
// slice, the previous row (row - dim) holds each channel's previous code, the raw context of a
// row that does not start a group.
template <typename F>
void for_each_row(const ContextLayout& l, F&& f) {
  std::size_t row = 0;
  for (std::size_t s = 0; s < l.slices; ++s)
    for (std::size_t t = 0; t < l.tokens; ++t, row += l.dim) f(row, l.group_start[t] != 0);
}

// Estimated bytes of a class: its order-0 entropy plus its table as FrequencyTable serialises it
// (alphabet varint and precision byte, one varint per present symbol, two bytes per zero run).
double class_cost(const Histogram& h, int A, int scale_bits) {
  std::uint64_t n = 0;
  for (int s = 0; s < A; ++s) n += h[static_cast<std::size_t>(s)];
  if (n == 0) return 0.0;
  double bits = 0.0, table = 2.0;
  const double M = std::ldexp(1.0, scale_bits);
  bool in_zero_run = false;
  for (int s = 0; s < A; ++s) {
    const auto c = static_cast<double>(h[static_cast<std::size_t>(s)]);
    if (c == 0) {
      if (!in_zero_run) table += 2.0;
      in_zero_run = true;
      continue;
    }
    in_zero_run = false;
    bits += c * std::log2(static_cast<double>(n) / c);
    table += c * M / static_cast<double>(n) >= 127.5 ? 2.0 : 1.0;
  }
  return bits / 8.0 + table;
}

Histogram merged(const Histogram& a, const Histogram& b) {
  Histogram m{};
  for (std::size_t s = 0; s < m.size(); ++s) m[s] = a[s] + b[s];
  return m;
}

// Greedy merging of the raw contexts' histograms into classes; returns each raw context's class
// (classes numbered by their smallest raw context) and the class count.
int choose_classes(const std::array<Histogram, kMaxContexts>& raw, int A, int scale_bits, std::array<std::uint8_t, kMaxContexts>& cls) {
  const int R = A + 1;
  std::vector<Histogram> h;
  std::vector<std::vector<int>> members;
  for (int r = 0; r < R; ++r) {
    std::uint64_t n = 0;
    for (const auto c : raw[static_cast<std::size_t>(r)]) n += c;
    if (n == 0) continue;
    h.push_back(raw[static_cast<std::size_t>(r)]);
    members.push_back({r});
  }
  std::vector<double> cost(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) cost[i] = class_cost(h[i], A, scale_bits);
  const std::size_t K0 = h.size();
  std::vector<double> gain(K0 * K0, 0.0);  // cost change of merging i and j (i < j)
  auto pair_gain = [&](std::size_t i, std::size_t j) { return class_cost(merged(h[i], h[j]), A, scale_bits) - cost[i] - cost[j]; };
  for (std::size_t i = 0; i < K0; ++i)
    for (std::size_t j = i + 1; j < K0; ++j) gain[i * K0 + j] = pair_gain(i, j);
  std::vector<bool> alive(K0, true);
  for (;;) {
    double best = -1e-9;
    std::size_t bi = 0, bj = 0;
    for (std::size_t i = 0; i < K0; ++i)
      for (std::size_t j = i + 1; j < K0 && alive[i]; ++j)
        if (alive[j] && gain[i * K0 + j] < best) best = gain[i * K0 + j], bi = i, bj = j;
    if (best >= -1e-9) break;
    h[bi] = merged(h[bi], h[bj]);
    cost[bi] = class_cost(h[bi], A, scale_bits);
    members[bi].insert(members[bi].end(), members[bj].begin(), members[bj].end());
    alive[bj] = false;
    for (std::size_t k = 0; k < K0; ++k)
      if (alive[k] && k != bi) gain[std::min(k, bi) * K0 + std::max(k, bi)] = pair_gain(std::min(k, bi), std::max(k, bi));
  }
  cls.fill(0);  // raw contexts that never occur: class 0
  int K = 0;
  for (std::size_t i = 0; i < K0; ++i) {
    if (!alive[i]) continue;
    for (const int r : members[i]) cls[static_cast<std::size_t>(r)] = static_cast<std::uint8_t>(K);
    ++K;
  }
  return K;
}

// Bits back: the last kRansLanes * tail_per_lane symbols (in segment order) are not rANS-coded but
// packed into the lanes' start states (state = 2^15 + v, v < 2^15), which the stream carries for
// free: lane j holds symbols n' + 32 m + j, m < tail_per_lane, at bits * m. Only when every lane
// codes at least one symbol besides (its state is stored only then).
int tail_per_lane(int bits, std::size_t total) {
  const int k = 15 / bits;
  return total >= static_cast<std::size_t>(kRansLanes) * static_cast<std::size_t>(k + 1) ? k : 0;
}

int map_bits(int K) { return K <= 1 ? 0 : std::bit_width(static_cast<unsigned>(K - 1)); }

}  // namespace

std::vector<std::uint8_t> group_starts(std::span<const std::int64_t> piece_tokens, int group_size) {
  require(group_size >= 1, "context coder: group size must be >= 1");
  std::vector<std::uint8_t> g;
  for (const std::int64_t n : piece_tokens) {
    require(n >= 0, "context coder: negative piece length");
    for (std::int64_t t = 0; t < n; ++t) g.push_back(t % group_size == 0 ? 1 : 0);
  }
  return g;
}

std::vector<std::uint8_t> context_encode(std::span<const std::uint8_t> codes, const ContextLayout& layout, ContextCodedSize* size,
                                         RansKernel kernel) {
  check_layout(layout);
  require(codes.size() == layout.size(), "context coder: code count disagrees with the layout");
  const int A = 1 << layout.bits;
  if (codes.empty()) {  // an empty stream is the single byte K = 1
    if (size) *size = {1, 0, 0, 1};
    return {1};
  }
  std::uint8_t top = 0;
  for (const auto c : codes) top = std::max(top, c);
  require(top < A, "context coder: a code is outside 0.." + std::to_string(A - 1));
  std::array<Histogram, kMaxContexts> raw{};
  const std::size_t D = layout.dim;
  for_each_row(layout, [&](std::size_t row, bool start) {
    const std::uint8_t* q = codes.data() + row;
    if (start) {
      for (std::size_t c = 0; c < D; ++c) ++raw[static_cast<std::size_t>(A)][q[c]];
    } else {
      const std::uint8_t* prev = q - D;
      for (std::size_t c = 0; c < D; ++c) ++raw[prev[c]][q[c]];
    }
  });
  const int scale_bits = table_scale_bits(A);
  std::array<std::uint8_t, kMaxContexts> cls{};
  const int K = choose_classes(raw, A, scale_bits, cls);

  std::vector<std::uint8_t> out;
  out.push_back(static_cast<std::uint8_t>(K));
  if (const int w = map_bits(K); w > 0) {
    std::uint32_t acc = 0;
    int have = 0;
    for (int r = 0; r <= A; ++r) {
      acc |= static_cast<std::uint32_t>(cls[static_cast<std::size_t>(r)]) << have;
      for (have += w; have >= 8; have -= 8, acc >>= 8) out.push_back(static_cast<std::uint8_t>(acc));
    }
    if (have > 0) out.push_back(static_cast<std::uint8_t>(acc));
  }
  const std::size_t model_bytes = out.size();
  std::vector<Histogram> hist(static_cast<std::size_t>(K), Histogram{});
  for (int r = 0; r <= A; ++r)
    for (int s = 0; s < A; ++s) hist[cls[static_cast<std::size_t>(r)]][static_cast<std::size_t>(s)] += raw[static_cast<std::size_t>(r)][static_cast<std::size_t>(s)];
  std::vector<std::size_t> start(static_cast<std::size_t>(K) + 1, 0);
  for (int k = 0; k < K; ++k) {
    std::uint64_t n = 0;
    for (const auto c : hist[static_cast<std::size_t>(k)]) n += c;
    start[static_cast<std::size_t>(k) + 1] = start[static_cast<std::size_t>(k)] + n;
    if (k + 1 < K) entropy_detail::put_varint(out, n);
  }
  std::vector<FrequencyTable> tables;
  tables.reserve(static_cast<std::size_t>(K));
  for (int k = 0; k < K; ++k) {
    std::vector<std::uint32_t> counts(static_cast<std::size_t>(A));
    for (int s = 0; s < A; ++s) counts[static_cast<std::size_t>(s)] = static_cast<std::uint32_t>(hist[static_cast<std::size_t>(k)][static_cast<std::size_t>(s)]);
    tables.push_back(FrequencyTable::from_histogram(counts, scale_bits));
    tables.back().serialize_to(out);
  }
  const std::size_t header_bytes = out.size();
  std::vector<std::uint16_t> symbols(codes.size());
  std::vector<std::size_t> fill(start.begin(), start.end() - 1);
  for_each_row(layout, [&](std::size_t row, bool start) {
    const std::uint8_t* q = codes.data() + row;
    if (start) {
      std::size_t& f = fill[cls[static_cast<std::size_t>(A)]];
      for (std::size_t c = 0; c < D; ++c) symbols[f + c] = q[c];
      f += D;
    } else {
      const std::uint8_t* prev = q - D;
      for (std::size_t c = 0; c < D; ++c) symbols[fill[cls[prev[c]]]++] = q[c];
    }
  });
  const int tail = tail_per_lane(layout.bits, symbols.size());
  const std::size_t coded = symbols.size() - static_cast<std::size_t>(kRansLanes) * static_cast<std::size_t>(tail);
  std::array<std::uint32_t, kRansLanes> states;
  for (std::size_t j = 0; j < states.size(); ++j) {
    std::uint32_t v = 0;
    for (int m = 0; m < tail; ++m) v |= static_cast<std::uint32_t>(symbols[coded + static_cast<std::size_t>(kRansLanes * m) + j]) << (layout.bits * m);
    states[j] = kRansStateLow + v;
  }
  std::vector<RansEncodeSegment> segs;
  for (int k = 0; k < K; ++k) {
    const std::size_t b = start[static_cast<std::size_t>(k)], e = std::min(start[static_cast<std::size_t>(k) + 1], coded);
    if (e > b) segs.push_back({std::span<const std::uint16_t>(symbols).subspan(b, e - b), &tables[static_cast<std::size_t>(k)]});
  }
  rans_encode_append(out, segs, kernel, states);
  if (size) *size = {model_bytes, header_bytes - model_bytes, out.size() - header_bytes, static_cast<std::size_t>(K)};
  return out;
}

void context_decode(std::span<const std::uint8_t> bytes, const ContextLayout& layout, std::span<std::uint8_t> codes, RansKernel kernel) {
  check_layout(layout);
  require(codes.size() == layout.size(), "context coder: output size disagrees with the layout");
  const int A = 1 << layout.bits;
  const std::size_t total = layout.size();
  if (total == 0) {
    if (bytes.size() != 1 || bytes[0] != 1) throw FormatError("context coder: an empty stream must be the single byte 1");
    return;
  }
  entropy_detail::ByteReader r(bytes, "context coder");
  const int K = r.u8();
  if (K < 1 || K > A + 1) throw FormatError("context coder: class count " + std::to_string(K) + " is outside 1.." + std::to_string(A + 1));
  std::array<std::uint8_t, kMaxContexts> cls{};
  if (const int w = map_bits(K); w > 0) {
    std::uint32_t acc = 0;
    int have = 0;
    for (int ctx = 0; ctx <= A; ++ctx) {
      if (have < w) acc |= static_cast<std::uint32_t>(r.u8()) << have, have += 8;
      const int k = static_cast<int>(acc & ((1u << w) - 1));
      acc >>= w;
      have -= w;
      if (k >= K) throw FormatError("context coder: the class map names class " + std::to_string(k) + " of " + std::to_string(K));
      cls[static_cast<std::size_t>(ctx)] = static_cast<std::uint8_t>(k);
    }
    if (acc != 0) throw FormatError("context coder: nonzero padding after the class map");
  }
  std::vector<std::size_t> start(static_cast<std::size_t>(K) + 1, 0);
  for (int k = 0; k + 1 < K; ++k) {
    const std::uint64_t n = r.varint(total, "class length");
    if (n == 0 || n > total - start[static_cast<std::size_t>(k)])
      throw FormatError("context coder: class " + std::to_string(k) + " length " + std::to_string(n) + " does not fit the stream");
    start[static_cast<std::size_t>(k) + 1] = start[static_cast<std::size_t>(k)] + n;
  }
  start[static_cast<std::size_t>(K)] = total;
  if (start[static_cast<std::size_t>(K)] == start[static_cast<std::size_t>(K) - 1])
    throw FormatError("context coder: the last class is empty");
  std::vector<FrequencyTable> tables;
  tables.reserve(static_cast<std::size_t>(K));
  for (int k = 0; k < K; ++k) {
    std::size_t used = 0;
    tables.push_back(FrequencyTable::deserialize(r.rest(), &used));
    r.skip(used);
    if (tables.back().alphabet_size() != A)
      throw FormatError("context coder: table " + std::to_string(k) + " has alphabet " + std::to_string(tables.back().alphabet_size()) +
                        ", expected " + std::to_string(A));
  }
  // dim symbols of padding after the last class: see the row rebuild below.
  std::vector<std::uint16_t> symbols(total + layout.dim, 0);
  const int tail = tail_per_lane(layout.bits, total);
  const std::size_t coded = total - static_cast<std::size_t>(kRansLanes) * static_cast<std::size_t>(tail);
  std::vector<RansDecodeSegment> segs;
  for (int k = 0; k < K; ++k) {
    const std::size_t b = start[static_cast<std::size_t>(k)], e = std::min(start[static_cast<std::size_t>(k) + 1], coded);
    if (e > b) segs.push_back({std::span<std::uint16_t>(symbols).subspan(b, e - b), &tables[static_cast<std::size_t>(k)]});
  }
  std::array<std::uint32_t, kRansLanes> states;
  rans_decode(r.rest(), segs, kernel, states);
  for (std::size_t j = 0; j < states.size(); ++j) {
    const std::uint32_t v = states[j] - kRansStateLow;  // end states are >= 2^15 (the decoder checks)
    if (v >> (layout.bits * tail) != 0)
      throw FormatError("context coder: lane " + std::to_string(j) + " ends in a state that holds no tail symbols (corrupt input)");
    for (int m = 0; m < tail; ++m)
      symbols[coded + static_cast<std::size_t>(kRansLanes * m) + j] = static_cast<std::uint16_t>((v >> (layout.bits * m)) & static_cast<std::uint32_t>(A - 1));
  }
  // Rebuild the rows. A row takes at most dim symbols from a class, so with dim symbols of padding
  // after the last class the reads stay in bounds even when corrupt lengths would let a class run
  // out; every row then checks that none did.
  std::array<std::size_t, kMaxContexts> next{}, end{};
  for (int k = 0; k < K; ++k) next[static_cast<std::size_t>(k)] = start[static_cast<std::size_t>(k)], end[static_cast<std::size_t>(k)] = start[static_cast<std::size_t>(k) + 1];
  const std::size_t D = layout.dim;
  const std::uint16_t* sym = symbols.data();
  for_each_row(layout, [&](std::size_t row, bool first) {
    std::uint8_t* q = codes.data() + row;
    if (first) {
      std::size_t& n = next[cls[static_cast<std::size_t>(A)]];
      for (std::size_t c = 0; c < D; ++c) q[c] = static_cast<std::uint8_t>(sym[n + c]);
      n += D;
    } else {
      const std::uint8_t* prev = q - D;
      for (std::size_t c = 0; c < D; ++c) q[c] = static_cast<std::uint8_t>(sym[next[cls[prev[c]]]++]);
    }
    for (int k = 0; k < K; ++k)
      if (next[static_cast<std::size_t>(k)] > end[static_cast<std::size_t>(k)])
        throw FormatError("context coder: class " + std::to_string(k) + " runs out of symbols (corrupt input)");
  });
  // Every class's symbols were taken: the lengths sum to the total and none ran out.
}

}  // namespace vq
