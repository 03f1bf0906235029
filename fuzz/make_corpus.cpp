// Writes the seed corpus: valid blocks and tables of several shapes, and a few broken ones.
//   vq_fuzz_make_corpus fuzz/corpus   (run from the repository root; files are committed)
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "veloxquant/format/vqkv.hpp"

namespace {

void write(const std::filesystem::path& dir, const std::string& name, const std::vector<std::uint8_t>& b) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

std::vector<std::uint16_t> codes(int alphabet, std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::geometric_distribution<int> g(0.35);
  std::vector<std::uint16_t> s(n);
  for (auto& v : s) v = static_cast<std::uint16_t>(std::min(g(rng), alphabet - 1));
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path root = argc > 1 ? argv[1] : "fuzz/corpus";
  const auto rd = root / "fuzz_rans_decode", ft = root / "fuzz_frequency_table";
  int k = 0;
  for (auto [alphabet, n, scale] : {std::tuple{16, 100, 12}, {16, 40, 11}, {2, 70, 4}, {256, 300, 14},
                                    {511, 64, 15}, {1, 50, 12}, {16, 0, 12}, {5, 33, 9}}) {
    const auto s = codes(alphabet, static_cast<std::size_t>(n), static_cast<unsigned>(k));
    auto b = vq::encode_block(s, alphabet, {.scale_bits = scale});
    write(rd, "valid_" + std::to_string(k), b);
    const auto t = vq::FrequencyTable::from_symbols(s, alphabet, scale);
    write(ft, "valid_" + std::to_string(k), t.serialize());
    if (b.size() > 8) {
      auto cut = b;
      cut.resize(b.size() / 2);
      write(rd, "truncated_" + std::to_string(k), cut);
      auto flip = b;
      flip[b.size() - 3] ^= 0x10;
      write(rd, "flipped_" + std::to_string(k), flip);
    }
    ++k;
  }
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
    write(vk, "valid_" + std::to_string(f), b);
    auto cut = b;
    cut.resize(b.size() * 2 / 3);
    write(vk, "truncated_" + std::to_string(f), cut);
    ++f;
  }
  std::printf("corpus written under %s\n", root.c_str());
  return 0;
}
