#include "seal_coder.hpp"

#include <algorithm>
#include <bit>
#include <cstring>

namespace vq::seal {
namespace {

constexpr std::uint8_t kRunMode = 31;  // mode_c of a zero-run coefficient (k = 15 with delta is not offered)
constexpr unsigned kRunKrBits = 3, kRunKvBits = 2;
constexpr unsigned kCopyBits = 7;  // d - 1 of a row copy: d <= 127 reaches every row of the previous tile

inline std::uint32_t zigzag(std::int32_t q) { return (static_cast<std::uint32_t>(q) << 1) ^ static_cast<std::uint32_t>(q >> 31); }
inline std::int32_t unzigzag(std::uint32_t z) { return static_cast<std::int32_t>(z >> 1) ^ -static_cast<std::int32_t>(z & 1); }

inline unsigned rice_bits(std::uint32_t z, unsigned k) {
  const std::uint32_t u = z >> k;
  return u < kRiceEscape ? u + 1 + k : kRiceEscape + kRiceRawBits;
}

// The value coded for code r of coefficient c: the code, or (delta) its difference from row r - 1's
// (row 0's from 0).
inline std::int32_t coded_value(const std::int16_t* codes, std::int64_t r, int n, int c, bool delta) {
  const std::int32_t q = codes[r * n + c];
  return delta && r > 0 ? q - codes[(r - 1) * n + c] : q;
}

// What a tile holds besides its values: row copies and per coefficient its mode.
struct Plan {
  std::int64_t rows = 0;
  bool copies = false;
  std::uint8_t copy[kMaxTileRows] = {};  // d (row r is row r - d), 0: values
  std::vector<std::uint8_t> mode, kr, kv;
};

std::uint64_t row_hash(const std::int16_t* q, int n) {
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int c = 0; c < n; ++c) x = (x ^ static_cast<std::uint16_t>(q[c])) * 0x100000001B3ull;
  return x;
}

// Row copies: each row's nearest earlier identical row, in the tile or in the previous tile (rows
// of it that are not copies from the tile before it).
void find_copies(const std::int16_t* codes, std::int64_t rows, int n, const std::int16_t* prev, std::uint64_t prev_back, Plan& p) {
  p.copies = false;
  std::fill(p.copy, p.copy + kMaxTileRows, 0);
  if (n < kCopyMinN) return;
  std::uint64_t h[kMaxTileRows], hp[kMaxTileRows];
  for (std::int64_t r = 0; r < rows; ++r) h[r] = row_hash(codes + r * n, n);
  if (prev)
    for (std::int64_t j = 0; j < kMaxTileRows; ++j) hp[j] = row_hash(prev + j * n, n);
  const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(std::int16_t);
  std::int64_t found = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = r - 1; j >= 0 && !p.copy[r]; --j)
      if (h[j] == h[r] && std::memcmp(codes + j * n, codes + r * n, bytes) == 0) p.copy[r] = static_cast<std::uint8_t>(r - j);
    for (std::int64_t j = kMaxTileRows - 1; prev && j >= 0 && !p.copy[r]; --j)
      if (!(prev_back >> j & 1) && hp[j] == h[r] && std::memcmp(prev + j * n, codes + r * n, bytes) == 0)
        p.copy[r] = static_cast<std::uint8_t>(r + kMaxTileRows - j);
    found += p.copy[r] != 0;
  }
  p.copies = found > 0;
}

// Per coefficient the mode with the fewest bits over the rows with values.
void choose_modes(const std::int16_t* codes, std::int64_t rows, int n, Plan& p) {
  p.mode.assign(static_cast<std::size_t>(n), 0);
  p.kr.assign(static_cast<std::size_t>(n), 0);
  p.kv.assign(static_cast<std::size_t>(n), 0);
  std::uint64_t bits[32];
  for (int c = 0; c < n; ++c) {
    std::fill(bits, bits + 32, 0);
    std::uint64_t run_len[8] = {}, run_val[4] = {};
    std::uint32_t zeros = 0;
    bool ended_on_value = true;
    for (std::int64_t r = 0; r < rows; ++r) {
      if (p.copy[r]) continue;
      for (unsigned d = 0; d < 2; ++d) {
        const std::uint32_t z = zigzag(coded_value(codes, r, n, c, d != 0));
        for (unsigned k = 0; k < 16; ++k) bits[d * 16 + k] += rice_bits(z, k);
      }
      const std::int32_t q = codes[r * n + c];
      if (q == 0) {
        ++zeros;
        ended_on_value = false;
      } else {
        for (unsigned k = 0; k < 8; ++k) run_len[k] += rice_bits(zeros, k);
        for (unsigned k = 0; k < 4; ++k) run_val[k] += rice_bits(zigzag(q) - 1, k);
        zeros = 0;
        ended_on_value = true;
      }
    }
    if (!ended_on_value)
      for (unsigned k = 0; k < 8; ++k) run_len[k] += rice_bits(zeros, k);
    std::uint64_t best = ~std::uint64_t{0};
    for (unsigned m = 0; m < 32; ++m)
      if (m != kRunMode && bits[m] < best) best = bits[m], p.mode[static_cast<std::size_t>(c)] = static_cast<std::uint8_t>(m);
    const unsigned kr = static_cast<unsigned>(std::min_element(run_len, run_len + 8) - run_len);
    const unsigned kv = static_cast<unsigned>(std::min_element(run_val, run_val + 4) - run_val);
    if (kRunKrBits + kRunKvBits + run_len[kr] + run_val[kv] < best) {
      p.mode[static_cast<std::size_t>(c)] = kRunMode;
      p.kr[static_cast<std::size_t>(c)] = static_cast<std::uint8_t>(kr);
      p.kv[static_cast<std::size_t>(c)] = static_cast<std::uint8_t>(kv);
    }
  }
}

