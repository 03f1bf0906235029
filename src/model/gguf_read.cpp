// GGUF reader: a llama-architecture GGUF file into a Checkpoint and a Tokenizer. A decoder of
// untrusted bytes: every count and size is checked against the bytes left before it is used.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include <fmt/core.h>
#include <fmt/format.h>

#include "gguf_layout.hpp"
#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/input_file.hpp"
#include "veloxquant/model/gguf.hpp"

namespace vq {

namespace {

using namespace gguf;

constexpr int kMaxDims = 4;         // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 4;   // arrays of arrays are skipped up to this depth

// A metadata value: scalars as numbers, strings as text, arrays as (element type, count, where).
struct Value {
  std::uint32_t type = 0;
  std::int64_t i = 0;       // integer and bool values
  double f = 0;             // float values
  std::string s;            // string values
  std::uint32_t elem = 0;   // arrays
  std::uint64_t count = 0;
  std::size_t pos = 0;      // arrays: offset of the first element
};

class Cursor {
 public:
  Cursor(std::span<const std::byte> b, const std::string& name) : b_(b), name_(name) {}
  [[noreturn]] void fail(const std::string& what) const { throw FormatError(fmt::format("{}: {}", name_, what)); }
  std::size_t left() const { return b_.size() - pos_; }
  std::size_t pos() const { return pos_; }
  void need(std::uint64_t n, const char* what) const {
    if (n > left()) fail(fmt::format("truncated: {} needs {} bytes at offset {}, the file has {} left", what, n, pos_, left()));
  }
  template <class T>
  T raw(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str(const char* what) {
    const auto n = raw<std::uint64_t>(what);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }
  void skip(std::uint64_t n, const char* what) {
    need(n, what);
    pos_ += static_cast<std::size_t>(n);
  }
  void seek(std::size_t p) { pos_ = p; }

 private:
  std::span<const std::byte> b_;
  std::size_t pos_ = 0;
  const std::string& name_;
};

std::uint64_t scalar_size(std::uint32_t t) {
  switch (t) {
    case kU8: case kI8: case kBool: return 1;
    case kU16: case kI16: return 2;
    case kU32: case kI32: case kF32: return 4;
    case kU64: case kI64: case kF64: return 8;
    default: return 0;
  }
}

Value read_scalar(Cursor& c, std::uint32_t t, const std::string& key) {
  Value v;
  v.type = t;
  switch (t) {
    case kU8: v.i = c.raw<std::uint8_t>("a value"); break;
    case kI8: v.i = c.raw<std::int8_t>("a value"); break;
    case kBool: v.i = c.raw<std::uint8_t>("a value"); break;
    case kU16: v.i = c.raw<std::uint16_t>("a value"); break;
    case kI16: v.i = c.raw<std::int16_t>("a value"); break;
    case kU32: v.i = c.raw<std::uint32_t>("a value"); break;
    case kI32: v.i = c.raw<std::int32_t>("a value"); break;
    case kU64: {
      const auto u = c.raw<std::uint64_t>("a value");
      v.i = u > static_cast<std::uint64_t>(INT64_MAX) ? -1 : static_cast<std::int64_t>(u);
      break;
    }
    case kI64: v.i = c.raw<std::int64_t>("a value"); break;
    case kF32: v.f = c.raw<float>("a value"); break;
    case kF64: v.f = c.raw<double>("a value"); break;
    case kString: v.s = c.str("a string value"); break;
    default: c.fail(fmt::format("metadata key '{}' has unknown value type {}", key, t));
  }
  return v;
}

// Skips an array's elements (bounded by the bytes left), returning nothing.
void skip_array(Cursor& c, std::uint32_t elem, std::uint64_t count, const std::string& key, int depth) {
  if (depth > kMaxArrayDepth) c.fail(fmt::format("metadata key '{}' nests arrays deeper than {}", key, kMaxArrayDepth));
  if (const auto s = scalar_size(elem)) {
    if (count > c.left() / s) c.fail(fmt::format("truncated: array '{}' of {} elements does not fit in the {} bytes left", key, count, c.left()));
    c.skip(count * s, "an array");
    return;
  }
  if (elem != kString && elem != kArray) c.fail(fmt::format("metadata key '{}' is an array of unknown type {}", key, elem));
  const std::uint64_t min_elem = elem == kString ? 8 : 12;
  if (count > c.left() / min_elem) c.fail(fmt::format("truncated: array '{}' of {} elements does not fit in the {} bytes left", key, count, c.left()));
  for (std::uint64_t k = 0; k < count; ++k) {
    if (elem == kString) {
      c.skip(c.raw<std::uint64_t>("a string length"), "a string");
    } else {
      const auto e = c.raw<std::uint32_t>("an array type");
      skip_array(c, e, c.raw<std::uint64_t>("an array length"), key, depth + 1);
    }
  }
}

struct TensorInfo {
  std::vector<std::uint64_t> ne;
  std::uint32_t type = 0;
  std::uint64_t offset = 0, bytes = 0, elems = 0;
  bool used = false;
};

class Parser {
 public:
  Parser(std::span<const std::byte> bytes, const std::string& name, bool shape_only = false)
      : bytes_(bytes), name_(name), c_(bytes, name), shape_only_(shape_only) {}

