// Writes the seed corpus of every fuzz target: valid inputs of several shapes, and a few broken ones.
//   vq_fuzz_make_corpus fuzz/corpus   (run from the repository root; files are committed)
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "veloxquant/format/llama_state.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/peers/cachegen_paper_cache.hpp"
#include "veloxquant/peers/lmcache_cache.hpp"
#include "veloxquant/vq/profile.hpp"
#include "veloxquant/vq/vq_cache.hpp"
#include "veloxquant/vq/vq_chain.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/store/prefix_chunks.hpp"
#include "cachegen_paper_fuzz_profile.hpp"
#include "store_blob_fuzz_identity.hpp"
#include "context_fuzz_layout.hpp"
#include "order1_fuzz_shape.hpp"
#include "../tests/format/vqkv_test_util.hpp"

namespace {

void write(const std::filesystem::path& dir, const std::string& name, const std::vector<std::uint8_t>& b) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Seed i of a target: valid_i = b, truncated_i = its first cut_to bytes, and (when flip_mask is
// nonzero) flipped_i = b with byte flip_at XOR flip_mask.
void write_seeds(const std::filesystem::path& dir, int i, const std::vector<std::uint8_t>& b, std::size_t cut_to, std::size_t flip_at = 0,
                 std::uint8_t flip_mask = 0) {
  write(dir, "valid_" + std::to_string(i), b);
  write(dir, "truncated_" + std::to_string(i), {b.begin(), b.begin() + static_cast<std::ptrdiff_t>(cut_to)});
  if (flip_mask == 0) return;
  auto flip = b;
  flip[flip_at] ^= flip_mask;
  write(dir, "flipped_" + std::to_string(i), flip);
}

std::vector<std::uint16_t> codes(int alphabet, std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::geometric_distribution<int> g(0.35);
  std::vector<std::uint16_t> s(n);
  for (auto& v : s) v = static_cast<std::uint16_t>(std::min(g(rng), alphabet - 1));
  return s;
}

// [1, H, S, D] of N(0, 1) values (all zero when `zero`).
vq::Tensor normal(std::int64_t H, std::int64_t S, std::int64_t D, std::mt19937& rng, bool zero = false) {
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<std::size_t>(H * S * D));
  for (auto& v : x) v = zero ? 0.0f : nd(rng);
  return vq::Tensor::from_f32({1, H, S, D}, x);
}

// Every chunk of sequence 0 of `cache`, behind the header byte its fuzz target expects, as valid_*,
// and a truncated and a bit-flipped copy of each.
template <class Cache>
void write_chunks(const std::filesystem::path& dir, const Cache& cache, std::uint8_t header, int& n) {
  for (std::int64_t c = 0; c < cache.chunks(); ++c) {
    std::vector<std::uint8_t> b{header};
    const auto chunk = cache.encode_chunk(0, c);
    b.insert(b.end(), chunk.begin(), chunk.end());
    write_seeds(dir, n++, b, b.size() * 2 / 3, b.size() / 2, 0x04);
  }
}

}  // namespace

// fuzz_store_blob: a chunk blob at each level of the target's identity, valid, cut and flipped.
void store_blob_seeds(const std::filesystem::path& root) {
  const auto dir = root / "fuzz_store_blob";
  const auto model = vq::ModelDescription::uniform(vqfuzz::kBlobLayers, vqfuzz::kBlobDim);
  const vq::LevelCaches fresh = [&](const std::string& level) { return vq::make_caches(vq::MethodSpec::parse(level), model); };
  std::mt19937 rng(36);
  std::normal_distribution<float> nd;
  vq::ChunkKV exact;
  const auto C = static_cast<std::int64_t>(vqfuzz::kBlobTokens.size());
  for (int l = 0; l < vqfuzz::kBlobLayers; ++l) {
    std::vector<float> k(static_cast<std::size_t>(vqfuzz::kBlobHeads * C * vqfuzz::kBlobDim)), v(k.size());
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    exact.push_back({vq::Tensor::from_f32({1, vqfuzz::kBlobHeads, C, vqfuzz::kBlobDim}, k),
                     vq::Tensor::from_f32({1, vqfuzz::kBlobHeads, C, vqfuzz::kBlobDim}, v)});
  }
  int n = 0;
  for (const auto& level : vqfuzz::kBlobLevels) {
    const auto b = vq::encode_chunk(fresh, vqfuzz::kBlobModel, vq::MethodSpec::parse(level).to_string(), vqfuzz::kBlobIndex,
                                    vqfuzz::kBlobChain, vqfuzz::kBlobTokens, exact);
    write_seeds(dir, n++, b, b.size() * 2 / 3, b.size() / 2, 0x08);
  }
  write(dir, "empty", {});
}

