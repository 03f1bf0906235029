// The packer of a vq side's codes (src/vq/code_pack.hpp): the fast forms (SSE2 + BMI2 pext / pdep)
// against the one-field-at-a-time reference, bit for bit, on random layouts of every width (1..8
// and 16), head sizes that are and are not multiples of 8 (a short last group), odd row counts at
// a nonzero first row, codes in and out of their fields (escapes), over buffers filled with junk
// first (the packer writes every byte of its rows); and unpack(pack(codes)) with the escapes put
// back gives the codes.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "../../src/vq/code_pack.hpp"

namespace {

using vq::code_pack::Escape;
using vq::code_pack::Layout;

// A layout as the cache's contract allows it (vq_cache.hpp, "Packed layout"): per head a random
// field order, per group of 8 positions a width from `widths`, groups on whole bytes.
struct TestLayout {
  std::vector<std::int32_t> order;
  std::vector<std::uint32_t> bit_at, group_byte;
  std::vector<std::uint8_t> width, group_width;
  Layout lay;
};

TestLayout make_layout(int heads, int d, const std::vector<int>& widths, std::mt19937& rng) {
  TestLayout t;
  const int n = heads * d;
  t.order.resize(static_cast<std::size_t>(n));
  t.width.resize(static_cast<std::size_t>(n));
  t.bit_at.assign(static_cast<std::size_t>(n) + 1, 0);
  std::uint32_t byte = 0;
  for (int h = 0; h < heads; ++h) {
    std::int32_t* o = t.order.data() + h * d;
    std::iota(o, o + d, h * d);
    std::shuffle(o, o + d, rng);
    for (int p = 0; p < d; p += 8) {
      const int m = std::min(8, d - p);
      const auto w = static_cast<std::uint32_t>(widths[rng() % widths.size()]);
      t.group_byte.push_back(byte);
      t.group_width.push_back(static_cast<std::uint8_t>(w));
      for (int i = 0; i < m; ++i) {
        t.width[static_cast<std::size_t>(o[p + i])] = static_cast<std::uint8_t>(w);
        t.bit_at[static_cast<std::size_t>(o[p + i])] = byte * 8 + static_cast<std::uint32_t>(i) * w;
      }
      byte += (static_cast<std::uint32_t>(m) * w + 7) / 8;
    }
  }
  t.bit_at[static_cast<std::size_t>(n)] = byte * 8;
  t.lay = {n, heads, t.order.data(), t.bit_at.data(), t.width.data(), t.group_byte.data(), t.group_width.data()};
  return t;
}

// Codes for the layout: most inside their fields (down to the edges +-(2^(w-1) - 1)), some just
// outside (+-2^(w-1)) and some far (anywhere in int16): escapes.
std::vector<std::int16_t> make_codes(const TestLayout& t, std::int64_t rows, std::mt19937& rng) {
  const int n = t.lay.n;
  std::vector<std::int16_t> q(static_cast<std::size_t>(rows) * static_cast<std::size_t>(n));
  for (std::int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) {
      const int lim = (1 << (t.width[static_cast<std::size_t>(c)] - 1)) - 1;
      const unsigned pick = rng() % 16;
      int v;
      if (pick == 0 && lim < 32767) v = (rng() % 2 ? 1 : -1) * (lim + 1);
      else if (pick == 1) v = static_cast<int>(rng() % 65536) - 32768;  // beyond the codes' reach too: the packer escapes any int16
      else if (pick == 2) v = (rng() % 2 ? 1 : -1) * lim;
      else v = lim == 0 ? 0 : static_cast<int>(rng() % static_cast<unsigned>(2 * lim + 1)) - lim;
      q[static_cast<std::size_t>(r) * static_cast<std::size_t>(n) + static_cast<std::size_t>(c)] = static_cast<std::int16_t>(v);
    }
  return q;
}

bool same(const std::vector<Escape>& a, const std::vector<Escape>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].t != b[i].t || a[i].c != b[i].c || a[i].q != b[i].q) return false;
  return true;
}

struct Shape {
  int heads, d;
};
// d = 64 and 128 also take the AVX-512 VBMI form where the CPU has it, and VBMI2 where no group is 16 bits wide.
const Shape kShapes[] = {{1, 1}, {1, 7}, {2, 8}, {3, 9}, {1, 15}, {2, 16}, {3, 17}, {2, 69}, {3, 64}, {1, 128}, {8, 128}};
const std::vector<std::vector<int>> kWidthSets = {{1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {16}, {1, 2, 3, 4, 5, 6, 7, 8, 16}};

class FastPack : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!vq::code_pack::fast()) GTEST_SKIP() << "no BMI2 on this CPU: pack_rows runs the reference";
  }
};