  // The header, the metadata and the tensor infos only: any architecture and tensor type.
  GgufShape shape() {
    read_header();
    GgufShape g;
    g.architecture = string_of("general.architecture");
    const std::string a = g.architecture;
    g.n_layers = int_of(a + ".block_count", 1, 1 << 12);
    const int dim = int_of(a + ".embedding_length", 1, 1 << 20);
    const int heads = int_of(a + ".attention.head_count", 1, 1 << 16);
    g.n_kv_heads = int_of(a + ".attention.head_count_kv", 1, heads, heads);
    const int default_hs = dim % heads == 0 ? dim / heads : 0;
    g.key_length = int_of(a + ".attention.key_length", 1, 1 << 16, default_hs);
    g.value_length = int_of(a + ".attention.value_length", 1, 1 << 16, g.key_length);
    if (g.key_length == 0) c_.fail("embedding_length is not a multiple of head_count and key_length is missing");
    if (const auto base = float_of(a + ".rope.freq_base")) {
      if (!(*base > 0) || !std::isfinite(*base)) c_.fail(fmt::format("{}.rope.freq_base {} is not a positive number", a, *base));
      g.rope_freq_base = *base;
    }
    for (const auto& [tname, t] : tensors_) g.tensor_types.insert(t.type);
    return g;
  }

  GgufModel parse() {
    read_header();
    return build();
  }

 private:
  void read_header() {
    if (bytes_.size() < 4 || std::memcmp(bytes_.data(), kMagic, 4) != 0) c_.fail("not a GGUF file (no 'GGUF' magic)");
    c_.skip(4, "the magic");
    const auto version = c_.raw<std::uint32_t>("the version");
    if (version != 2 && version != 3)
      c_.fail(fmt::format("GGUF version {} is not supported (only 2 and 3, little-endian)", version));
    const auto n_tensors = c_.raw<std::uint64_t>("the tensor count");
    const auto n_kv = c_.raw<std::uint64_t>("the metadata count");
    // Each pair takes at least 13 bytes (key length, type, one byte of value), each tensor 24.
    if (n_kv > c_.left() / 13) c_.fail(fmt::format("metadata count {} cannot fit in a file of {} bytes", n_kv, bytes_.size()));
    for (std::uint64_t k = 0; k < n_kv; ++k) read_kv();
    if (n_tensors > c_.left() / 24) c_.fail(fmt::format("tensor count {} cannot fit in a file of {} bytes", n_tensors, bytes_.size()));
    for (std::uint64_t k = 0; k < n_tensors; ++k) read_tensor_info();
    std::uint64_t alignment = kDefaultAlignment;
    if (auto it = kv_.find("general.alignment"); it != kv_.end()) {
      alignment = static_cast<std::uint64_t>(integer(it->second, "general.alignment"));
      if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > (1u << 20))
        c_.fail(fmt::format("general.alignment {} is not a power of two up to 2^20", alignment));
    }
    data_ = (c_.pos() + alignment - 1) / alignment * alignment;
    if (data_ > bytes_.size()) c_.fail("truncated: the file ends before its tensor data");
    for (auto& [tname, t] : tensors_) {
      if (t.offset % alignment != 0) c_.fail(fmt::format("tensor {} starts at offset {}, not a multiple of the alignment {}", tname, t.offset, alignment));
      if (t.offset > bytes_.size() - data_ || t.bytes > bytes_.size() - data_ - t.offset)
        c_.fail(fmt::format("truncated: tensor {} ({} bytes at data offset {}) runs past the end of the file", tname, t.bytes, t.offset));
    }
  }

