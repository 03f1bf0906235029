// PageVector<T>: a growable array of trivially copyable T in an anonymous memory mapping of its
// own, for the big code arrays of resident caches (the llama.cpp block caches' blocks).
//
// What a reader must know first:
// - Why not std::vector: a vector that grows copies into a new buffer and frees the old one. With
//   many caches growing side by side, the freed buffers become holes in malloc's heap that the
//   later, larger buffers do not fit, and the process keeps them: 16 q4_0 caches of 4096 tokens
//   grew the RSS by 1.145x their summed nbytes (issue 14's goal: <= 1.1x). A PageVector grows
//   with mremap, which moves page-table entries rather than bytes and leaves no hole, and it
//   never shares pages with the heap.
// - Small arrays (up to kPageVectorHeapBytes) live on the heap like a vector's (first the exact
//   size asked, then growing by an eighth), so a short cache does not hold a page per array;
//   nbytes() is then the buffer's capacity, and shrink() to well below it moves the array into a
//   buffer of the size kept. Past that size the array moves once into its mapping.
// - In the mapping, address space is reserved geometrically (at least doubling), but the kernel
//   backs a page only when it is first written, and elements are written front to back. So the
//   memory it holds is exactly the pages that back size() elements: nbytes() = size() * sizeof(T)
//   rounded up to the page size. shrink() hands the pages past the new size back at once
//   (madvise MADV_DONTNEED); clear() frees everything.
// - Appended elements are uninitialised (the caller writes them). Pointers into the array are
//   invalidated by append (the mapping may move), like a vector's, and by shrink.
#pragma once
#include <cstddef>
#include <type_traits>
#include <utility>

namespace vq {

// The largest array kept on the heap (below glibc's smallest mmap threshold, 128 KiB).
inline constexpr std::size_t kPageVectorHeapBytes = 64 * 1024;

namespace detail {

// Backs the whole pages inside [p, p + bytes) for writing in one call (MADV_POPULATE_WRITE),
// instead of one page fault per page as they are first written (a trap each, ~10 us a page on a
// virtual machine). Contents are unchanged. A hint: nothing below kPopulateMinBytes, and nothing
// on a kernel without MADV_POPULATE_WRITE (< 5.14) or off Linux; the faults then stay.
inline constexpr std::size_t kPopulateMinBytes = 16 * 1024;
void populate_for_write(void* p, std::size_t bytes);

// An anonymous mapping of `bytes` (rounded up to whole pages) that starts on a 2 MiB boundary, its
// whole 2 MiB ranges advised as huge pages (MADV_HUGEPAGE: one fault per 2 MiB written instead of
// 512; a hint, THP "never" leaves small pages). For buffers whose final size is known and that are
// written whole. nullptr when the mapping fails. Release with unmap_huge(p, bytes).
std::byte* map_huge(std::size_t bytes);
void unmap_huge(std::byte* p, std::size_t bytes);

// The untyped core: a byte array in its own mapping (src/core/page_vector.cpp).
class PageBytes {
 public:
  PageBytes() = default;
  ~PageBytes() { clear(); }
  PageBytes(PageBytes&& o) noexcept { *this = std::move(o); }
  PageBytes& operator=(PageBytes&& o) noexcept;
  PageBytes(const PageBytes&) = delete;
  PageBytes& operator=(const PageBytes&) = delete;

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  // Whether the bytes are in the mapping (else on the heap, or nothing held).
  bool mapped() const { return mapped_; }
  // Bytes reserved: the heap buffer's capacity, or the address space the mapping spans (only the
  // first nbytes() of it are backed).
  std::size_t reserved() const { return reserved_; }
  std::size_t nbytes() const;
  // size() += n, reserving more address space when needed; returns the first new byte. Throws
  // std::bad_alloc (nothing changed) when the mapping cannot grow.
  std::byte* append(std::size_t n);
  // size() = min(size(), n); the pages past the new size are returned to the system.
  void shrink(std::size_t n);
  // For an array whose final size is known: address space for `bytes` in a mapping of its own that
  // starts on a 2 MiB boundary, its whole 2 MiB ranges advised as huge pages (MADV_HUGEPAGE: one
  // fault per 2 MiB instead of 512). Contents kept. Nothing when `bytes` fits the heap or is
  // reserved already. nbytes() still bills the pages below size(); a huge page the array only
  // partly fills is backed whole once written (at most one such range when the final size is
  // `bytes`). Throws std::bad_alloc (nothing changed) when the mapping fails.
  void reserve_huge(std::size_t bytes);
  void clear();

  static std::size_t page_size();

 private:
  // Moves the size() bytes held into the mapping p (reserved bytes of address space) and releases
  // the old buffer or mapping.
  void adopt(std::byte* p, std::size_t reserved);

  std::byte* data_ = nullptr;
  std::size_t size_ = 0, reserved_ = 0;
  bool mapped_ = false;
};

}  // namespace detail

template <class T>
class PageVector {
  static_assert(std::is_trivially_copyable_v<T>, "PageVector moves its elements as bytes");

 public:
  std::size_t size() const { return bytes_.size() / sizeof(T); }
  bool empty() const { return bytes_.size() == 0; }
  T* data() { return reinterpret_cast<T*>(bytes_.data()); }
  const T* data() const { return reinterpret_cast<const T*>(bytes_.data()); }
  T& operator[](std::size_t i) { return data()[i]; }
  const T& operator[](std::size_t i) const { return data()[i]; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size(); }

  // Appends n uninitialised elements and returns the first; throws std::bad_alloc (nothing
  // changed) when the mapping cannot grow.
  T* append(std::size_t n) { return reinterpret_cast<T*>(bytes_.append(n * sizeof(T))); }
  // PageBytes::reserve_huge for n elements.
  void reserve_huge(std::size_t n) { bytes_.reserve_huge(n * sizeof(T)); }
  // Keeps the first min(n, size()) elements and returns the pages past them.
  void shrink(std::size_t n) { bytes_.shrink(n * sizeof(T)); }
  void clear() { bytes_.clear(); }

  // Bytes of memory held: on the heap its buffer's capacity; in the mapping size() * sizeof(T)
  // rounded up to whole pages. 0 when nothing was ever appended or after clear().
  std::size_t nbytes() const { return bytes_.nbytes(); }
  bool mapped() const { return bytes_.mapped(); }
  // Bytes reserved (>= nbytes(); in the mapping the rest is never written, so never backed).
  std::size_t reserved_bytes() const { return bytes_.reserved(); }

 private:
  detail::PageBytes bytes_;
};

}  // namespace vq
