// libFuzzer target: the GGUF model reader (model/gguf.hpp) on arbitrary bytes.
// parse_gguf_shape (the attention shape, any tensor type) too. Checks: only vq::FormatError escapes (never a crash, an out-of-bounds read under ASan, or an
// allocation the input's size does not justify); a file that loads writes back (float32) to a file
// that loads to the same configuration, the same weights and the same vocabulary.
// The seed corpus (fuzz/corpus/fuzz_gguf_read) holds a tiny valid llama model (dim 8, one layer,
// two heads, four tokens; one with F16 matrices) and the header + metadata of stories260K's GGUF.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "veloxquant/core/error.hpp"
#include "veloxquant/model/gguf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  // The shape alone (any tensor type): only FormatError escapes; a shape it reads has positive sizes.
  try {
    const vq::GgufShape g = vq::parse_gguf_shape(in, "fuzz");
    if (g.n_layers < 1 || g.n_kv_heads < 1 || g.key_length < 1 || g.value_length < 1) std::abort();
  } catch (const vq::FormatError&) {
  }
  vq::GgufModel m;
  try {
    m = vq::parse_gguf(in, "fuzz");
  } catch (const vq::FormatError&) {
    return 0;
  }
  const auto again = vq::parse_gguf(vq::gguf_bytes(m.checkpoint, m.tokenizer), "fuzz-again");
  const auto& a = m.checkpoint;
  const auto& b = again.checkpoint;
  auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * 4) == 0);
  };
  if (!(a.config == b.config) || !same(a.wq, b.wq) || !same(a.wo, b.wo) || !same(a.token_embedding, b.token_embedding) ||
      !same(a.wcls, b.wcls) || again.tokenizer.vocab_size() != m.tokenizer.vocab_size())
    std::abort();
  for (int i = 0; i < m.tokenizer.vocab_size(); ++i)
    if (again.tokenizer.piece(i) != m.tokenizer.piece(i)) std::abort();
  return 0;
}
