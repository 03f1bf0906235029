// libFuzzer target: CachegenPaperProfile::parse (peers/cachegen_paper_profile.hpp) on arbitrary
// bytes. Checks: only vq::FormatError escapes (never a crash, an out-of-bounds read under ASan,
// or an allocation the input does not justify); a parsed profile re-serialises to exactly the
// input, or, when the input spends bytes on overlong varints (the only freedom the format
// leaves), to fewer bytes that parse to a profile serialising the same.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "veloxquant/core/error.hpp"
#include "veloxquant/peers/cachegen_paper_profile.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> in(data, size);
  vq::CachegenPaperProfile p;
  try {
    p = vq::CachegenPaperProfile::parse(in);
  } catch (const vq::FormatError&) {
    return 0;
  }
  for (const auto& layer : p.layers)
    for (const auto& t : layer)
      if (t.anchor.size() != static_cast<std::size_t>(t.channels) || t.delta.size() != static_cast<std::size_t>(t.channels)) std::abort();
  const std::vector<std::uint8_t> again = p.serialize();
  if (again.size() > size) std::abort();
  if (again.size() == size) {
    if (!std::equal(again.begin(), again.end(), in.begin())) std::abort();
  } else if (vq::CachegenPaperProfile::parse(again).serialize() != again) {
    std::abort();
  }
  return 0;
}
