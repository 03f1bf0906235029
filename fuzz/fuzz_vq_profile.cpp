// libFuzzer target: read_vq_profile (vq/profile.hpp) on arbitrary bytes. Checks: only
// vq::FormatError escapes (never a crash, an out-of-bounds read under ASan, or an allocation the
// input does not justify: sizes are checked against the bytes present first); a parsed profile
// writes back to exactly the input (the format leaves no freedom), and its layer models build.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "veloxquant/core/error.hpp"
#include "veloxquant/vq/profile.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> in(data, size);
  vq::VqProfile p;
  try {
    p = vq::read_vq_profile(in);
  } catch (const vq::FormatError&) {
    return 0;
  }
  const std::vector<std::uint8_t> again = vq::write_vq_profile(p);
  if (again.size() != size || !std::equal(again.begin(), again.end(), in.begin())) std::abort();
  for (int l = 0; l < p.layers; ++l) {
    const auto m = vq::vq_profile_layer(p, l);
    if (!m || m->k.n != p.kv_heads * p.head_dim || !m->source || m->source->fingerprint != p.hash) std::abort();
  }
  return 0;
}