  std::int64_t integer(const Value& v, const std::string& key) const {
    if (v.type == kF32 || v.type == kF64 || v.type == kString || v.type == kArray || v.type == kBool)
      c_.fail(fmt::format("metadata key '{}' must be an integer", key));
    return v.i;
  }
  const Value* find(const std::string& key) const {
    auto it = kv_.find(key);
    return it == kv_.end() ? nullptr : &it->second;
  }
  std::string string_of(const std::string& key) const {
    const Value* v = find(key);
    if (!v) c_.fail(fmt::format("metadata key '{}' is missing", key));
    if (v->type != kString) c_.fail(fmt::format("metadata key '{}' must be a string", key));
    return v->s;
  }
  // A required (or, with a fallback, optional) integer key within lo..hi.
  int int_of(const std::string& key, std::int64_t lo, std::int64_t hi, std::optional<int> fallback = std::nullopt) const {
    const Value* v = find(key);
    if (!v) {
      if (fallback) return *fallback;
      c_.fail(fmt::format("metadata key '{}' is missing", key));
    }
    const std::int64_t x = integer(*v, key);
    if (x < lo || x > hi) c_.fail(fmt::format("metadata key '{}' is {}, outside {}..{}", key, x, lo, hi));
    return static_cast<int>(x);
  }
  std::optional<double> float_of(const std::string& key) const {
    const Value* v = find(key);
    if (!v) return std::nullopt;
    if (v->type != kF32 && v->type != kF64) c_.fail(fmt::format("metadata key '{}' must be a float", key));
    return v->f;
  }

  void read_kv() {
    std::string key = c_.str("a metadata key");
    if (key.empty())
      c_.fail(fmt::format("metadata pair {} has an empty key: the metadata before it is malformed (an array shorter than its count?)",
                          kv_.size()));
    const auto type = c_.raw<std::uint32_t>("a value type");
    Value v;
    if (type == kArray) {
      v.type = kArray;
      v.elem = c_.raw<std::uint32_t>("an array type");
      v.count = c_.raw<std::uint64_t>("an array length");
      v.pos = c_.pos();
      skip_array(c_, v.elem, v.count, key, 1);
    } else {
      v = read_scalar(c_, type, key);
    }
    if (!kv_.emplace(key, std::move(v)).second) c_.fail(fmt::format("metadata key '{}' appears twice", key));
  }

  void read_tensor_info() {
    std::string tname = c_.str("a tensor name");
    TensorInfo t;
    const auto n_dims = c_.raw<std::uint32_t>("a tensor's dimension count");
    if (n_dims < 1 || n_dims > kMaxDims) c_.fail(fmt::format("tensor {} has {} dimensions (1..{} allowed)", tname, n_dims, kMaxDims));
    t.elems = 1;
    for (std::uint32_t d = 0; d < n_dims; ++d) {
      const auto e = c_.raw<std::uint64_t>("a tensor dimension");
      if (e == 0 || e > bytes_.size() || t.elems > bytes_.size() / e)
        c_.fail(fmt::format("tensor {} dimension {} is {}: the tensor cannot fit in a file of {} bytes", tname, d, e, bytes_.size()));
      t.ne.push_back(e);
      t.elems *= e;
    }
    t.type = c_.raw<std::uint32_t>("a tensor type");
    t.offset = c_.raw<std::uint64_t>("a tensor offset");
    switch (t.type) {
      case kTensorF32: t.bytes = t.elems * 4; break;
      case kTensorF16: t.bytes = t.elems * 2; break;
      case kTensorQ8_0:
        if (t.ne[0] % kQ8BlockValues != 0) c_.fail(fmt::format("Q8_0 tensor {} has rows of {} values, not a multiple of 32", tname, t.ne[0]));
        t.bytes = t.elems / kQ8BlockValues * kQ8BlockBytes;
        break;
      default:
        // The shape alone needs no weights: a type this reader cannot dequantize (Q4_K, ...) is taken
        // with its size unknown (0: only its offset is checked).
        if (!shape_only_)
          c_.fail(fmt::format("tensor {} has ggml type {}, which is not supported (only F32 = 0, F16 = 1 and Q8_0 = 8)", tname, t.type));
        t.bytes = 0;
    }
    if (!tensors_.emplace(tname, std::move(t)).second) c_.fail(fmt::format("tensor {} appears twice", tname));
  }