// vq profiles (fuzz_vq_profile): fitted on random K/V at three shapes (per-head blocks, whole-row
// blocks, RoPE on and off), each whole, cut, with a flipped axis value, and a forged shape.
void vq_profile_seeds(const std::filesystem::path& root) {
  const auto dir = root / "fuzz_vq_profile";
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  int n = 0;
  for (auto [layers, heads, dim, rope] : {std::tuple{1, 1, 4, true}, {2, 2, 8, false}, {1, 3, 128, true}}) {
    vq::VqProfileBuilder b(layers, heads, dim, rope, 10000.0);
    for (int l = 0; l < layers; ++l) {
      std::vector<float> k(static_cast<std::size_t>(heads * 40 * dim)), v(k.size());
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
      b.add(l, vq::Tensor::from_f32({1, heads, 40, dim}, k), vq::Tensor::from_f32({1, heads, 40, dim}, v), 3);
    }
    vq::VqProfile p = b.finish(0x1234u + static_cast<unsigned>(n));
    const auto bytes = vq::write_vq_profile(p);
    write_seeds(dir, n++, bytes, bytes.size() - 9, 64, 0x40);
  }
  std::vector<std::uint8_t> forged(64, 0);
  const char magic[8] = {'V', 'Q', 'P', 'R', 'O', 'F', 0, 0};
  std::copy_n(magic, 8, forged.begin());
  forged[8] = 1;                                // version 1
  forged[24] = forged[28] = forged[32] = 0xff;  // huge layers, heads, dim
  write(dir, "forged_shape", forged);
  write(dir, "empty", {});
}

