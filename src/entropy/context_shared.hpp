// Private to the context coder (context_model.cpp, context_codec.cpp): what the model and the
// coder share. The layout and slice checks, the class tables' codes by frequency (CodeOrders) and
// the pair tables derived from them (pair_freqs, fill_table). Format and story: context_coder.hpp.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "context_kernels.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/context_coder.hpp"

namespace vq::context_detail {

inline constexpr std::uint32_t kL = kRansStateLow;

// Throws InvalidArgument for a layout the coder cannot take.
void check_layout(const ContextLayout& l);

template <typename Span>
inline void check_slices(std::span<const Span> codes, const ContextLayout& l, const char* what) {
  require(codes.size() == l.slices, std::string("context coder: ") + what + " has " + std::to_string(codes.size()) +
                                        " slices, the layout " + std::to_string(l.slices));
  for (const auto& s : codes)
    require(s.size() == l.tokens * l.dim, std::string("context coder: a slice of ") + what + " holds " + std::to_string(s.size()) +
                                              " codes, the layout needs " + std::to_string(l.tokens * l.dim));
}

// One span per slice of a flat [slice][token][dim] buffer (codes in, or the output).
template <typename T>
inline std::vector<std::span<T>> split(std::span<T> flat, const ContextLayout& l) {
  require(flat.size() == l.size(), std::string("context coder: ") + (std::is_const_v<T> ? "code count " : "output size ") +
                                       std::to_string(flat.size()) + " disagrees with the layout (" + std::to_string(l.size()) + ")");
  std::vector<std::span<T>> s(l.slices);
  for (std::size_t i = 0; i < l.slices; ++i) s[i] = flat.subspan(i * l.tokens * l.dim, l.tokens * l.dim);
  return s;
}

// Each class table's codes in order of descending frequency (ties: lower code first), present ones.
struct CodeOrders {
  std::array<std::array<std::uint8_t, 16>, kContextMaxContexts> order{};
  std::array<int, kContextMaxContexts> n{};
  explicit CodeOrders(const ContextModel& m) {
    const int A = 1 << m.bits();
    for (int c = 0; c < m.classes(); ++c) {
      const FrequencyTable& g = m.table(c);
      auto& o = order[static_cast<std::size_t>(c)];
      int k = 0;
      for (int b = 0; b < A; ++b)
        if (g.freq(b)) {  // insertion into the sorted prefix: stable, at most 16 codes
          int q = k++;
          for (; q > 0 && g.freq(o[static_cast<std::size_t>(q - 1)]) < g.freq(b); --q) o[static_cast<std::size_t>(q)] = o[static_cast<std::size_t>(q - 1)];
          o[static_cast<std::size_t>(q)] = static_cast<std::uint8_t>(b);
        }
      n[static_cast<std::size_t>(c)] = k;
    }
  }
};


// F[a | b << 4] of class k's pair table (total 2^12); see context_model.cpp.
std::array<std::uint32_t, 256> pair_freqs(const ContextModel& m, const CodeOrders& orders, int k);
// A decoder table of 2^s entries from n codes' frequencies (see context_model.cpp).
void fill_table(std::uint32_t* e, const std::uint32_t* freq, const std::uint32_t* code, std::size_t n, int s);

}  // namespace vq::context_detail