  // The float32 values of tensor `tname`, which must have shape ne.
  std::vector<float> tensor(const std::string& tname, std::vector<std::uint64_t> ne) {
    auto it = tensors_.find(tname);
    if (it == tensors_.end()) c_.fail(fmt::format("tensor {} is missing", tname));
    TensorInfo& t = it->second;
    if (t.ne != ne) {
      auto shape = [](const std::vector<std::uint64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); };
      c_.fail(fmt::format("tensor {} has shape {}, expected {} for this model's metadata", tname, shape(t.ne), shape(ne)));
    }
    t.used = true;
    const std::byte* src = bytes_.data() + data_ + t.offset;
    std::vector<float> out(static_cast<std::size_t>(t.elems));
    if (t.type == kTensorF32) {
      std::memcpy(out.data(), src, t.bytes);
    } else if (t.type == kTensorF16) {
      to_f32(src, DType::F16, out.data(), out.size());
    } else {
      for (std::uint64_t blk = 0; blk < t.elems / kQ8BlockValues; ++blk) {
        const std::byte* b = src + blk * kQ8BlockBytes;
        std::uint16_t d;
        std::memcpy(&d, b, 2);
        const float scale = f16_to_f32(d);
        for (std::uint64_t k = 0; k < kQ8BlockValues; ++k)
          out[static_cast<std::size_t>(blk * kQ8BlockValues + k)] = scale * static_cast<float>(static_cast<std::int8_t>(b[2 + k]));
      }
    }
    // A NaN or infinite weight poisons every activation after it: refused here, by name.
    for (std::size_t k = 0; k < out.size(); ++k)
      if (!std::isfinite(out[k])) c_.fail(fmt::format("tensor {} holds {} weight at element {}", tname, std::isnan(out[k]) ? "a NaN" : "an infinite", k));
    return out;
  }
  void append(std::vector<float>& all, const std::vector<float>& part) { all.insert(all.end(), part.begin(), part.end()); }

  Tokenizer tokenizer(int vocab) {
    if (string_of("tokenizer.ggml.model") != "llama")
      c_.fail(fmt::format("tokenizer.ggml.model '{}' is not supported (only 'llama', SentencePiece BPE)", string_of("tokenizer.ggml.model")));
    const Value* tokens = find("tokenizer.ggml.tokens");
    const Value* scores = find("tokenizer.ggml.scores");
    if (!tokens || tokens->type != kArray || tokens->elem != kString) c_.fail("tokenizer.ggml.tokens is missing or not an array of strings");
    if (!scores || scores->type != kArray || scores->elem != kF32) c_.fail("tokenizer.ggml.scores is missing or not an array of float32");
    if (tokens->count != static_cast<std::uint64_t>(vocab) || scores->count != tokens->count)
      c_.fail(fmt::format("the vocabulary has {} tokens and {} scores, the model {} rows of token_embd", tokens->count, scores->count, vocab));
    if (int_of("tokenizer.ggml.bos_token_id", 0, vocab - 1, Tokenizer::kBos) != Tokenizer::kBos ||
        int_of("tokenizer.ggml.eos_token_id", 0, vocab - 1, Tokenizer::kEos) != Tokenizer::kEos)
      c_.fail("only vocabularies with BOS id 1 and EOS id 2 are supported");
    // As a llama2.c tokenizer file: max_token_length, then (score, length, bytes) per token, with
    // U+2581 back to a space.
    std::vector<std::string> pieces;
    Cursor tc(bytes_, name_), sc(bytes_, name_);
    tc.seek(tokens->pos);
    sc.seek(scores->pos);
    std::string file(4, '\0');
    std::int32_t max_len = 1;
    for (int i = 0; i < vocab; ++i) {
      const std::string raw = tc.str("a token");
      std::string p;
      for (std::size_t k = 0; k < raw.size(); ++k) {
        if (raw.compare(k, 3, kSpaceMark) == 0) {
          p += ' ';
          k += 2;
        } else {
          p += raw[k];
        }
      }
      if (p.size() > (1u << 16)) c_.fail(fmt::format("token {} is {} bytes long (at most 65536)", i, p.size()));
      max_len = std::max<std::int32_t>(max_len, static_cast<std::int32_t>(p.size()));
      const float s = sc.raw<float>("a score");
      const auto len = static_cast<std::int32_t>(p.size());
      file.append(reinterpret_cast<const char*>(&s), 4).append(reinterpret_cast<const char*>(&len), 4).append(p);
    }
    std::memcpy(file.data(), &max_len, 4);
    return Tokenizer::parse(file, vocab, name_);
  }

