// UninitVector<T>: a std::vector whose resize() leaves new trivially-constructible elements
// uninitialised, for buffers that are written right after they grow (codes, scales). Saves a
// memset pass over every byte of a prefill.
#pragma once
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace vq {

template <class T, class A = std::allocator<T>>
class DefaultInitAllocator : public A {
  using traits = std::allocator_traits<A>;

 public:
  template <class U>
  struct rebind {
    using other = DefaultInitAllocator<U, typename traits::template rebind_alloc<U>>;
  };
  using A::A;
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;  // default-initialise: no zeroing for trivial types
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    traits::construct(static_cast<A&>(*this), p, std::forward<Args>(args)...);
  }
};

template <class T>
using UninitVector = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace vq
