#include "veloxquant/entropy/context_coder.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <string>

#include "byte_io.hpp"
#include "rans_kernels.hpp"
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

// Bits back: the last kRansLanes * tail_per_lane symbols (in stream order) are not rANS-coded but
// packed into the lanes' start states (state = 2^15 + v, v < 2^15), which the stream carries for
// free: lane j holds symbols n' + 32 m + j, m < tail_per_lane, at bits * m. Only when every lane
// codes at least one symbol besides (its state is stored only then).
int tail_per_lane(int bits, std::size_t total) {
  const int k = 15 / bits;
  return total >= static_cast<std::size_t>(kRansLanes) * static_cast<std::size_t>(k + 1) ? k : 0;
}

// The stream's symbol order: token by token, all slices' channels of a token together
// ((slice, channel) index s * dim + c), so that a lane's previous-token context is C = slices * dim
// symbols back and never inside its own group of 32 when C >= 32.
std::vector<std::uint8_t> to_token_channel(std::span<const std::uint8_t> codes, const ContextLayout& l) {
  std::vector<std::uint8_t> tc(codes.size());
  const std::size_t C = l.slices * l.dim;
  for (std::size_t s = 0; s < l.slices; ++s)
    for (std::size_t t = 0; t < l.tokens; ++t)
      std::copy_n(codes.data() + (s * l.tokens + t) * l.dim, l.dim, tc.data() + t * C + s * l.dim);
  return tc;
}

