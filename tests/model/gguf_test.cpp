// GGUF: stories260K converted to a llama-architecture GGUF and read back is the same model (weights
// bit for bit, vocabulary, perplexity, greedy text); the head-padded file computes the same function;
// F16 files load as the rounded weights; bad files are refused with one clear message.
#include "veloxquant/model/gguf.hpp"

#include <cmath>
#include <cstring>
#include <filesystem>

#include <gtest/gtest.h>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/generate.hpp"
#include "veloxquant/model/transformer.hpp"
#include "model_support.hpp"
#include "../support/test_util.hpp"

namespace {

struct Source {
  vq::Checkpoint ck = vq::Checkpoint::load(vqtest::model_path());
  vq::Tokenizer tok = vq::Tokenizer::load(vqtest::tokenizer_path(), 512);
  std::vector<std::byte> gguf = vq::gguf_bytes(ck, tok);
};

const Source& source() {
  static const Source s;
  return s;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

std::string validation_text() { return vqtest::read_file(vqtest::models_dir() + "/tinystories_val.txt"); }

// Perplexity of the first n tokens of the validation text (BOS first), in one forward call.
double perplexity(vq::Transformer& t, const vq::Tokenizer& tok, std::size_t n) {
  auto ids = tok.encode(validation_text().substr(0, 8 * n + 64), true, false);
  ids.resize(n);
  auto caches = vq::make_fp32_caches(t);
  const auto logits = t.forward(ids, caches);
  const std::size_t V = static_cast<std::size_t>(t.config().vocab_size);
  double nll = 0;
  for (std::size_t i = 0; i + 1 < n; ++i) {
    const float* row = logits.data() + i * V;
    double mx = row[0], z = 0;
    for (std::size_t j = 1; j < V; ++j) mx = std::max(mx, static_cast<double>(row[j]));
    for (std::size_t j = 0; j < V; ++j) z += std::exp(row[j] - mx);
    nll += std::log(z) + mx - row[static_cast<std::size_t>(ids[i + 1])];
  }
  return std::exp(nll / static_cast<double>(n - 1));
}

std::string greedy(vq::Transformer& t, const vq::Tokenizer& tok) {
  auto caches = vq::make_fp32_caches(t);
  return vq::generate(t, tok, caches, "", vq::GenerateConfig{}).text;
}

std::string parse_error(const std::vector<std::byte>& bytes) {
  try {
    vq::parse_gguf(bytes, "f.gguf");
  } catch (const vq::FormatError& e) {
    return e.what();
  }
  return "";
}

// Offset of the first occurrence of `s` in `bytes` (npos when absent).
std::size_t find(const std::vector<std::byte>& bytes, const std::string& s) {
  const std::string_view all(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return all.find(s);
}

TEST(Gguf, RoundTripKeepsWeightsBitForBitAndTheVocabulary) {
  const auto& s = source();
  const vq::GgufModel m = vq::parse_gguf(s.gguf);
  EXPECT_EQ(m.checkpoint.config, s.ck.config);
  for (auto [a, b] : {std::pair{&m.checkpoint.token_embedding, &s.ck.token_embedding}, {&m.checkpoint.rms_att, &s.ck.rms_att},
                      {&m.checkpoint.wq, &s.ck.wq}, {&m.checkpoint.wk, &s.ck.wk}, {&m.checkpoint.wv, &s.ck.wv},
                      {&m.checkpoint.wo, &s.ck.wo}, {&m.checkpoint.rms_ffn, &s.ck.rms_ffn}, {&m.checkpoint.w1, &s.ck.w1},
                      {&m.checkpoint.w2, &s.ck.w2}, {&m.checkpoint.w3, &s.ck.w3}, {&m.checkpoint.rms_final, &s.ck.rms_final},
                      {&m.checkpoint.wcls, &s.ck.wcls}})
    EXPECT_TRUE(same_bits(*a, *b));
  ASSERT_EQ(m.tokenizer.vocab_size(), s.tok.vocab_size());
  for (int i = 0; i < s.tok.vocab_size(); ++i) {
    EXPECT_EQ(m.tokenizer.piece(i), s.tok.piece(i)) << i;
    EXPECT_EQ(m.tokenizer.score(i), s.tok.score(i)) << i;
  }
  const std::string text = validation_text();
  EXPECT_EQ(m.tokenizer.encode(text), s.tok.encode(text));
  // The file spells spaces as U+2581, as SentencePiece vocabularies do, and names llama's tensors.
  EXPECT_NE(find(s.gguf, "\xE2\x96\x81"), std::string::npos);
  EXPECT_NE(find(s.gguf, "blk.4.ffn_down.weight"), std::string::npos);
  EXPECT_EQ(find(s.gguf, std::string("\x0d\0\0\0\0\0\0\0output.weight", 21)), std::string::npos);  // shared classifier: token_embd reused
}

TEST(Gguf, SamePerplexityAndGreedyTextAsTheCheckpoint) {
  const auto& s = source();
  vq::GgufModel m = vq::parse_gguf(s.gguf);
  vq::Transformer from_bin(s.ck), from_gguf(std::move(m.checkpoint));
  EXPECT_EQ(perplexity(from_gguf, m.tokenizer, 256), perplexity(from_bin, s.tok, 256));
  EXPECT_EQ(greedy(from_gguf, m.tokenizer), greedy(from_bin, s.tok));
}

TEST(Gguf, PaddedHeadsComputeTheSameFunction) {
  const auto& s = source();
  vq::GgufModel m = vq::parse_gguf(vq::gguf_bytes(s.ck, s.tok, vq::GgufWriteOptions{32}));
  EXPECT_EQ(m.checkpoint.config.head_size(), 32);
  EXPECT_EQ(m.checkpoint.config.dim, s.ck.config.dim);
  vq::Transformer from_bin(s.ck), padded(std::move(m.checkpoint));
  EXPECT_EQ(padded.description().layer_head_dims.front(), 32);
  const double want = perplexity(from_bin, s.tok, 256), got = perplexity(padded, m.tokenizer, 256);
  EXPECT_NEAR(got, want, 1e-5 * want);
  EXPECT_EQ(greedy(padded, m.tokenizer), greedy(from_bin, s.tok));
  // The padding is a function of the weights only: rows outside the RoPE pair slots are zero.
  const auto& wk = vq::parse_gguf(vq::gguf_bytes(s.ck, s.tok, vq::GgufWriteOptions{32})).checkpoint.wk;
  for (std::size_t d = 0; d < 64; ++d) EXPECT_EQ(wk[2 * 64 + d], 0.0f);  // row 2 of head 0: an empty slot
  EXPECT_THROW(vq::gguf_bytes(s.ck, s.tok, vq::GgufWriteOptions{12}), vq::InvalidArgument);
}

TEST(Gguf, F16MatricesLoadAsTheRoundedWeights) {
  const auto& s = source();
  vq::GgufWriteOptions o;
  o.matrices = vq::GgufMatrixType::F16;
  const vq::GgufModel m = vq::parse_gguf(vq::gguf_bytes(s.ck, s.tok, o));
  std::vector<float> rounded(s.ck.wq.size());
  for (std::size_t i = 0; i < rounded.size(); ++i) rounded[i] = vq::f16_to_f32(vq::f32_to_f16(s.ck.wq[i]));
  EXPECT_TRUE(same_bits(m.checkpoint.wq, rounded));
  EXPECT_TRUE(same_bits(m.checkpoint.rms_att, s.ck.rms_att));  // norms stay float32
  EXPECT_FALSE(same_bits(m.checkpoint.wq, s.ck.wq));
}

// Q8_0 (dequantized at load): every weight within half a quantization step (d / 2, d = the
// block's max |x| / 127 as F16) of the original, and the model still runs close to the original.
TEST(Gguf, Q8_0MatricesLoadWithinHalfAStep) {
  const auto& s = source();
  vq::GgufWriteOptions o;
  o.matrices = vq::GgufMatrixType::Q8_0;
  vq::GgufModel m = vq::parse_gguf(vq::gguf_bytes(s.ck, s.tok, o));
  const auto& a = m.checkpoint.w1;
  const auto& b = s.ck.w1;
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t blk = 0; blk < b.size() / 32; ++blk) {
    float amax = 0;
    for (std::size_t k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(b[blk * 32 + k]));
    const float d = vq::f16_to_f32(vq::f32_to_f16(amax / 127.0f));
    for (std::size_t k = 0; k < 32; ++k)
      ASSERT_LE(std::fabs(a[blk * 32 + k] - b[blk * 32 + k]), 0.5f * d + 1e-3f * amax) << blk << " " << k;
  }
  EXPECT_FALSE(same_bits(a, b));
  vq::Transformer from_bin(s.ck), q8(std::move(m.checkpoint));
  const double want = perplexity(from_bin, s.tok, 256), got = perplexity(q8, m.tokenizer, 256);
  EXPECT_NEAR(got, want, 0.02 * want);  // a named budget: Q8_0 weights move perplexity by under 2 %
}

TEST(Gguf, RefusesTruncatedAndCorruptFiles) {
  const auto& good = source().gguf;
  // Every cut point in the header, metadata and tensor infos, and a few in the data.
  const std::size_t data_at = find(good, "blk.4.ffn_up.weight") + 64;
  for (std::size_t cut = 0; cut < good.size(); cut += cut < data_at ? 7 : 40'000) {
    const std::vector<std::byte> part(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut));
    EXPECT_NE(parse_error(part), "") << cut;
  }
  EXPECT_NE(parse_error(std::vector<std::byte>(good.begin(), good.end() - 1)).find("truncated"), std::string::npos);

  auto patched = [&](std::size_t at, const void* v, std::size_t n) {
    auto b = good;
    std::memcpy(b.data() + at, v, n);
    return parse_error(b);
  };
  EXPECT_NE(patched(0, "GGUG", 4).find("not a GGUF file"), std::string::npos);
  const std::uint32_t v1 = 1, big_endian_3 = 0x03000000;
  EXPECT_NE(patched(4, &v1, 4).find("version 1 is not supported"), std::string::npos);
  EXPECT_NE(patched(4, &big_endian_3, 4).find("is not supported"), std::string::npos);
  const std::uint64_t huge = std::uint64_t{1} << 60;
  EXPECT_NE(patched(8, &huge, 8).find("tensor count"), std::string::npos);
  EXPECT_NE(patched(16, &huge, 8).find("metadata count"), std::string::npos);
  // The vocabulary array's length (after the key, its type 9 and element type 8).
  const std::size_t tokens_len = find(good, "tokenizer.ggml.tokens") + 21 + 8;
  EXPECT_NE(patched(tokens_len, &huge, 8).find("does not fit"), std::string::npos);
  // A non-llama architecture.
  const std::size_t arch = find(good, "general.architecture") + 20 + 4 + 8;
  EXPECT_NE(patched(arch, "gpt2x", 5).find("architecture 'gpt2x' is not supported"), std::string::npos);
  // An unsupported tensor type (Q4_0 = 2) in token_embd.weight's info: name, n_dims, 2 dims, type.
  const std::size_t info = find(good, "token_embd.weight") + 17 + 4 + 16;
  const std::uint32_t q4_0 = 2, three_dims_plus = 9;
  EXPECT_NE(patched(info, &q4_0, 4).find("ggml type 2, which is not supported"), std::string::npos);
  EXPECT_NE(patched(info - 20, &three_dims_plus, 4).find("dimensions"), std::string::npos);
  const std::uint64_t huge_dim = std::uint64_t{1} << 62;
  EXPECT_NE(patched(info - 8, &huge_dim, 8).find("cannot fit"), std::string::npos);
}

// Issue 36: a NaN or infinite weight is refused at load with the tensor's name (it loaded and
// generated "Once<unk><unk>..."), and a shortened array, which makes the next key read as empty,
// says so (it read "metadata key '' appears twice").
TEST(Gguf, NonFiniteWeightsAndShortenedArraysAreNamed) {
  const Source& s = source();
  for (const float bad : {std::nanf(""), INFINITY}) {
    vq::Checkpoint ck = s.ck;
    ck.wk[ck.wk.size() / 2] = bad;
    const std::string e = parse_error(vq::gguf_bytes(ck, s.tok));
    EXPECT_NE(e.find("tensor blk."), std::string::npos) << e;
    EXPECT_NE(e.find(std::isnan(bad) ? "holds a NaN weight" : "holds an infinite weight"), std::string::npos) << e;
  }
  auto b = s.gguf;
  const std::size_t scores_len = find(b, "tokenizer.ggml.scores") + 21 + 8;
  std::uint64_t n = 0;
  std::memcpy(&n, b.data() + scores_len, 8);
  --n;
  std::memcpy(b.data() + scores_len, &n, 8);
  const std::string e = parse_error(b);
  EXPECT_EQ(e.find("appears twice"), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  // A key of length 0 (what a shortened array left where the issue met it).
  auto z = s.gguf;
  const std::uint64_t zero = 0;
  std::memcpy(z.data() + find(z, "general.architecture") - 8, &zero, 8);
  const std::string ez = parse_error(z);
  EXPECT_NE(ez.find("has an empty key: the metadata before it is malformed"), std::string::npos) << ez;
}

// The shape alone (issue 30: the prompt cache on any GGUF llama.cpp runs): a tensor type this
// reader cannot dequantize (Q4_K = 12), refused by parse_gguf, is taken by parse_gguf_shape, which
// reads the attention shape from the metadata and names the file by a hash of all of it.
TEST(Gguf, TheShapeAloneReadsAnyTensorType) {
  const auto& good = source().gguf;
  const vq::GgufShape g = vq::parse_gguf_shape(good);
  EXPECT_EQ(g.architecture, "llama");
  EXPECT_EQ(g.n_layers, source().ck.config.n_layers);
  EXPECT_EQ(g.n_kv_heads, source().ck.config.n_kv_heads);
  EXPECT_EQ(g.key_length, source().ck.config.head_size());
  EXPECT_EQ(g.value_length, g.key_length);
  EXPECT_EQ(g.tensor_types, std::set<std::uint32_t>{0});  // float32 throughout
  auto k = good;
  const std::uint32_t q4_k = 12;
  std::memcpy(k.data() + find(k, "token_embd.weight") + 17 + 4 + 16, &q4_k, 4);
  EXPECT_NE(parse_error(k).find("ggml type 12, which is not supported"), std::string::npos);
  const vq::GgufShape gk = vq::parse_gguf_shape(k);
  EXPECT_EQ(gk.n_layers, g.n_layers);
  EXPECT_EQ(gk.tensor_types, (std::set<std::uint32_t>{0, 12}));
  EXPECT_NE(gk.fingerprint, g.fingerprint);
  EXPECT_THROW(vq::parse_gguf_shape(std::vector<std::byte>(good.begin(), good.begin() + 1000)), vq::FormatError);
  const std::string path = vqtest::temp_dir() + "/shape_only.gguf";
  vqtest::spit(path, std::string(reinterpret_cast<const char*>(k.data()), k.size()));
  EXPECT_EQ(vq::load_gguf_shape(path).fingerprint, gk.fingerprint);
  EXPECT_THROW(vq::load_gguf_shape(path + ".missing"), vq::IoError);
}

TEST(Gguf, CliConvertsAndEveryModelCommandTakesTheGgufAlone) {
  const std::string dir = vqtest::temp_dir() + "/gguf_cli";
  std::filesystem::create_directories(dir);
  const std::string out = dir + "/m.gguf", padded = dir + "/p.gguf";
  auto r = vqtest::run_cli("convert " + vqtest::model_path() + " --tokenizer " + vqtest::tokenizer_path() + " -o " + out);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(vqtest::read_file(out).size(), source().gguf.size());
  r = vqtest::run_cli("convert " + vqtest::model_path() + " --tokenizer " + vqtest::tokenizer_path() + " -o " + padded + " --pad-head 32");
  ASSERT_EQ(r.code, 0) << r.err;
  // No tokenizer beside the GGUF files: the vocabulary comes from the file.
  // A fixed seed: the default (0) seeds the sampler from the clock's seconds, so two runs that
  // straddle a second sample different text (seen under the sanitizers in CI).
  const auto want = vqtest::run_cli("generate --model " + vqtest::model_path() + " --tokenizer " + vqtest::tokenizer_path() + " --steps 64 --seed 42");
  ASSERT_EQ(want.code, 0) << want.err;
  for (const auto& m : {out, padded}) {
    const auto got = vqtest::run_cli("generate --model " + m + " --steps 64 --seed 42");
    EXPECT_EQ(got.code, 0) << got.err;
    EXPECT_EQ(got.out, want.out) << m;
  }
  r = vqtest::run_cli("convert " + vqtest::model_path() + " --tokenizer " + vqtest::tokenizer_path() + " -o " + dir + "/x.gguf --pad-head 12");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("--pad-head 12 must be a multiple of the head size 8"), std::string::npos) << r.err;
  vqtest::write_file(dir + "/bad.gguf", "GGUF\x03");
  r = vqtest::run_cli("generate --model " + dir + "/bad.gguf --steps 4");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("truncated"), std::string::npos) << r.err;
}

}  // namespace
