// llama2.c checkpoint loader: see checkpoint.hpp for both layouts, field by field.
#include "veloxquant/model/checkpoint.hpp"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>

#include <xxhash.h>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/core/input_file.hpp"

namespace vq {

namespace {

constexpr std::uint32_t kVersion1Magic = 0x616b3432u;  // "ak42" as written by export.py
constexpr std::size_t kVersion1HeaderBytes = 256;      // export.py pads its header to 256 bytes
constexpr std::size_t kLegacyHeaderBytes = 7 * 4;

// Caps far above any llama2.c model, low enough that every size product fits in 64 bits.
constexpr int kMaxDim = 1 << 16;
constexpr int kMaxHidden = 1 << 18;
constexpr int kMaxLayers = 1 << 10;
constexpr int kMaxVocab = 1 << 20;
constexpr int kMaxSeqLen = 1 << 20;

std::int32_t read_i32(const std::byte* p) {
  std::int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Hands out consecutive float tensors from the byte range; the total size was checked up front,
// but every read is still bounds-checked.
class Reader {
 public:
  Reader(std::span<const std::byte> bytes, std::size_t pos, const std::string& name) : bytes_(bytes), pos_(pos), name_(name) {}
  std::vector<float> floats(std::uint64_t count, const char* what) {
    const std::uint64_t n = count * 4;
    if (pos_ > bytes_.size() || n > bytes_.size() - pos_)
      throw FormatError(fmt::format("{}: truncated while reading {} ({} bytes needed at offset {}, file has {})", name_, what, n,
                                    pos_, bytes_.size()));
    std::vector<float> out(count);
    if (n) std::memcpy(out.data(), bytes_.data() + pos_, n);
    pos_ += n;
    return out;
  }
  void skip(std::uint64_t count, const char* what) {
    const std::uint64_t n = count * 4;
    if (pos_ > bytes_.size() || n > bytes_.size() - pos_)
      throw FormatError(fmt::format("{}: truncated while skipping {}", name_, what));
    pos_ += n;
  }
  std::size_t pos() const { return pos_; }

 private:
  std::span<const std::byte> bytes_;
  std::size_t pos_;
  const std::string& name_;
};

struct Sizes {
  std::uint64_t emb, norm, att, kv, ffn, cls, freq;
};

Sizes sizes_of(const ModelConfig& c) {
  const std::uint64_t L = c.n_layers, d = c.dim, kv = c.kv_dim(), h = c.hidden_dim, v = c.vocab_size;
  return Sizes{v * d, L * d, L * d * d, L * kv * d, L * h * d, c.shared_classifier ? 0 : v * d,
               static_cast<std::uint64_t>(c.seq_len) * static_cast<std::uint64_t>(c.head_size() / 2)};
}

void check_size(std::size_t actual, std::uint64_t expected, const std::string& name, const char* layout, const ModelConfig& c) {
  if (actual == expected) return;
  throw FormatError(fmt::format(
      "{}: {} checkpoint has {} bytes but its header (dim {}, hidden_dim {}, n_layers {}, n_heads {}, n_kv_heads {}, vocab {}, "
      "seq_len {}, {} classifier) implies {} bytes: the file is {} or not a llama2.c checkpoint",
      name, layout, actual, c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.seq_len,
      c.shared_classifier ? "shared" : "separate", expected, actual < expected ? "truncated" : "longer than expected"));
}

ModelConfig config_from_header(const std::byte* p, bool version1) {
  ModelConfig c;
  c.dim = read_i32(p + 0);
  c.hidden_dim = read_i32(p + 4);
  c.n_layers = read_i32(p + 8);
  c.n_heads = read_i32(p + 12);
  c.n_kv_heads = read_i32(p + 16);
  const std::int32_t vocab = read_i32(p + 20);
  c.seq_len = read_i32(p + 24);
  if (version1) {
    c.vocab_size = vocab;
  } else {
    // Legacy: the sign of vocab_size says whether wcls follows (negative) or is shared (positive).
    c.shared_classifier = vocab > 0;
    c.vocab_size = vocab == INT32_MIN ? 0 : (vocab < 0 ? -vocab : vocab);
  }
  return c;
}

Checkpoint parse_legacy(std::span<const std::byte> bytes, const std::string& name) {
  if (bytes.size() < kLegacyHeaderBytes)
    throw FormatError(fmt::format("{}: {} bytes is too short for a llama2.c checkpoint header (28 bytes)", name, bytes.size()));
  Checkpoint ck;
  ck.layout = CheckpointLayout::Legacy;
  ck.config = config_from_header(bytes.data(), false);
  validate_model_config(ck.config, name);
  const ModelConfig& c = ck.config;
  const Sizes s = sizes_of(c);
  const std::uint64_t floats = s.emb + 2 * s.norm + 2 * s.att + 2 * s.kv + 3 * s.ffn + c.dim + 2 * s.freq + s.cls;
  check_size(bytes.size(), kLegacyHeaderBytes + 4 * floats, name, "legacy", c);

  Reader r(bytes, kLegacyHeaderBytes, name);
  ck.token_embedding = r.floats(s.emb, "token_embedding");
  ck.rms_att = r.floats(s.norm, "rms_att");
  ck.wq = r.floats(s.att, "wq");
  ck.wk = r.floats(s.kv, "wk");
  ck.wv = r.floats(s.kv, "wv");
  ck.wo = r.floats(s.att, "wo");
  ck.rms_ffn = r.floats(s.norm, "rms_ffn");
  ck.w1 = r.floats(s.ffn, "w1");
  ck.w2 = r.floats(s.ffn, "w2");
  ck.w3 = r.floats(s.ffn, "w3");
  ck.rms_final = r.floats(c.dim, "rms_final");
  r.skip(2 * s.freq, "freq_cis_real/imag");
  if (!c.shared_classifier) ck.wcls = r.floats(s.cls, "wcls");
  return ck;
}

Checkpoint parse_version1(std::span<const std::byte> bytes, const std::string& name) {
  if (bytes.size() < kVersion1HeaderBytes)
    throw FormatError(fmt::format("{}: {} bytes is too short for a version-1 llama2.c header (256 bytes)", name, bytes.size()));
  const std::int32_t version = read_i32(bytes.data() + 4);
  if (version != 1)
    throw FormatError(fmt::format("{}: llama2.c checkpoint version {} is not supported (only version 1, float32, and the legacy "
                                  "layout; re-export with export.py --version 1 or --version 0)",
                                  name, version));
  Checkpoint ck;
  ck.layout = CheckpointLayout::Version1;
  ck.config = config_from_header(bytes.data() + 8, true);
  const auto flag = static_cast<std::uint8_t>(bytes[36]);
  if (flag > 1) throw FormatError(fmt::format("{}: shared_classifier flag is {}, expected 0 or 1", name, flag));
  ck.config.shared_classifier = flag == 1;
  validate_model_config(ck.config, name);
  const ModelConfig& c = ck.config;
  const Sizes s = sizes_of(c);
  const std::uint64_t floats = s.emb + 2 * s.norm + 2 * s.att + 2 * s.kv + 3 * s.ffn + c.dim + s.cls;
  check_size(bytes.size(), kVersion1HeaderBytes + 4 * floats, name, "version-1", c);

  Reader r(bytes, kVersion1HeaderBytes, name);
  ck.rms_att = r.floats(s.norm, "attention_norm");
  ck.rms_ffn = r.floats(s.norm, "ffn_norm");
  ck.rms_final = r.floats(c.dim, "norm");
  ck.token_embedding = r.floats(s.emb, "tok_embeddings");
  ck.wq = r.floats(s.att, "wq");
  ck.wk = r.floats(s.kv, "wk");
  ck.wv = r.floats(s.kv, "wv");
  ck.wo = r.floats(s.att, "wo");
  ck.w1 = r.floats(s.ffn, "w1");
  ck.w2 = r.floats(s.ffn, "w2");
  ck.w3 = r.floats(s.ffn, "w3");
  if (!c.shared_classifier) ck.wcls = r.floats(s.cls, "output");
  return ck;
}

}  // namespace

void validate_model_config(const ModelConfig& c, const std::string& name) {
  auto bad = [&](const std::string& what) {
    throw FormatError(fmt::format("{}: {} (header: dim {}, hidden_dim {}, n_layers {}, n_heads {}, n_kv_heads {}, vocab {}, seq_len {}); "
                                  "not a valid llama2.c checkpoint",
                                  name, what, c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.seq_len));
  };
  if (c.dim < 1 || c.dim > kMaxDim) bad(fmt::format("dim must be in 1..{}", kMaxDim));
  if (c.hidden_dim < 1 || c.hidden_dim > kMaxHidden) bad(fmt::format("hidden_dim must be in 1..{}", kMaxHidden));
  if (c.n_layers < 1 || c.n_layers > kMaxLayers) bad(fmt::format("n_layers must be in 1..{}", kMaxLayers));
  if (c.n_heads < 1 || c.n_heads > c.dim) bad("n_heads must be in 1..dim");
  if (c.head_dim < 0 || c.head_dim > kMaxDim) bad(fmt::format("head_dim must be in 0..{}", kMaxDim));
  if (c.head_dim == 0 && c.dim % c.n_heads != 0) bad("dim must be a multiple of n_heads");
  if (static_cast<std::int64_t>(c.n_heads) * c.head_size() > kMaxDim) bad(fmt::format("n_heads * head_dim must be at most {}", kMaxDim));
  if (c.head_size() % 2 != 0) bad("head size must be even for RoPE");
  if (c.n_kv_heads < 1 || c.n_kv_heads > c.n_heads) bad("n_kv_heads must be in 1..n_heads");
  if (c.n_heads % c.n_kv_heads != 0) bad("n_kv_heads must divide n_heads");
  if (c.vocab_size < 1 || c.vocab_size > kMaxVocab) bad(fmt::format("vocab_size must be in 1..{}", kMaxVocab));
  if (c.seq_len < 1 || c.seq_len > kMaxSeqLen) bad(fmt::format("seq_len must be in 1..{}", kMaxSeqLen));
}

Checkpoint Checkpoint::parse(std::span<const std::byte> bytes, const std::string& name) {
  if (bytes.size() >= 4) {
    std::uint32_t magic;
    std::memcpy(&magic, bytes.data(), 4);
    if (magic == kVersion1Magic) return parse_version1(bytes, name);
  }
  return parse_legacy(bytes, name);
}

Checkpoint Checkpoint::load(const std::string& path) {
  InputFile in(path, "checkpoint");
  std::vector<std::byte> bytes(static_cast<std::size_t>(in.size()));
  if (!in.read(bytes.data(), bytes.size())) throw IoError(fmt::format("cannot read checkpoint {}: it shrank while being read", path));
  Checkpoint ck = parse(bytes, path);
  ck.file_fingerprint = XXH64(bytes.data(), bytes.size(), 0);
  return ck;
}

}  // namespace vq
