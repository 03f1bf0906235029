// libFuzzer target: the llama.cpp state reader (format/llama_state.hpp) on arbitrary bytes, read
// against two model shapes (stories260K's 5 layers x 4 KV heads of 8, and 2 layers x 1 head of 4).
// Checks: only vq::FormatError escapes (never a crash, an out-of-bounds read under ASan, or an
// allocation the input's size does not justify); a file that reads writes back to the same bytes
// (the reader keeps every field the layout has, and refuses trailing bytes).
// The seed corpus (fuzz/corpus/fuzz_llama_state, from vq_fuzz_make_corpus) holds states written by
// our writer in F32/F16/BF16, V per cell and transposed, one and several streams, with a cut and a
// flipped copy of each.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "veloxquant/core/error.hpp"
#include "veloxquant/format/llama_state.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> in(data, size);
  for (const vq::LlamaStateModel model : {vq::LlamaStateModel{5, 4, 8, 8}, vq::LlamaStateModel{2, 1, 4, 4}}) {
    vq::LlamaState st;
    try {
      st = vq::read_llama_state(in, model, "fuzz");
    } catch (const vq::FormatError&) {
      continue;
    }
    const auto again = vq::write_llama_state(st);
    if (again.size() != size || !std::equal(again.begin(), again.end(), data)) std::abort();
  }
  return 0;
}