TEST_F(FastPack, PacksTheReferencesBytesAndEscapes) {
  using vq::code_pack::Form;
  std::mt19937 rng(11);
  for (const Form form : {Form::Bmi2, Form::Vbmi, Form::Vbmi2}) {
    if (!vq::code_pack::has(form)) continue;
    for (const Shape& s : kShapes) {
      if ((form == Form::Vbmi || form == Form::Vbmi2) && s.d != 64 && s.d != 128) continue;
      for (const auto& ws : kWidthSets)
        for (const std::int64_t rows : {1, 5, 13}) {
          const TestLayout t = make_layout(s.heads, s.d, ws, rng);
          if (form == Form::Vbmi2 && std::find(t.group_width.begin(), t.group_width.end(), 16) != t.group_width.end()) continue;  // not its layouts
          const std::int64_t t_first = 3;
          const std::size_t rb = t.lay.row_bytes(), bytes = (static_cast<std::size_t>(t_first + rows)) * rb + 8;
          const auto q = make_codes(t, rows, rng);
          std::vector<std::uint8_t> ref(bytes, 0xA5), fast(bytes, 0x5A);  // junk: every row byte must be written
          std::vector<Escape> eref{{0, 0, 0}}, efast{{0, 0, 0}};            // appended to, not replaced
          vq::code_pack::pack_rows_ref(t.lay, q.data(), rows, t_first, ref.data(), eref);
          vq::code_pack::pack_rows_as(form, t.lay, q.data(), rows, t_first, fast.data(), efast);
          const auto row0 = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(t_first) * rb);
          const auto row1 = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(t_first + rows) * rb);
          const auto what = ::testing::Message() << "form " << static_cast<int>(form) << " heads " << s.heads << " d " << s.d << " widths "
                                                 << ws.size() << " rows " << rows;
          ASSERT_TRUE(std::equal(ref.begin() + row0, ref.begin() + row1, fast.begin() + row0)) << what;
          ASSERT_TRUE(std::all_of(fast.begin(), fast.begin() + row0, [](std::uint8_t b) { return b == 0x5A; })) << "rows before t_first kept; " << what;
          ASSERT_TRUE(same(eref, efast)) << what;
        }
    }
  }
}

TEST_F(FastPack, UnpacksTheReferencesCodes) {
  std::mt19937 rng(12);
  for (const Shape& s : kShapes)
    for (const auto& ws : kWidthSets) {
      const TestLayout t = make_layout(s.heads, s.d, ws, rng);
      const std::int64_t rows = 7;
      std::vector<std::uint8_t> buf(static_cast<std::size_t>(rows) * t.lay.row_bytes() + 8);
      for (auto& b : buf) b = static_cast<std::uint8_t>(rng());  // any bytes are fields
      const std::size_t nq = static_cast<std::size_t>(rows) * static_cast<std::size_t>(t.lay.n);
      std::vector<std::int16_t> ref(nq, 0x1234), fast(nq, -0x1234);
      vq::code_pack::unpack_rows_ref(t.lay, buf.data(), rows, ref.data());
      vq::code_pack::unpack_rows(t.lay, buf.data(), rows, fast.data());
      ASSERT_EQ(ref, fast) << "heads " << s.heads << " d " << s.d << " widths " << ws.size();
    }
}

// Both forms: unpack(pack(codes)), escapes put back, is the codes; an escaped field reads as its
// field 0 (-2^(w-1)), every other code as itself.
TEST(CodePack, UnpackOfPackWithTheEscapesIsTheCodes) {
  for (const bool fast : {false, true}) {
    const bool was = vq::code_pack::set_fast(fast);
    std::mt19937 rng(13);
    for (const Shape& s : kShapes)
      for (const auto& ws : kWidthSets) {
        const TestLayout t = make_layout(s.heads, s.d, ws, rng);
        const std::int64_t rows = 9;
        const auto q = make_codes(t, rows, rng);
        std::vector<std::uint8_t> buf(static_cast<std::size_t>(rows) * t.lay.row_bytes() + 8, 0xEE);
        std::vector<Escape> esc;
        vq::code_pack::pack_rows(t.lay, q.data(), rows, 0, buf.data(), esc);
        std::vector<std::int16_t> back(q.size());
        vq::code_pack::unpack_rows(t.lay, buf.data(), rows, back.data());
        std::size_t n_esc = 0;
        for (std::size_t i = 0; i < q.size(); ++i) {
          const int w = t.width[i % static_cast<std::size_t>(t.lay.n)];
          const bool escaped = q[i] >= (1 << (w - 1)) || q[i] <= -(1 << (w - 1));
          n_esc += escaped;
          ASSERT_EQ(back[i], escaped ? -(1 << (w - 1)) : q[i]) << "fast " << fast << " code " << i;
        }
        ASSERT_EQ(esc.size(), n_esc);
        for (std::size_t i = 0; i < esc.size(); ++i) {
          const Escape& e = esc[i];
          if (i > 0) {
            ASSERT_TRUE(esc[i - 1].t < e.t || (esc[i - 1].t == e.t && esc[i - 1].c < e.c)) << "escapes sorted by (t, c)";
          }
          ASSERT_EQ(e.q, q[static_cast<std::size_t>(e.t) * static_cast<std::size_t>(t.lay.n) + static_cast<std::size_t>(e.c)]);
        }
      }
    vq::code_pack::set_fast(was);
  }
}

}  // namespace