void from_token_channel(std::span<const std::uint8_t> tc, const ContextLayout& l, std::span<std::uint8_t> codes) {
  const std::size_t C = l.slices * l.dim;
  for (std::size_t s = 0; s < l.slices; ++s)
    for (std::size_t t = 0; t < l.tokens; ++t)
      std::copy_n(tc.data() + t * C + s * l.dim, l.dim, codes.data() + (s * l.tokens + t) * l.dim);
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
  (void)kernel;  // one encoder: the per-symbol tables leave nothing for the AVX2 encoder's registers
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
  const std::size_t T = layout.tokens, C = layout.slices * layout.dim, n = codes.size();
  const std::vector<std::uint8_t> tc = to_token_channel(codes, layout);
  std::array<Histogram, kMaxContexts> raw{};
  for (std::size_t t = 0; t < T; ++t) {
    const std::uint8_t* q = tc.data() + t * C;
    if (layout.group_start[t]) {
      for (std::size_t c = 0; c < C; ++c) ++raw[static_cast<std::size_t>(A)][q[c]];
    } else {
      const std::uint8_t* prev = q - C;
      for (std::size_t c = 0; c < C; ++c) ++raw[prev[c]][q[c]];
    }
  }
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
  std::vector<FrequencyTable> tables;
  std::vector<std::vector<rans_detail::EncSym>> enc;
  for (int k = 0; k < K; ++k) {
    std::vector<std::uint32_t> counts(static_cast<std::size_t>(A), 0);
    for (int r = 0; r <= A; ++r)
      if (cls[static_cast<std::size_t>(r)] == k)
        for (int v = 0; v < A; ++v) counts[static_cast<std::size_t>(v)] += static_cast<std::uint32_t>(raw[static_cast<std::size_t>(r)][static_cast<std::size_t>(v)]);
    tables.push_back(FrequencyTable::from_histogram(counts, scale_bits));
    tables.back().serialize_to(out);
    enc.push_back(rans_detail::make_enc_syms(tables.back()));
  }
  const std::size_t header_bytes = out.size();

  // Bits back: the tail rides in the start states; the rest is coded backwards, lane i % 32.
  const int tail = tail_per_lane(layout.bits, n);
  const std::size_t coded = n - static_cast<std::size_t>(kRansLanes) * static_cast<std::size_t>(tail);
  std::uint32_t x[kRansLanes];
  for (std::size_t j = 0; j < static_cast<std::size_t>(kRansLanes); ++j) {
    std::uint32_t v = 0;
    for (int m = 0; m < tail; ++m) v |= static_cast<std::uint32_t>(tc[coded + static_cast<std::size_t>(kRansLanes * m) + j]) << (layout.bits * m);
    x[j] = kRansStateLow + v;
  }
  std::vector<std::uint16_t> words(coded + 1);
  std::uint16_t* const wend = words.data() + words.size();
  std::uint16_t* ptr = wend;
  std::size_t t = coded > 0 ? (coded - 1) / C : 0, c = coded > 0 ? (coded - 1) % C : 0;  // token and channel of symbol i
  for (std::size_t i = coded; i-- > 0;) {
    const int ctx = layout.group_start[t] ? A : tc[i - C];
    const rans_detail::EncSym& e = enc[cls[static_cast<std::size_t>(ctx)]][tc[i]];
    std::uint32_t& xi = x[i & (kRansLanes - 1)];
    // Branch-free renormalisation as in rans_detail::encode_fast: the word is always stored below
    // ptr, which only moves when it was needed (words has one slot more than symbols).
    const std::uint32_t renorm = xi >= e.x_max;
    ptr[-1] = static_cast<std::uint16_t>(xi);
    ptr -= renorm;
    xi >>= renorm << 4;
    const std::uint32_t q = static_cast<std::uint32_t>((static_cast<std::uint64_t>(xi) * e.rcp_freq) >> 32) >> e.rcp_shift;
    xi = xi + e.bias + q * e.cmpl_freq;
    if (c-- == 0) c = C - 1, --t;  // (wraps once after symbol 0, unused then)
  }
  entropy_detail::put_varint(out, coded);
  for (std::size_t j = 0; j < std::min<std::size_t>(coded, kRansLanes); ++j)
    for (int b = 0; b < 4; ++b) out.push_back(static_cast<std::uint8_t>(x[j] >> (8 * b)));
  for (const std::uint16_t* w = ptr; w != wend; ++w) {
    out.push_back(static_cast<std::uint8_t>(*w));
    out.push_back(static_cast<std::uint8_t>(*w >> 8));
  }
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
  const int scale_bits = table_scale_bits(A);
  const std::size_t M = std::size_t{1} << scale_bits;
  std::vector<std::uint32_t> packed(static_cast<std::size_t>(K) * M);
  rans_detail::DecTables d;
  for (int k = 0; k < K; ++k) {
    std::size_t used = 0;
    const FrequencyTable t = FrequencyTable::deserialize(r.rest(), &used);
    r.skip(used);
    if (t.alphabet_size() != A || t.scale_bits() != scale_bits)
      throw FormatError("context coder: table " + std::to_string(k) + " has alphabet " + std::to_string(t.alphabet_size()) + " at " +
                        std::to_string(t.scale_bits()) + " bits, expected " + std::to_string(A) + " at " + std::to_string(scale_bits));
    d.build(t, false);  // packed: (freq - 1) | (slot - cum) << s | symbol << 2s
    std::copy_n(d.packed.data(), M, packed.data() + static_cast<std::size_t>(k) * M);
  }
  const int tail = tail_per_lane(layout.bits, total);
  const std::size_t coded = total - static_cast<std::size_t>(kRansLanes) * static_cast<std::size_t>(tail);
  if (r.varint(total, "symbol count") != coded) throw FormatError("context coder: the rANS stream holds the wrong number of symbols");
  std::uint32_t x[kRansLanes];
  for (std::size_t j = 0; j < static_cast<std::size_t>(kRansLanes); ++j) {
    x[j] = kRansStateLow;
    if (j < coded) {
      x[j] = r.u32le();
      if (x[j] < kRansStateLow || x[j] >= (kRansStateLow << 16))
        throw FormatError("context coder: lane " + std::to_string(j) + " state is outside [2^15, 2^31)");
    }
  }
  const std::uint8_t* p = r.rest().data();
  const std::uint8_t* const end = p + r.remaining();
  if (r.remaining() % 2) throw FormatError("context coder: payload has an odd number of bytes");

  const std::size_t C = layout.slices * layout.dim;
  std::vector<std::uint8_t> tc(total);
  std::size_t i = 0;
  if (kernel != RansKernel::Scalar && rans_avx2_available() && C % kRansLanes == 0)
    p = rans_detail::decode_context_avx2(x, tc.data(), i, coded, C, layout.group_start.data(), cls.data(), A, scale_bits, packed.data(), p, end);
  const std::uint32_t mask = static_cast<std::uint32_t>(M - 1);
  for (std::size_t t = i / C, c = i % C; i < coded; ++i) {
    const int ctx = layout.group_start[t] ? A : tc[i - C];
    std::uint32_t& xi = x[i & (kRansLanes - 1)];
    const std::uint32_t e = packed[(static_cast<std::size_t>(cls[static_cast<std::size_t>(ctx)]) << scale_bits) + (xi & mask)];
    tc[i] = static_cast<std::uint8_t>(e >> (2 * scale_bits));
    xi = ((e & mask) + 1) * (xi >> scale_bits) + ((e >> scale_bits) & mask);
    if (xi < kRansStateLow) {
      if (end - p < 2) throw FormatError("context coder: payload truncated (ran out of renormalisation words)");
      xi = xi << 16 | static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8;
      p += 2;
    }
    if (++c == C) c = 0, ++t;
  }
  if (p != end) throw FormatError("context coder: " + std::to_string((end - p) / 2) + " renormalisation words left over (corrupt)");
  for (std::size_t j = 0; j < static_cast<std::size_t>(kRansLanes); ++j) {
    const std::uint32_t v = x[j] - kRansStateLow;
    if (v >> (layout.bits * tail) != 0)
      throw FormatError("context coder: lane " + std::to_string(j) + " ends in a state that holds no tail symbols (corrupt input)");
    for (int m = 0; m < tail; ++m)
      tc[coded + static_cast<std::size_t>(kRansLanes * m) + j] = static_cast<std::uint8_t>((v >> (layout.bits * m)) & static_cast<std::uint32_t>(A - 1));
  }
  from_token_channel(tc, layout, codes);
}

}  // namespace vq
