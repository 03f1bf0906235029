// Validators for the CLI's numeric options. Every numeric option of every subcommand goes through
// one of these, because CLI11 alone is too lenient for a tool whose numbers size buffers and loops:
// an empty string converts to 0 (`--steps ""`), integers are read with base prefixes ("010" is 8),
// and floats accept nan and inf. Each validator refuses anything but a plain decimal number in the
// option's documented range, with one line naming the range, and rewrites the accepted text to
// its canonical form so that CLI11's own conversion reads the same number the check saw (which is
// why they are attached with ->transform(), CLI11's modifying kind, not ->check()).
#pragma once
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <system_error>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

namespace vqcli {

// Token counts and sizes beyond this are refused outright: 2^40 is far past any KV cache or text
// this tool can hold, and keeps sums and products of such counts far from int64 overflow.
inline constexpr std::int64_t kMaxCount = std::int64_t{1} << 40;

namespace detail {
inline constexpr double kFloatMax = std::numeric_limits<float>::max();

// "1..8", or ">=1" for an integer bounded only by its type.
inline std::string range_text(std::int64_t lo, std::int64_t hi) {
  const bool unbounded = hi == std::numeric_limits<std::int64_t>::max() || hi == std::numeric_limits<int>::max();
  return unbounded ? fmt::format(">={}", lo) : fmt::format("{}..{}", lo, hi);
}
// "", " >=0", or " in 0..1" (a bound at float's largest value is no bound).
inline std::string range_text(double lo, double hi) {
  if (lo <= -kFloatMax && hi >= kFloatMax) return "";
  if (hi >= kFloatMax) return fmt::format(" >={}", lo);
  return fmt::format(" in {}..{}", lo, hi);
}
}  // namespace detail

// A decimal integer in [lo, hi] (an optional leading '+'; no spaces, prefixes or exponents).
inline CLI::Validator integer_in(std::int64_t lo, std::int64_t hi) {
  const std::string range = detail::range_text(lo, hi);
  const std::string said = range[0] == '>' ? range : "in " + range;
  return CLI::Validator(
      [lo, hi, said](std::string& s) -> std::string {
        const char* first = s.data() + (!s.empty() && s[0] == '+' ? 1 : 0);
        const char* last = s.data() + s.size();
        std::int64_t v = 0;
        const auto [end, ec] = std::from_chars(first, last, v);
        const bool number = first != last && end == last && (ec == std::errc() || ec == std::errc::result_out_of_range);
        if (!number || ec != std::errc() || v < lo || v > hi) return fmt::format("must be an integer {}, got '{}'", said, s);
        s = std::to_string(v);
        return {};
      },
      "[" + range + "]", "integer_in");
}

// A decimal unsigned 64-bit integer (seeds): any value 0..2^64-1, nothing else.
inline CLI::Validator any_uint64() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        std::uint64_t v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (s.empty() || end != s.data() + s.size() || ec != std::errc())
          return fmt::format("must be an integer in 0..18446744073709551615, got '{}'", s);
        s = std::to_string(v);
        return {};
      },
      "[0..2^64-1]", "any_uint64");
}

// A finite decimal number in [lo, hi] (nan and inf are refused); hi = float's largest value (or
// lo = its lowest) leaves that side unbounded, as far as a float option can hold.
inline CLI::Validator finite_in(double lo, double hi) {
  const std::string range = detail::range_text(lo, hi);
  return CLI::Validator(
      [lo, hi, range](std::string& s) -> std::string {
        const char* first = s.data() + (!s.empty() && s[0] == '+' ? 1 : 0);
        const char* last = s.data() + s.size();
        double v = 0;
        const auto [end, ec] = std::from_chars(first, last, v);
        if (first == last || end != last || ec != std::errc() || !std::isfinite(v) || v < lo || v > hi)
          return fmt::format("must be a finite number{}, got '{}'", range, s);
        s = fmt::format("{}", v);
        return {};
      },
      "[finite" + range + "]", "finite_in");
}

inline CLI::Validator finite_at_least(double lo) { return finite_in(lo, detail::kFloatMax); }
inline CLI::Validator any_finite() { return finite_in(-detail::kFloatMax, detail::kFloatMax); }

}  // namespace vqcli
