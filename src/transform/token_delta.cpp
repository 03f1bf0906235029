#include "veloxquant/transform/token_delta.hpp"

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

std::vector<std::int16_t> token_delta(std::span<const std::uint8_t> codes, int n_tokens, int dim) {
  require(n_tokens >= 0 && dim >= 1 && codes.size() == static_cast<std::size_t>(n_tokens) * static_cast<std::size_t>(dim),
          "token_delta: {} codes given for a [{}, {}] matrix", codes.size(), n_tokens, dim);
  std::vector<std::int16_t> out(codes.size());
  for (int c = 0; c < dim && n_tokens > 0; ++c) out[static_cast<std::size_t>(c)] = codes[static_cast<std::size_t>(c)];
  for (std::size_t i = static_cast<std::size_t>(dim); i < codes.size(); ++i)
    out[i] = static_cast<std::int16_t>(static_cast<int>(codes[i]) - static_cast<int>(codes[i - static_cast<std::size_t>(dim)]));
  return out;
}

std::vector<std::uint8_t> token_undelta(std::span<const std::int16_t> deltas, int n_tokens, int dim) {
  require(n_tokens >= 0 && dim >= 1 && deltas.size() == static_cast<std::size_t>(n_tokens) * static_cast<std::size_t>(dim),
          "token_undelta: {} deltas given for a [{}, {}] matrix", deltas.size(), n_tokens, dim);
  std::vector<std::uint8_t> out(deltas.size());
  std::vector<int> acc(static_cast<std::size_t>(dim), 0);
  for (std::size_t i = 0; i < deltas.size(); ++i) {
    int& a = acc[i % static_cast<std::size_t>(dim)];
    a += deltas[i];
    if (a < 0 || a > 255) throw FormatError(fmt::format("token_undelta: running sum {} leaves the code range at element {}", a, i));
    out[i] = static_cast<std::uint8_t>(a);
  }
  return out;
}

}  // namespace vq