int main(int argc, char** argv) {
  const std::filesystem::path root = argc > 1 ? argv[1] : "fuzz/corpus";
  // One target's seeds alone: vq_fuzz_make_corpus fuzz/corpus fuzz_store_blob
  if (argc > 2 && std::string(argv[2]) == "fuzz_store_blob") {
    store_blob_seeds(root);
    return 0;
  }
  if (argc > 2 && std::string(argv[2]) == "fuzz_vq_profile") {
    vq_profile_seeds(root);
    return 0;
  }
  const auto rd = root / "fuzz_rans_decode", ft = root / "fuzz_frequency_table";
  int k = 0;
  for (auto [alphabet, n, scale] : {std::tuple{16, 100, 12}, {16, 40, 11}, {2, 70, 4}, {256, 300, 14},
                                    {511, 64, 15}, {1, 50, 12}, {16, 0, 12}, {5, 33, 9}}) {
    const auto s = codes(alphabet, static_cast<std::size_t>(n), static_cast<unsigned>(k));
    auto b = vq::encode_block(s, alphabet, {.scale_bits = scale});
    const auto t = vq::FrequencyTable::from_symbols(s, alphabet, scale);
    write(ft, "valid_" + std::to_string(k), t.serialize());
    if (b.size() > 8)
      write_seeds(rd, k, b, b.size() / 2, b.size() - 3, 0x10);
    else
      write(rd, "valid_" + std::to_string(k), b);
    ++k;
  }
  // Context-coded blocks: 4 layout bytes (context_fuzz_layout.hpp), then the block.
  const auto cx = root / "fuzz_context_decode";
  int m = 0;
  for (std::array<std::uint8_t, 4> h : {std::array<std::uint8_t, 4>{0, 40, 7, 3 | (7 << 2)}, {2, 63, 39, 1 | (31 << 2)}, {1, 20, 3, 0},
                                        {0, 0, 5, 3}, {0, 1, 1, 2}, {1, 33, 16, 3 | (3 << 2)},
                                        // 32, 2 x 16 and 3 x 32 channels: the AVX2 kernels, with pair rows
                                        // (even groups), single rows (odd groups) and the bits-back tail
                                        {0, 60, 31, 3 | (7 << 2)}, {1, 50, 15, 3 | (31 << 2)}, {2, 63, 31, 3 | (8 << 2)},
                                        {2, 61, 31, 2 | (15 << 2)}, {0, 63, 31, 0 | (31 << 2)}}) {
    const vq::ContextLayout l = vqfuzz::context_layout(h);
    std::mt19937 g(static_cast<unsigned>(m));
    std::vector<std::uint8_t> q(l.size());
    int walk = 0;
    for (auto& v : q) {  // a clamped random walk: several classes survive the merge
      walk = std::clamp(walk + static_cast<int>(g() % 3) - 1, 0, (1 << l.bits) - 1);
      v = static_cast<std::uint8_t>(walk);
    }
    auto b = vq::context_encode(q, l);
    b.insert(b.begin(), h.begin(), h.end());
    if (b.size() > 10)
      write_seeds(cx, m, b, b.size() - 3, 6, 0x21);
    else
      write(cx, "valid_" + std::to_string(m), b);
    ++m;
  }
  // Order-1 context streams: 5 shape bytes (order1_fuzz_shape.hpp), then the coded bytes.
  const auto o1 = root / "fuzz_order1_decode";
  int p = 0;
  for (std::array<std::uint8_t, 5> h : {std::array<std::uint8_t, 5>{3, 1, 7, 40, 0}, {3, 1, 7, 40, 1}, {0, 0, 0, 1, 0}, {5, 3, 15, 63, 0},
                                        {1, 2, 3, 0, 1}, {2, 0, 15, 17, 1}}) {
    const auto c = vqfuzz::order1_case(h);
    std::mt19937 g(static_cast<unsigned>(p));
    std::vector<std::vector<std::uint8_t>> slices(c.shape.slices.size(), std::vector<std::uint8_t>(c.shape.tokens * c.shape.channels));
    vq::Order1Codes in = c.shape;
    for (std::size_t s = 0; s < slices.size(); ++s) {
      int walk = 0;
      for (auto& v : slices[s]) v = static_cast<std::uint8_t>(walk = std::clamp(walk + static_cast<int>(g() % 3) - 1, 0, (1 << c.shape.bits) - 1));
      in.slices[s] = slices[s];
    }
    auto b = vq::order1_encode(in, c.pooled);
    b.insert(b.begin(), h.begin(), h.end());
    if (b.size() > 10)
      write_seeds(o1, p, b, b.size() - 3, 6, 0x11);
    else
      write(o1, "valid_" + std::to_string(p), b);
    ++p;
  }
  write(o1, "short", {3, 1});
  write(rd, "empty", {});
  write(ft, "empty", {});
  write(ft, "bad_sum", {2, 2, 1, 2});
  write(ft, "bad_scale", {2, 16, 1, 2});
  write(ft, "zero_run_past_end", {2, 2, 4, 0, 1});
  // .vqkv files: small caches of each class, flush mode and dtype.
  const auto vk = root / "fuzz_vqkv_read";
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  int f = 0;
  for (auto [flush, dtype, tokens, chunk] : {std::tuple{vq::FlushMode::GroupAligned, vq::DType::F32, 21, 8}, {vq::FlushMode::PerCall, vq::DType::F16, 9, 4},
                                             {vq::FlushMode::GroupAligned, vq::DType::BF16, 7, 64}, {vq::FlushMode::GroupAligned, vq::DType::F16, 0, 8}}) {
    const vq::Shape4 shape{1, 2, tokens, 4};
    std::vector<float> x(static_cast<std::size_t>(2 * tokens * 4));
    for (auto& v : x) v = nd(rng);
    const auto t = vq::Tensor::from_f32(shape, x, dtype);
    vq::KVCacheConfig cfg;
    cfg.cachegen_group_size = 4;
    cfg.cachegen_bits = 3;
    cfg.cachegen_flush = flush;
    std::vector<std::shared_ptr<vq::KVCache>> caches = {std::make_shared<vq::CacheGenKVCache>(cfg), std::make_shared<vq::KVCache>()};
    if (tokens > 0)
      for (auto& c : caches) c->update_and_fetch(t, t);
    const auto b = vq::serialize_prompt_cache(caches, {{"i", std::to_string(f)}}, {.chunk_tokens = chunk});
    write_seeds(vk, f++, b, b.size() * 2 / 3);
    if (tokens > 8) {  // the same caches with per-channel tables (version 2, transform 0)
      const auto c = vq::serialize_prompt_cache(caches, {{"i", std::to_string(f)}}, {.chunk_tokens = chunk, .transform = vq::SymbolTransform::Codes});
      write_seeds(vk, f++, c, c.size() * 2 / 3);
    }
  }
  {  // 4-bit context coding of 32 channels a side: the AVX2 kernels behind the container
    const auto t = normal(8, 80, 4, rng);
    std::vector<std::shared_ptr<vq::KVCache>> caches = {std::make_shared<vq::CacheGenKVCache>()};
    caches[0]->update_and_fetch(t, t);
    const auto b = vq::serialize_prompt_cache(caches, {}, {.chunk_tokens = 64});
    write_seeds(vk, f++, b, b.size() / 2);
  }
  // Headers that claim more than the file holds (issue 13): 2^32 tokens in chunks of 1 with empty
  // layers, or held by layers whose blocks are not there (a reader once walked every chunk of them
  // for tens of seconds); and a valid file in chunks of 1 token whose CacheGen groups start in few
  // of its chunks. Each must be refused or read in time proportional to its size.
  constexpr std::uint64_t kHuge = std::uint64_t{1} << 32;
  write(vk, "huge_tokens_empty_layers", vqtest::crafted_file({.tokens = kHuge, .chunk = 1, .layers = 4}));
  write(vk, "huge_tokens_plain_layer", vqtest::crafted_file({.tokens = kHuge, .chunk = 1, .layers = 2, .cls = 0, .offset = kHuge}));
  write(vk, "huge_tokens_no_closed_tokens", vqtest::crafted_file({.tokens = kHuge, .chunk = 1, .layers = 1, .cls = 1, .offset = kHuge}));
  write(vk, "huge_tokens_16_cachegen_layers",
        vqtest::crafted_file({.tokens = kHuge, .chunk = 1, .layers = 16, .cls = 1, .offset = kHuge, .group = 4096}));
  write(vk, "small_tokens_no_closed_tokens", vqtest::crafted_file({.tokens = 3, .chunk = 1, .layers = 1, .cls = 1, .offset = 3}));
  {
    vq::KVCacheConfig cfg;
    cfg.cachegen_group_size = 32;
    cfg.cachegen_flush = vq::FlushMode::PerCall;
    std::vector<std::shared_ptr<vq::KVCache>> caches = {std::make_shared<vq::CacheGenKVCache>(cfg), std::make_shared<vq::CacheGenKVCache>(cfg)};
    const auto t = normal(1, 70, 2, rng);
    for (auto& c : caches) c->update_and_fetch(t, t);
    write(vk, "sparse_groups_chunks_of_1", vq::serialize_prompt_cache(caches, {}, {.chunk_tokens = 1}));
  }
  {  // vq layers without a model (identity transforms): exact window, B > 1 in float16, split codes.
     // Its own generator, so the seeds after it stay as they were. (vq_valid_3, a layer built from
     // stories260K that loads only with the model, came from the CLI: docs/format.md.)
    std::mt19937 vrng(15);
    int i = 0;
    for (auto [b, tokens, bits, calib, residual, chunk, dtype] : {std::tuple{1, 30, 2.0, 8, 3, 10, vq::DType::F32},
                                                                  {2, 21, 6.0, 5, 0, 8, vq::DType::F16},
                                                                  {1, 12, 9.5, 4, 2, 64, vq::DType::BF16}}) {
      vq::VqConfig cfg;
      cfg.bits = bits;
      cfg.calib = calib;
      cfg.residual = residual;
      auto c = std::make_shared<vq::VqKVCache>(cfg);
      std::vector<float> x(static_cast<std::size_t>(b * 2 * tokens * 4));
      for (auto& v : x) v = nd(vrng);
      const auto t = vq::Tensor::from_f32({b, 2, tokens, 4}, x, dtype);
      for (int s = 0; s < tokens; s += 7) c->update_and_fetch(t.slice(2, s, std::min(tokens, s + 7)), t.slice(2, s, std::min(tokens, s + 7)));
      const auto bytes = vq::serialize_prompt_cache({c}, {}, {.chunk_tokens = chunk});
      write(vk, "vq_gen_valid_" + std::to_string(i), bytes);
      write(vk, "vq_gen_truncated_" + std::to_string(i), {bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(bytes.size() / 2)});
      ++i;
    }
  }
  // LMCache chunks (fuzz_lmcache_chunk): header byte = the shape (K channels - 1, V channels - 1 << 3,
  // 16 key bins << 6, 16 value bins << 7); K [1, 2, S, 4], V [1, 2, S, 2], chunk 16, 21 tokens
  // (a whole and a partial chunk), at layers of a 32-layer model with each bins pair.
  const auto lm = root / "fuzz_lmcache_chunk";
  std::mt19937 lrng(7);
  int n = 0;
  for (auto [layer, zero] : {std::pair{0, false}, {5, false}, {20, false}, {20, true}}) {
    vq::LmcacheKVCache cache({.chunk = 16}, layer, 32);
    cache.update_and_fetch(normal(2, 21, 4, lrng, zero), normal(2, 21, 2, lrng, zero));
    const auto header = static_cast<std::uint8_t>(7 | 3 << 3 | (cache.bins().key == 16) << 6 | (cache.bins().value == 16) << 7);
    write_chunks(lm, cache, header, n);
  }
  write(lm, "empty", {});
  write(lm, "zero_tokens", {0x1f, 0});
  // cachegen_paper chunks (fuzz_cachegen_paper_chunk): header byte = the layer of the fuzz profile;
  // chunk 16 (4 groups), 21 tokens.
  const auto cg = root / "fuzz_cachegen_paper_chunk";
  const auto profile = std::make_shared<const vq::CachegenPaperProfile>(vqfuzz::cachegen_fuzz_profile());
  vq::CachegenPaperConfig cfg_cg;
  cfg_cg.group = vqfuzz::kCachegenFuzzGroup;
  cfg_cg.chunk = 16;
  std::mt19937 crng(8);
  n = 0;
  for (int layer = 0; layer < 3; ++layer) {
    const std::int64_t ck = vqfuzz::kCachegenFuzzChannels[layer][0], cv = vqfuzz::kCachegenFuzzChannels[layer][1];
    const std::int64_t H = layer == 0 ? 4 : 1;
    vq::CachegenPaperKVCache cache(cfg_cg, layer, 3, profile);
    cache.update_and_fetch(normal(H, 21, ck / H, crng), normal(H, 21, cv / H, crng));
    write_chunks(cg, cache, static_cast<std::uint8_t>(layer), n);
  }
  write(cg, "empty", {});
  // cachegen_paper profiles (fuzz_cachegen_paper_profile): the fuzz profile, a one-layer one, cuts.
  const auto pf = root / "fuzz_cachegen_paper_profile";
  vq::CachegenPaperProfile one;
  one.layers.resize(1);
  for (int kv = 0; kv < 2; ++kv) {
    auto& t = one.layers[0][kv];
    t.channels = 1;
    t.delta_max_q = 2;  // bin 0.5
    t.anchor_counts.assign(1, std::vector<std::uint32_t>(vq::kCachegenAnchorAlphabet));
    t.anchor_counts[0][127] = 300;
    t.anchor_counts[0][130] = 5;
    t.delta_counts.assign(1, std::vector<std::uint32_t>{1, 20, 200, 20, 1});
  }
  one.tokens = 12;
  n = 0;
  for (const auto& p : {profile->serialize(), one.serialize()}) {
    write_seeds(pf, n++, p, p.size() - 1);
  }
  auto bad_magic = one.serialize();
  bad_magic[7] = '2';
  write(pf, "bad_magic", bad_magic);
  write(pf, "empty", {});
  // vq layers (fuzz_vq_layer): caches of our method at low and high rates (the high one splits
  // codes), with and without an exact window, one of batch 2, and one of 64 tokens x 64
  // coefficients whose stream is long enough for the AVX2 lane groups; a cut and a flipped copy of
  // each. (v1_*: the same first four as version 1 streams, kept from before version 2; v2_*: all five
  // as version 2 streams, kept from before version 3; v3_*: all five as version 3 streams, kept from
  // before version 4; v4_*: all five as version 4 streams, kept from before version 5.) Then a
  // sixth that version 5's prediction reaches: 48 tokens x 32 coefficients that drift along tokens
  // (a random walk per coefficient), every fifth token a repeat of the token three before (row copies).
  // (v6_wide_*: a version 6 stream of 64 lanes, 2048 tokens x (64 + 64) drifting codes = 2^18
  // symbols, valid, cut at 2/3 and with one bit flipped; written once by a one-off program with
  // vq_encode, not by this tool.)
  const auto vl = root / "fuzz_vq_layer";
  std::mt19937 vrng(9);
  n = 0;
  for (auto [bits, batch, residual, tokens, dim] :
       {std::tuple{2.0, 1, 0, 20, 4}, {8.0, 1, 0, 20, 4}, {1.0, 2, 3, 20, 4}, {4.0, 1, 30, 20, 4}, {2.0, 1, 0, 64, 32}}) {
    vq::VqConfig vcfg;
    vcfg.bits = bits;
    vcfg.calib = 8;
    vcfg.residual = residual;
    vq::VqKVCache cache(vcfg);
    std::vector<float> x(static_cast<std::size_t>(batch * 2 * tokens * dim));
    std::normal_distribution<float> nd;
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = nd(vrng) * (i % 4 == 3 ? 500.0f : 1.0f);
    const auto t = vq::Tensor::from_f32({batch, 2, tokens, dim}, x);
    cache.update_and_fetch(t, t);
    const auto b = cache.encode();
    write_seeds(vl, n++, b, b.size() * 2 / 3, b.size() / 2, 0x08);
  }
  {
    vq::VqConfig vcfg;
    vcfg.bits = 3.0;
    vcfg.calib = 8;
    vq::VqKVCache cache(vcfg);
    const int tokens = 48, dim = 16;
    std::vector<float> x(static_cast<std::size_t>(2 * tokens * dim));
    std::normal_distribution<float> nd;
    std::mt19937 drng(16);  // its own generator, so the seeds after it stay as they were
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < dim; ++d) {
        float w = 0.0f;
        for (int t = 0; t < tokens; ++t) {
          w += nd(drng);
          const int src = t % 5 == 4 ? t - 3 : t;
          x[static_cast<std::size_t>((h * tokens + t) * dim + d)] = src == t ? w : x[static_cast<std::size_t>((h * tokens + src) * dim + d)];
        }
      }
    const auto t = vq::Tensor::from_f32({1, 2, tokens, dim}, x);
    cache.update_and_fetch(t, t);
    const auto b = cache.encode();
    write_seeds(vl, n++, b, b.size() * 2 / 3, b.size() / 2, 0x08);
  }
  write(vl, "empty", {});
  // llama.cpp states (fuzz_llama_state): the two model shapes the target reads against, F32/F16/BF16,
  // V per cell and transposed, one stream and three (cells in the middle one); a cut and a flipped
  // copy of each (the flip lands in the cell metadata).
  const auto ls = root / "fuzz_llama_state";
  n = 0;
  for (auto [layers, heads, dim, cells, dtype, v_trans, streams] :
       {std::tuple{5, 4, 8, 3, vq::DType::F16, true, 1u}, {5, 4, 8, 2, vq::DType::F16, false, 1u}, {2, 1, 4, 4, vq::DType::F32, true, 3u},
        {2, 1, 4, 3, vq::DType::BF16, false, 1u}}) {
    vq::LlamaState st;
    st.tokens = {1, 301, 427};
    st.dtype = dtype;
    st.v_trans = v_trans;
    st.n_stream = streams;
    st.stream = streams / 2;
    std::normal_distribution<float> nd;
    for (int l = 0; l < layers; ++l) {
      std::vector<float> x(static_cast<std::size_t>(2 * heads * cells * dim));
      for (auto& v : x) v = nd(vrng);
      st.layers.push_back({vq::Tensor::from_f32({1, heads, cells, dim}, std::span<const float>(x).first(x.size() / 2), dtype),
                           vq::Tensor::from_f32({1, heads, cells, dim}, std::span<const float>(x).last(x.size() / 2), dtype)});
    }
    const auto b = vq::write_llama_state(st);
    write_seeds(ls, n++, b, b.size() * 2 / 3, 12 + 12 + 4 * streams + 4, 0x01);
  }
  {  // a llama-server slot file: its token list packed (marker, version, count, ids, media count)
    vq::LlamaState st;
    st.tokens = {1, 301, 427};
    st.server_tokens = true;
    st.dtype = vq::DType::F16;
    st.v_trans = true;
    std::normal_distribution<float> nd;
    for (int l = 0; l < 5; ++l) {
      std::vector<float> x(2 * 4 * 3 * 8);
      for (auto& v : x) v = nd(vrng);
      st.layers.push_back({vq::Tensor::from_f32({1, 4, 3, 8}, std::span<const float>(x).first(x.size() / 2), vq::DType::F16),
                           vq::Tensor::from_f32({1, 4, 3, 8}, std::span<const float>(x).last(x.size() / 2), vq::DType::F16)});
    }
    const auto b = vq::write_llama_state(st);
    write_seeds(ls, n++, b, b.size() * 2 / 3, 12 + 8, 0x01);  // the flip lands in the packing's count
  }
  write(ls, "empty", {});
  store_blob_seeds(root);
  vq_profile_seeds(root);
  std::printf("corpus written under %s\n", root.c_str());
  // Chained vq layers (fuzz_vq_chain): records of a first and a second layer, 1 sequence x 40
  // tokens of 2 KV heads of 4 under the identity, at 2 and 6 bits (predictors fitted on the same
  // kind of data the target fits its own on); a cut and a flipped copy of each; a first layer's
  // record before calibration (no rows); a plain vq layer (no record tag).
  {
    const auto vc = root / "fuzz_vq_chain";
    auto layer = std::make_shared<vq::VqLayerModel>(vq::make_vq_identity_layer(2, 4));
    std::mt19937 crng(11);
    std::normal_distribution<float> nd;
    std::vector<std::vector<vq::KVState>> samples;
    for (int s = 0; s < 2; ++s) {
      std::vector<vq::KVState> layers;
      std::vector<float> prev(8 * 40);
      for (int l = 0; l < 2; ++l) {
        std::vector<float> k(8 * 40), v(8 * 40);
        for (std::size_t i = 0; i < k.size(); ++i) k[i] = nd(crng) + (l > 0 ? 0.5f * prev[i] : 0.0f), v[i] = 0.7f * k[i] + 0.3f * nd(crng);
        std::copy(k.begin(), k.end(), prev.begin());
        layers.push_back({vq::Tensor::from_f32({1, 2, 40, 4}, k), vq::Tensor::from_f32({1, 2, 40, 4}, v)});
      }
      samples.push_back(std::move(layers));
    }
    const auto pred = vq::fit_vq_chain(samples, {layer, layer});
    int i = 0;
    for (double bits : {2.0, 6.0}) {
      vq::VqConfig cfg;
      cfg.bits = bits;
      cfg.calib = 8;
      auto c0 = std::make_shared<vq::VqChainKVCache>(cfg, layer, std::make_shared<vq::VqChainPredictor>(pred[0]), nullptr);
      auto c1 = std::make_shared<vq::VqChainKVCache>(cfg, layer, std::make_shared<vq::VqChainPredictor>(pred[1]), c0);
      c0->update(samples[1][0].keys, samples[1][0].values);
      c1->update(samples[1][1].keys, samples[1][1].values);
      for (const auto& b : {c0->encode(), c1->encode()}) {
        write_seeds(vc, i, b, b.size() / 2, b.size() - 3, 0x20);
        ++i;
      }
    }
    vq::VqConfig cfg;
    cfg.calib = 64;
    vq::VqChainKVCache early(cfg, layer, std::make_shared<vq::VqChainPredictor>(pred[0]), nullptr);
    early.update(samples[0][0].keys, samples[0][0].values);
    write(vc, "uncalibrated", early.encode());
    vq::VqKVCache plain(cfg);
    plain.update(samples[0][0].keys, samples[0][0].values);
    write(vc, "plain_vq_layer", plain.encode());
  }
  return 0;
}