template <class W>
void write_tile(const std::int16_t* codes, std::int64_t rows, int n, const Plan& p, W& w);
struct BitCounter;
std::uint64_t counted_bits(const std::int16_t* codes, std::int64_t rows, int n, const Plan& p);

// Copies when the tile has any and they make it smaller (each other row then pays a flag bit, and
// the modes are chosen over fewer rows), then the modes.
void plan_tile(const std::int16_t* codes, std::int64_t rows, int n, const std::int16_t* prev, std::uint64_t prev_back, Plan& p) {
  p.rows = rows;
  find_copies(codes, rows, n, prev, prev_back, p);
  choose_modes(codes, rows, n, p);
  if (!p.copies) return;
  Plan plain;
  plain.rows = rows;
  choose_modes(codes, rows, n, plain);
  if (counted_bits(codes, rows, n, plain) <= counted_bits(codes, rows, n, p)) p = std::move(plain);
}

struct BitWriter {
  std::vector<std::uint8_t>& out;
  std::uint64_t acc = 0;
  unsigned fill = 0;
  void put(std::uint64_t v, unsigned nbits) {  // nbits <= 32
    acc |= v << fill;
    fill += nbits;
    while (fill >= 8) {
      out.push_back(static_cast<std::uint8_t>(acc));
      acc >>= 8;
      fill -= 8;
    }
  }
  void finish() {
    if (fill > 0) out.push_back(static_cast<std::uint8_t>(acc));
    acc = 0, fill = 0;
  }
};

struct BitCounter {
  std::uint64_t bits = 0;
  void put(std::uint64_t, unsigned nbits) { bits += nbits; }
  void finish() { bits = (bits + 7) / 8 * 8; }
};

template <class W>
void put_rice(W& w, std::uint32_t z, unsigned k) {
  const std::uint32_t u = z >> k;
  if (u < kRiceEscape) {
    w.put(0, u);
    w.put(1, 1);
    w.put(z & ((1u << k) - 1), k);
  } else {
    w.put(0, kRiceEscape);
    w.put(z, kRiceRawBits);
  }
}

template <class W>
void write_tile(const std::int16_t* codes, std::int64_t rows, int n, const Plan& p, W& w) {
  w.put(p.copies ? 1 : 0, 1);
  if (p.copies)
    for (std::int64_t r = 0; r < rows; ++r) {
      w.put(p.copy[r] ? 1 : 0, 1);
      if (p.copy[r]) w.put(p.copy[r] - 1u, kCopyBits);
    }
  for (int c = 0; c < n; ++c) {
    const std::size_t i = static_cast<std::size_t>(c);
    w.put(p.mode[i], 5);
    if (p.mode[i] == kRunMode) w.put(p.kr[i], kRunKrBits), w.put(p.kv[i], kRunKvBits);
  }
  thread_local std::vector<std::int32_t> left;  // zero-run coefficients: zeros left in the run, -1: a run length is due
  left.assign(static_cast<std::size_t>(n), -1);
  for (std::int64_t r = 0; r < rows; ++r) {
    if (p.copy[r]) continue;
    for (int c = 0; c < n; ++c) {
      const std::size_t i = static_cast<std::size_t>(c);
      const std::uint8_t m = p.mode[i];
      if (m != kRunMode) {
        put_rice(w, zigzag(coded_value(codes, r, n, c, (m >> 4) != 0)), m & 15);
        continue;
      }
      if (left[i] < 0) {  // the zeros from here to the next nonzero code (or the tile's end)
        std::int32_t zeros = 0;
        for (std::int64_t s = r; s < rows; ++s)
          if (!p.copy[s]) {
            if (codes[s * n + c] != 0) break;
            ++zeros;
          }
        put_rice(w, static_cast<std::uint32_t>(zeros), p.kr[i]);
        left[i] = zeros;
      }
      if (left[i] > 0) {
        --left[i];
        continue;
      }
      put_rice(w, zigzag(codes[r * n + c]) - 1, p.kv[i]);
      left[i] = -1;
    }
  }
  w.finish();
}

