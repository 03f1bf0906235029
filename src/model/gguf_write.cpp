// GGUF writer: a llama2.c checkpoint and its vocabulary as a llama-architecture GGUF v3 file, and
// the head padding. See gguf.hpp and docs/gguf.md.
#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/core.h>

#include "gguf_layout.hpp"
#include "veloxquant/core/atomic_file.hpp"
#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/gguf.hpp"

namespace vq {

namespace {

using namespace gguf;

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

class Bytes {
 public:
  template <class T>
  void raw(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  void str(const std::string& s) {
    raw<std::uint64_t>(s.size());
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    out.insert(out.end(), p, p + s.size());
  }
  void pad_to(std::uint64_t alignment) { out.resize((out.size() + alignment - 1) / alignment * alignment, std::byte{0}); }
  std::vector<std::byte> out;
};

// Metadata key/value pairs, counted as they are added.
struct Metadata {
  Bytes b;
  std::uint64_t count = 0;
  void key(const std::string& k, ValueType t) {
    b.str(k);
    b.raw<std::uint32_t>(t);
    ++count;
  }
  void u32(const std::string& k, std::uint32_t v) { key(k, kU32), b.raw(v); }
  void f32(const std::string& k, float v) { key(k, kF32), b.raw(v); }
  void str(const std::string& k, const std::string& v) { key(k, kString), b.str(v); }
  void array_header(const std::string& k, ValueType t, std::uint64_t n) {
    key(k, kArray);
    b.raw<std::uint32_t>(t);
    b.raw<std::uint64_t>(n);
  }
};

struct TensorOut {
  std::string name;
  std::vector<std::uint64_t> ne;  // ne[0]: elements per row
  const float* data;
};

std::string spm_piece(const std::string& p) {
  std::string out;
  for (char c : p) c == ' ' ? out += kSpaceMark : out += c;
  return out;
}

std::int32_t token_type(const Tokenizer& tok, int id) {
  if (id == Tokenizer::kUnk) return kTokUnknown;
  if (id == Tokenizer::kBos || id == Tokenizer::kEos) return kTokControl;
  const std::string& p = tok.piece(id);
  if (id >= Tokenizer::kByteBase && id < Tokenizer::kByteBase + 256 && p.size() == 6 && p.starts_with("<0x") && p.back() == '>')
    return kTokByte;
  return kTokNormal;
}

}  // namespace

Checkpoint pad_heads(const Checkpoint& ck, int P) {
  const ModelConfig& c = ck.config;
  const int hs = c.head_size();
  require(P >= hs && P % hs == 0 && P <= 65536, "--pad-head {} must be a multiple of the head size {} (at most 65536)", P, hs);
  if (P == hs) return ck;
  const int f = P / hs;  // pair j of a head becomes pair j * f
  const float q_scale = std::sqrt(static_cast<float>(P) / static_cast<float>(hs));
  auto slot = [&](int r) { return (r / 2) * f * 2 + r % 2; };
  Checkpoint out = ck;
  out.config.head_dim = P;
  const std::size_t L = sz(c.n_layers), D = sz(c.dim), HS = sz(hs), PP = sz(P);
  // Rows h*hs + r of a [L, heads*hs, dim] matrix go to rows h*P + slot(r) of [L, heads*P, dim].
  auto spread_rows = [&](const std::vector<float>& w, int heads, float scale) {
    std::vector<float> o(L * sz(heads) * PP * D, 0.0f);
    for (std::size_t l = 0; l < L; ++l)
      for (std::size_t h = 0; h < sz(heads); ++h)
        for (int r = 0; r < hs; ++r) {
          const float* src = w.data() + ((l * sz(heads) + h) * HS + sz(r)) * D;
          float* dst = o.data() + ((l * sz(heads) + h) * PP + sz(slot(r))) * D;
          for (std::size_t i = 0; i < D; ++i) dst[i] = src[i] * scale;
        }
    return o;
  };
  out.wq = spread_rows(ck.wq, c.n_heads, q_scale);
  out.wk = spread_rows(ck.wk, c.n_kv_heads, 1.0f);
  out.wv = spread_rows(ck.wv, c.n_kv_heads, 1.0f);
  // wo [L, dim, heads*hs]: column h*hs + r goes to column h*P + slot(r).
  const std::size_t QD = sz(c.n_heads) * HS, QP = sz(c.n_heads) * PP;
  out.wo.assign(L * D * QP, 0.0f);
  for (std::size_t l = 0; l < L; ++l)
    for (std::size_t o = 0; o < D; ++o)
      for (std::size_t h = 0; h < sz(c.n_heads); ++h)
        for (int r = 0; r < hs; ++r)
          out.wo[(l * D + o) * QP + h * PP + sz(slot(r))] = ck.wo[(l * D + o) * QD + h * HS + sz(r)];
  return out;
}

std::vector<std::byte> gguf_bytes(const Checkpoint& ck_in, const Tokenizer& tok, const GgufWriteOptions& options) {
  const Checkpoint ck = options.pad_head > 0 ? pad_heads(ck_in, options.pad_head) : ck_in;
  const ModelConfig& c = ck.config;
  validate_model_config(c, "model");
  require(tok.vocab_size() == c.vocab_size, "the tokenizer holds {} tokens but the model's vocabulary is {}", tok.vocab_size(), c.vocab_size);

  Metadata m;
  m.str("general.architecture", "llama");
  m.str("general.name", "veloxquant-convert");
  m.u32("general.alignment", static_cast<std::uint32_t>(kDefaultAlignment));
  const auto mt = options.matrices;
  m.u32("general.file_type", mt == GgufMatrixType::F32 ? 0 : mt == GgufMatrixType::F16 ? 1 : 7);  // llama_ftype: F32, mostly F16, mostly Q8_0
  m.u32("llama.vocab_size", static_cast<std::uint32_t>(c.vocab_size));
  m.u32("llama.context_length", static_cast<std::uint32_t>(c.seq_len));
  m.u32("llama.embedding_length", static_cast<std::uint32_t>(c.dim));
  m.u32("llama.block_count", static_cast<std::uint32_t>(c.n_layers));
  m.u32("llama.feed_forward_length", static_cast<std::uint32_t>(c.hidden_dim));
  m.u32("llama.attention.head_count", static_cast<std::uint32_t>(c.n_heads));
  m.u32("llama.attention.head_count_kv", static_cast<std::uint32_t>(c.n_kv_heads));
  m.u32("llama.attention.key_length", static_cast<std::uint32_t>(c.head_size()));
  m.u32("llama.attention.value_length", static_cast<std::uint32_t>(c.head_size()));
  m.u32("llama.rope.dimension_count", static_cast<std::uint32_t>(c.head_size()));
  m.f32("llama.rope.freq_base", 10000.0f);
  m.f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  m.str("tokenizer.ggml.model", "llama");
  const auto n = static_cast<std::uint64_t>(c.vocab_size);
  m.array_header("tokenizer.ggml.tokens", kString, n);
  for (int i = 0; i < c.vocab_size; ++i) m.b.str(spm_piece(tok.piece(i)));
  m.array_header("tokenizer.ggml.scores", kF32, n);
  for (int i = 0; i < c.vocab_size; ++i) m.b.raw(tok.score(i));
  m.array_header("tokenizer.ggml.token_type", kI32, n);
  for (int i = 0; i < c.vocab_size; ++i) m.b.raw(token_type(tok, i));
  m.u32("tokenizer.ggml.unknown_token_id", Tokenizer::kUnk);
  m.u32("tokenizer.ggml.bos_token_id", Tokenizer::kBos);
  m.u32("tokenizer.ggml.eos_token_id", Tokenizer::kEos);

  const auto d = static_cast<std::uint64_t>(c.dim), q = static_cast<std::uint64_t>(c.q_dim()), kv = static_cast<std::uint64_t>(c.kv_dim()),
             h = static_cast<std::uint64_t>(c.hidden_dim);
  std::vector<TensorOut> ts;
  ts.push_back({"token_embd.weight", {d, n}, ck.token_embedding.data()});
  ts.push_back({"output_norm.weight", {d}, ck.rms_final.data()});
  if (!c.shared_classifier) ts.push_back({"output.weight", {d, n}, ck.wcls.data()});
  for (int l = 0; l < c.n_layers; ++l) {
    const std::size_t L = sz(l);
    ts.push_back({block_tensor(l, "attn_norm"), {d}, ck.rms_att.data() + L * d});
    ts.push_back({block_tensor(l, "attn_q"), {d, q}, ck.wq.data() + L * q * d});
    ts.push_back({block_tensor(l, "attn_k"), {d, kv}, ck.wk.data() + L * kv * d});
    ts.push_back({block_tensor(l, "attn_v"), {d, kv}, ck.wv.data() + L * kv * d});
    ts.push_back({block_tensor(l, "attn_output"), {q, d}, ck.wo.data() + L * d * q});
    ts.push_back({block_tensor(l, "ffn_norm"), {d}, ck.rms_ffn.data() + L * d});
    ts.push_back({block_tensor(l, "ffn_gate"), {d, h}, ck.w1.data() + L * h * d});
    ts.push_back({block_tensor(l, "ffn_down"), {h, d}, ck.w2.data() + L * d * h});
    ts.push_back({block_tensor(l, "ffn_up"), {d, h}, ck.w3.data() + L * h * d});
  }

  Bytes out;
  for (char ch : kMagic) out.raw(ch);
  out.raw<std::uint32_t>(kVersion);
  out.raw<std::uint64_t>(ts.size());
  out.raw<std::uint64_t>(m.count);
  out.out.insert(out.out.end(), m.b.out.begin(), m.b.out.end());
  // Q8_0 needs rows of whole blocks; a matrix whose rows are not stays F16.
  auto type_of = [&](const TensorOut& t) {
    if (t.ne.size() != 2 || mt == GgufMatrixType::F32) return kTensorF32;
    return mt == GgufMatrixType::Q8_0 && t.ne[0] % kQ8BlockValues == 0 ? kTensorQ8_0 : kTensorF16;
  };
  auto bytes_of = [&](const TensorOut& t) {
    std::uint64_t elems = 1;
    for (auto e : t.ne) elems *= e;
    const auto type = type_of(t);
    return type == kTensorQ8_0 ? elems / kQ8BlockValues * kQ8BlockBytes : elems * (type == kTensorF16 ? 2 : 4);
  };
  std::uint64_t offset = 0;
  for (const auto& t : ts) {
    out.str(t.name);
    out.raw<std::uint32_t>(static_cast<std::uint32_t>(t.ne.size()));
    for (auto e : t.ne) out.raw<std::uint64_t>(e);
    out.raw<std::uint32_t>(type_of(t));
    out.raw<std::uint64_t>(offset);
    offset = (offset + bytes_of(t) + kDefaultAlignment - 1) / kDefaultAlignment * kDefaultAlignment;
  }
  for (const auto& t : ts) {
    out.pad_to(kDefaultAlignment);
    const std::size_t at = out.out.size(), bytes = static_cast<std::size_t>(bytes_of(t));
    out.out.resize(at + bytes);
    if (type_of(t) == kTensorF16) {
      from_f32(t.data, out.out.data() + at, DType::F16, bytes / 2);
    } else if (type_of(t) == kTensorQ8_0) {
      for (std::size_t blk = 0; blk < bytes / kQ8BlockBytes; ++blk) {
        const float* x = t.data + blk * kQ8BlockValues;
        float amax = 0.0f;
        for (std::size_t k = 0; k < kQ8BlockValues; ++k) amax = std::max(amax, std::fabs(x[k]));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        std::byte* b = out.out.data() + at + blk * kQ8BlockBytes;
        const std::uint16_t dh = f32_to_f16(d);
        std::memcpy(b, &dh, 2);
        for (std::size_t k = 0; k < kQ8BlockValues; ++k) b[2 + k] = static_cast<std::byte>(static_cast<std::int8_t>(std::lround(x[k] * inv)));
      }
    } else
      std::memcpy(out.out.data() + at, t.data, bytes);
  }
  return std::move(out.out);
}

void write_gguf(const std::string& path, const Checkpoint& ck, const Tokenizer& tok, const GgufWriteOptions& options) {
  const auto bytes = gguf_bytes(ck, tok, options);
  write_file_atomically(path, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()));
}

}  // namespace vq