  GgufModel build() {
    const std::string arch = string_of("general.architecture");
    if (arch != "llama") c_.fail(fmt::format("architecture '{}' is not supported (only 'llama')", arch));
    ModelConfig c;
    c.dim = int_of("llama.embedding_length", 1, 1 << 16);
    c.hidden_dim = int_of("llama.feed_forward_length", 1, 1 << 18);
    c.n_layers = int_of("llama.block_count", 1, 1 << 10);
    c.n_heads = int_of("llama.attention.head_count", 1, c.dim);
    c.n_kv_heads = int_of("llama.attention.head_count_kv", 1, c.n_heads, c.n_heads);
    c.seq_len = int_of("llama.context_length", 1, 1 << 20);
    const int default_hs = c.dim % c.n_heads == 0 ? c.dim / c.n_heads : 0;
    const int k_len = int_of("llama.attention.key_length", 1, 1 << 16, default_hs);
    const int v_len = int_of("llama.attention.value_length", 1, 1 << 16, k_len);
    if (k_len == 0) c_.fail("embedding_length is not a multiple of head_count and key_length is missing");
    if (v_len != k_len) c_.fail(fmt::format("key_length {} and value_length {} differ, which is not supported", k_len, v_len));
    if (int_of("llama.rope.dimension_count", 1, 1 << 16, k_len) != k_len)
      c_.fail(fmt::format("rope.dimension_count must equal the head size {} (partial RoPE is not supported)", k_len));
    if (const auto eps = float_of("llama.attention.layer_norm_rms_epsilon"); eps && static_cast<float>(*eps) != 1e-5f)
      c_.fail(fmt::format("attention.layer_norm_rms_epsilon {} is not supported (only 1e-5, as llama2.c)", *eps));
    if (const auto base = float_of("llama.rope.freq_base"); base && *base != 10000.0)
      c_.fail(fmt::format("rope.freq_base {} is not supported (only 10000, as llama2.c)", *base));
    if (find("llama.rope.scaling.type") && string_of("llama.rope.scaling.type") != "none")
      c_.fail("RoPE scaling is not supported");
    c.head_dim = k_len == default_hs ? 0 : k_len;
    auto tok_it = tensors_.find("token_embd.weight");
    if (tok_it == tensors_.end()) c_.fail("tensor token_embd.weight is missing");
    if (tok_it->second.ne.size() != 2 || tok_it->second.ne[1] > (1u << 20)) c_.fail("tensor token_embd.weight is not [dim, vocab]");
    c.vocab_size = static_cast<int>(tok_it->second.ne[1]);
    c.shared_classifier = tensors_.find("output.weight") == tensors_.end();
    validate_model_config(c, name_);

    GgufModel m{Checkpoint{}, tokenizer(c.vocab_size)};
    Checkpoint& ck = m.checkpoint;
    ck.config = c;
    const auto d = static_cast<std::uint64_t>(c.dim), q = static_cast<std::uint64_t>(c.q_dim()), kv = static_cast<std::uint64_t>(c.kv_dim()),
               h = static_cast<std::uint64_t>(c.hidden_dim), n = static_cast<std::uint64_t>(c.vocab_size);
    ck.token_embedding = tensor("token_embd.weight", {d, n});
    ck.rms_final = tensor("output_norm.weight", {d});
    if (!c.shared_classifier) ck.wcls = tensor("output.weight", {d, n});
    for (int l = 0; l < c.n_layers; ++l) {
      append(ck.rms_att, tensor(block_tensor(l, "attn_norm"), {d}));
      append(ck.wq, tensor(block_tensor(l, "attn_q"), {d, q}));
      append(ck.wk, tensor(block_tensor(l, "attn_k"), {d, kv}));
      append(ck.wv, tensor(block_tensor(l, "attn_v"), {d, kv}));
      append(ck.wo, tensor(block_tensor(l, "attn_output"), {q, d}));
      append(ck.rms_ffn, tensor(block_tensor(l, "ffn_norm"), {d}));
      append(ck.w1, tensor(block_tensor(l, "ffn_gate"), {d, h}));
      append(ck.w2, tensor(block_tensor(l, "ffn_down"), {h, d}));
      append(ck.w3, tensor(block_tensor(l, "ffn_up"), {d, h}));
    }
    for (const auto& [tname, t] : tensors_)
      if (!t.used) c_.fail(fmt::format("tensor {} is not part of a llama model this reader knows", tname));
    return m;
  }

