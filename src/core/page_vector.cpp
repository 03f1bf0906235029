// PageBytes, the storage under PageVector (core/page_vector.hpp): a heap buffer while small; then
// mmap, mremap to grow (Linux; elsewhere a fresh mapping and a copy), madvise to return pages,
// munmap to clear.
#include "veloxquant/core/page_vector.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>

namespace vq::detail {

namespace {

// The smallest reservation: 16 pages of address space (never backed until written).
constexpr std::size_t kMinReserve = 64 * 1024;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

#if defined(MADV_POPULATE_WRITE)
constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#elif defined(__linux__)
constexpr int kPopulateWrite = 23;  // Linux's value (uapi asm-generic/mman-common.h); kernels before 5.14 answer EINVAL
#else
constexpr int kPopulateWrite = -1;  // none: pages are backed as they are written
#endif

void* map(std::size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

}  // namespace

void populate_for_write(void* p, std::size_t bytes) {
  if (kPopulateWrite < 0 || bytes < kPopulateMinBytes) return;
  // Whole pages only: a page the range shares with other data is backed by the first write anyway.
  const std::size_t page = PageBytes::page_size();
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t from = (a + page - 1) / page * page, to = (a + bytes) / page * page;
  if (to > from) madvise(reinterpret_cast<void*>(from), to - from, kPopulateWrite);
}

std::byte* map_huge(std::size_t bytes) {
  constexpr std::size_t kHuge = std::size_t{2} << 20;
  if (bytes == 0 || bytes > SIZE_MAX / 4) return nullptr;
  const std::size_t want = round_up(bytes, PageBytes::page_size());
  // Map kHuge more than wanted, then return the head and tail around the 2 MiB-aligned part.
  void* raw = map(want + kHuge);
  if (!raw) return nullptr;
  const auto a = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t start = (a + kHuge - 1) / kHuge * kHuge, end = start + want, raw_end = a + want + kHuge;
  if (start > a) munmap(raw, start - a);
  if (raw_end > end) munmap(reinterpret_cast<void*>(end), raw_end - end);
  auto* p = reinterpret_cast<std::byte*>(start);
#ifdef MADV_HUGEPAGE
  if (want >= kHuge) madvise(p, want / kHuge * kHuge, MADV_HUGEPAGE);  // a hint: THP off or "never" leaves small pages
#endif
  return p;
}

void unmap_huge(std::byte* p, std::size_t bytes) {
  if (p) munmap(p, round_up(bytes, PageBytes::page_size()));
}

std::size_t PageBytes::page_size() {
  static const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

PageBytes& PageBytes::operator=(PageBytes&& o) noexcept {
  if (this != &o) {
    clear();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    reserved_ = std::exchange(o.reserved_, 0);
    mapped_ = std::exchange(o.mapped_, false);
  }
  return *this;
}

std::size_t PageBytes::nbytes() const { return mapped_ ? round_up(size_, page_size()) : reserved_; }

std::byte* PageBytes::append(std::size_t n) {
  if (n > reserved_ - size_) {
    if (n > SIZE_MAX / 4 - size_) throw std::bad_alloc();
    const std::size_t need = size_ + n;
    if (!mapped_ && need <= kPageVectorHeapBytes) {
      // On the heap: the exact size first (a cache fed once holds no spare), then by an eighth (a
      // cache fed a token at a time holds < 1/8 spare; doubling held up to 2x, 1.5x on average, and
      // a short cache is all heap). ~100 reallocations of <= 64 KiB on the way to the mapping.
      const std::size_t cap = data_ ? std::min(std::max(need, reserved_ + reserved_ / 8), kPageVectorHeapBytes) : need;
      auto* p = static_cast<std::byte*>(::operator new(cap));
      if (size_) std::memcpy(p, data_, size_);
      ::operator delete(data_);
      data_ = p, reserved_ = cap;
    } else {
      const std::size_t want = std::max({round_up(need, page_size()), 2 * (mapped_ ? reserved_ : 0), kMinReserve});
      void* p = nullptr;
#ifdef MREMAP_MAYMOVE
      if (mapped_) {
        p = mremap(data_, reserved_, want, MREMAP_MAYMOVE);
        if (p == MAP_FAILED) p = nullptr;
      }
#endif
      if (p) {
        data_ = static_cast<std::byte*>(p), reserved_ = want;
      } else {
        // From the heap (or nothing) into a mapping of its own, once; or, without mremap or where
        // it refuses (a reserve_huge mapping is two areas, its huge-page ranges and its rest, and
        // mremap moves one area only), a fresh mapping and a copy.
        p = map(want);
        if (!p) throw std::bad_alloc();
        adopt(static_cast<std::byte*>(p), want);
      }
    }
  }
  std::byte* first = data_ + size_;
  if (mapped_) {
    // The caller writes the new bytes next: back their pages now, in one call (the same pages
    // either way). From the first page boundary at or after size_: the page holding size_ is
    // backed already, and the mapping's end is page-aligned.
    const std::size_t from = round_up(size_, page_size()), to = round_up(size_ + n, page_size());
    if (to > from && n >= kPopulateMinBytes) populate_for_write(data_ + from, to - from);
  }
  size_ += n;
  return first;
}

void PageBytes::reserve_huge(std::size_t bytes) {
  if (bytes <= kPageVectorHeapBytes || bytes <= reserved_) return;
  if (bytes > SIZE_MAX / 4) throw std::bad_alloc();
  std::byte* p = map_huge(bytes);
  if (!p) throw std::bad_alloc();
  adopt(p, round_up(bytes, page_size()));
}

void PageBytes::adopt(std::byte* p, std::size_t reserved) {
  if (size_) std::memcpy(p, data_, size_);
  if (mapped_)
    munmap(data_, reserved_);
  else
    ::operator delete(data_);
  data_ = p, reserved_ = reserved, mapped_ = true;
}

void PageBytes::shrink(std::size_t n) {
  if (n >= size_) return;
  if (mapped_) {
    const std::size_t keep = round_up(n, page_size()), held = nbytes();
    if (held > keep) madvise(data_ + keep, held - keep, MADV_DONTNEED);  // private anonymous: the pages are freed
  } else if (reserved_ > n + n / 4 + 64) {  // on the heap: a buffer of the size kept (the spare would stay billed)
    std::byte* p = n ? static_cast<std::byte*>(::operator new(n)) : nullptr;
    if (n) std::memcpy(p, data_, n);
    ::operator delete(data_);
    data_ = p, reserved_ = n;
  }
  size_ = n;
}

void PageBytes::clear() {
  if (mapped_)
    munmap(data_, reserved_);
  else
    ::operator delete(data_);
  data_ = nullptr;
  size_ = reserved_ = 0;
  mapped_ = false;
}

}  // namespace vq::detail