std::uint64_t counted_bits(const std::int16_t* codes, std::int64_t rows, int n, const Plan& p) {
  BitCounter w;
  write_tile(codes, rows, n, p, w);
  return w.bits;
}

}  // namespace

std::uint64_t encode_tile(const std::int16_t* codes, std::int64_t rows, int n, std::vector<std::uint8_t>& out, const std::int16_t* prev,
                          std::uint64_t prev_back) {
  Plan p;
  plan_tile(codes, rows, n, prev, prev_back, p);
  BitWriter w{out};
  write_tile(codes, rows, n, p, w);
  std::uint64_t back = 0;
  for (std::int64_t r = 0; r < rows; ++r) back |= std::uint64_t{p.copy[r] > r} << r;
  return back;
}

std::uint64_t copies_back(const std::uint8_t* in, std::int64_t rows) {
  if (!(in[0] & 1)) return 0;
  std::uint64_t pos = 1, back = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::uint64_t v;
    std::memcpy(&v, in + (pos >> 3), 8);
    v >>= pos & 7;
    ++pos;
    if (v & 1) {
      const std::int64_t d = static_cast<std::int64_t>((v >> 1) & ((1u << kCopyBits) - 1)) + 1;
      back |= std::uint64_t{d > r} << r;
      pos += kCopyBits;
    }
  }
  return back;
}

std::size_t tile_bytes(const std::int16_t* codes, std::int64_t rows, int n, const std::int16_t* prev, std::uint64_t prev_back) {
  Plan p;
  plan_tile(codes, rows, n, prev, prev_back, p);
  BitCounter w;
  write_tile(codes, rows, n, p, w);
  return static_cast<std::size_t>(w.bits / 8);
}

std::size_t decode_tile(const std::uint8_t* in, std::int64_t rows, int n, std::int16_t* codes, const std::int16_t* prev) {
  std::uint64_t pos = 0;
  auto peek = [&]() {
    std::uint64_t v;
    std::memcpy(&v, in + (pos >> 3), 8);
    return v >> (pos & 7);  // >= 57 valid bits
  };
  auto take = [&](unsigned nbits) {
    const std::uint32_t v = static_cast<std::uint32_t>(peek() & ((std::uint64_t{1} << nbits) - 1));
    pos += nbits;
    return v;
  };
  auto rice = [&](unsigned k) {
    const std::uint64_t v = peek();
    const unsigned u = static_cast<unsigned>(std::countr_zero(v));
    if (u < kRiceEscape) {
      pos += u + 1 + k;
      return (static_cast<std::uint32_t>(u) << k) | static_cast<std::uint32_t>((v >> (u + 1)) & ((1u << k) - 1));
    }
    pos += kRiceEscape + kRiceRawBits;
    return static_cast<std::uint32_t>((v >> kRiceEscape) & ((1u << kRiceRawBits) - 1));
  };
  std::uint8_t copy[kMaxTileRows] = {};
  if (take(1))
    for (std::int64_t r = 0; r < rows; ++r)
      if (take(1)) copy[r] = static_cast<std::uint8_t>(take(kCopyBits) + 1);
  thread_local std::vector<std::uint8_t> mode, kr, kv;
  thread_local std::vector<std::int32_t> left;
  mode.resize(static_cast<std::size_t>(n));
  kr.resize(static_cast<std::size_t>(n));
  kv.resize(static_cast<std::size_t>(n));
  left.assign(static_cast<std::size_t>(n), -1);
  for (int c = 0; c < n; ++c) {
    const std::size_t i = static_cast<std::size_t>(c);
    mode[i] = static_cast<std::uint8_t>(take(5));
    if (mode[i] == kRunMode) kr[i] = static_cast<std::uint8_t>(take(kRunKrBits)), kv[i] = static_cast<std::uint8_t>(take(kRunKvBits));
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int16_t* row = codes + r * n;
    if (copy[r]) {  // from the previous tile when d > r (left as it is without prev)
      const std::int16_t* from = copy[r] <= r ? row - copy[r] * n : prev ? prev + (r + kMaxTileRows - copy[r]) * n : nullptr;
      if (from) std::memcpy(row, from, static_cast<std::size_t>(n) * sizeof(std::int16_t));
      continue;
    }
    for (int c = 0; c < n; ++c) {
      const std::size_t i = static_cast<std::size_t>(c);
      const unsigned m = mode[i];
      if (m != kRunMode) {
        std::int32_t q = unzigzag(rice(m & 15));
        if ((m >> 4) && r > 0) q += row[c - n];
        row[c] = static_cast<std::int16_t>(q);
        continue;
      }
      if (left[i] < 0) left[i] = static_cast<std::int32_t>(rice(kr[i]));
      if (left[i] > 0) {
        --left[i];
        row[c] = 0;
        continue;
      }
      row[c] = static_cast<std::int16_t>(unzigzag(rice(kv[i]) + 1));
      left[i] = -1;
    }
  }
  return static_cast<std::size_t>((pos + 7) / 8);
}

}  // namespace vq::seal