  std::span<const std::byte> bytes_;
  const std::string& name_;
  Cursor c_;
  std::map<std::string, Value> kv_;
  std::map<std::string, TensorInfo> tensors_;
  std::size_t data_ = 0;
  bool shape_only_ = false;
};

}  // namespace

GgufModel parse_gguf(std::span<const std::byte> bytes, const std::string& name) { return Parser(bytes, name).parse(); }

bool is_gguf_file(const std::string& path) {
  // Only a regular file is opened: opening a FIFO here would block before the loader could refuse it.
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  char magic[4] = {};
  const bool ok = std::fread(magic, 1, 4, f) == 4 && std::memcmp(magic, kMagic, 4) == 0;
  std::fclose(f);
  return ok;
}

GgufShape parse_gguf_shape(std::span<const std::byte> bytes, const std::string& name) {
  GgufShape g = Parser(bytes, name, true).shape();
  g.fingerprint = XXH64(bytes.data(), bytes.size(), 0);
  return g;
}

namespace {
// fn over the file's bytes, mapped, not read: a model of many GB is hashed where it lies.
template <class Fn>
auto with_mapped_model(const std::string& path, Fn fn) {
  InputFile in(path, "model");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(fmt::format("cannot open model {}: {}", path, std::strerror(errno)));
  const auto size = static_cast<std::size_t>(in.size());
  void* p = size ? ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
  ::close(fd);
  if (size && p == MAP_FAILED) throw IoError(fmt::format("cannot map model {}: {}", path, std::strerror(errno)));
  struct Unmap {
    void* p;
    std::size_t n;
    ~Unmap() {
      if (p) ::munmap(p, n);
    }
  } unmap{size ? p : nullptr, size};
  return fn(std::span<const std::byte>(static_cast<const std::byte*>(unmap.p), size));
}
}  // namespace

GgufShape load_gguf_shape(const std::string& path) {
  return with_mapped_model(path, [&](std::span<const std::byte> bytes) { return parse_gguf_shape(bytes, path); });
}

std::optional<GgufModel> load_gguf_if_ours(const std::string& path, const GgufShape& shape, std::string& why) {
  for (const std::uint32_t t : shape.tensor_types)
    if (t != kTensorF32 && t != kTensorF16 && t != kTensorQ8_0) {
      why = fmt::format("{}: tensor type {} (only F32, F16 and Q8_0 are read)", path, t);
      return std::nullopt;
    }
  try {
    return load_gguf(path);
  } catch (const FormatError& e) {
    why = e.what();
    return std::nullopt;
  }
}

std::uint64_t model_file_fingerprint(const std::string& path) {
  return with_mapped_model(path, [](std::span<const std::byte> bytes) { return XXH64(bytes.data(), bytes.size(), 0); });
}

GgufModel load_gguf(const std::string& path) {
  InputFile in(path, "model");
  std::vector<std::byte> bytes(static_cast<std::size_t>(in.size()));
  if (!in.read(bytes.data(), bytes.size())) throw IoError(fmt::format("cannot read model {}: it shrank while being read", path));
  GgufModel m = parse_gguf(bytes, path);
  m.checkpoint.file_fingerprint = XXH64(bytes.data(), bytes.size(), 0);
  return m;
}

}  // namespace vq
