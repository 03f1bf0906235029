// PageVector: contents survive every growth (heap, heap -> mapping, mremap) and shrink, and
// nbytes() is the memory really held: in the mapping, the pages the kernel reports resident
// (mincore) over the whole reserved range, so pages it never backed are not counted and pages it
// did back are.
#include "veloxquant/core/page_vector.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

namespace {

// Bytes of the mapping that are resident now, by the kernel's count.
std::size_t resident_bytes(const vq::PageVector<std::uint32_t>& v) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in(v.reserved_bytes() / page);
  EXPECT_EQ(mincore(const_cast<std::uint32_t*>(v.data()), v.reserved_bytes(), in.data()), 0);
  std::size_t n = 0;
  for (unsigned char c : in) n += (c & 1) ? page : 0;
  return n;
}

void expect_holds(const vq::PageVector<std::uint32_t>& v, std::size_t n) {
  ASSERT_EQ(v.size(), n);
  for (std::size_t i = 0; i < n; ++i)
    if (v[i] != static_cast<std::uint32_t>(i * 2654435761u)) FAIL() << "element " << i << " of " << n;
}

TEST(PageVector, GrowsFromTheHeapIntoItsMappingKeepingItsContents) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  vq::PageVector<std::uint32_t> v;
  EXPECT_EQ(v.nbytes(), 0u);
  std::size_t n = 0;
  const auto append = [&](std::size_t k) {
    std::uint32_t* p = v.append(k);
    for (std::size_t i = 0; i < k; ++i) p[i] = static_cast<std::uint32_t>((n + i) * 2654435761u);
    n += k;
  };
  append(10);  // the heap, exactly what was asked
  EXPECT_FALSE(v.mapped());
  EXPECT_EQ(v.nbytes(), 40u);
  append(1000);
  EXPECT_FALSE(v.mapped());
  EXPECT_GE(v.nbytes(), 4040u);
  EXPECT_LE(v.nbytes(), vq::kPageVectorHeapBytes);
  expect_holds(v, n);
  for (int i = 0; i < 300; ++i) append(977);  // into the mapping, then many mremaps (1.2 MB)
  ASSERT_TRUE(v.mapped());
  expect_holds(v, n);
  EXPECT_EQ(v.nbytes(), (n * 4 + page - 1) / page * page);
  EXPECT_GT(v.reserved_bytes(), v.nbytes());  // spare address space, not memory:
  EXPECT_EQ(resident_bytes(v), v.nbytes());
  v.shrink(n / 3);  // the pages past the kept elements go back at once
  n /= 3;
  expect_holds(v, n);
  EXPECT_EQ(v.nbytes(), (n * 4 + page - 1) / page * page);
  EXPECT_EQ(resident_bytes(v), v.nbytes());
  append(5000);  // and grow again over returned pages
  expect_holds(v, n);
  EXPECT_EQ(resident_bytes(v), v.nbytes());
  vq::PageVector<std::uint32_t> w = std::move(v);
  expect_holds(w, n);
  EXPECT_EQ(v.nbytes(), 0u);
  w.clear();
  EXPECT_EQ(w.size(), 0u);
  EXPECT_EQ(w.nbytes(), 0u);
  EXPECT_FALSE(w.mapped());
}

// reserve_huge: the array moves (contents kept) into a mapping that starts on a 2 MiB boundary and
// spans the reserve; appends up to it never move it again; filled to the reserve, the memory held
// is its pages, as the kernel counts them; more still fits past it.
TEST(PageVector, AReservedArrayStaysPutInItsHugePageMapping) {
  constexpr std::size_t kReserve = 5u << 20;  // bytes: two whole 2 MiB ranges and a rest
  vq::PageVector<std::uint32_t> v;
  std::size_t n = 0;
  const auto append = [&](std::size_t k) {
    std::uint32_t* p = v.append(k);
    for (std::size_t i = 0; i < k; ++i) p[i] = static_cast<std::uint32_t>((n + i) * 2654435761u);
    n += k;
  };
  append(10);
  v.reserve_huge(1000);  // fits the heap: nothing
  EXPECT_FALSE(v.mapped());
  v.reserve_huge(kReserve / 4);
  ASSERT_TRUE(v.mapped());
  expect_holds(v, n);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(v.data()) % (2u << 20), 0u);
  EXPECT_EQ(v.reserved_bytes(), kReserve);
  const std::uint32_t* at = v.data();
  while (n + 4096 <= kReserve / 4) append(4096);
  append(kReserve / 4 - n);
  EXPECT_EQ(v.data(), at);
  expect_holds(v, n);
  EXPECT_EQ(v.nbytes(), kReserve);
  EXPECT_EQ(resident_bytes(v), v.nbytes());
  v.reserve_huge(kReserve / 8);  // reserved already: nothing
  EXPECT_EQ(v.data(), at);
  append(3000);  // past the reserve: it grows as any mapping does
  expect_holds(v, n);
}

TEST(PageVector, AnImpossibleAppendThrowsAndChangesNothing) {
  vq::PageVector<std::uint32_t> v;
  v.append(3)[0] = 7;
  EXPECT_THROW(v.append(SIZE_MAX / 8), std::bad_alloc);
  EXPECT_EQ(v.size(), 3u);
  EXPECT_EQ(v[0], 7u);
}

}  // namespace
