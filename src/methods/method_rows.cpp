// The rows of the baselines (fp32, fp16), the reference's CacheGen and the peers. Their stories and
// what each bills: docs/methods.md.
#include "method_rows.hpp"

#include "veloxquant/cache/builder.hpp"
#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/cache/fp16_cache.hpp"
#include "veloxquant/model/cachegen_profile.hpp"
#include "veloxquant/peers/cachegen_paper_cache.hpp"
#include "veloxquant/peers/fp8_cache.hpp"
#include "veloxquant/peers/ggml_block_cache.hpp"

namespace vq::detail {

namespace {

template <class Cache>
LayerCaches plain_caches(const MethodSpec&, const ModelDescription& model, const Transformer*) {
  return per_attention_layer(model, [](int, int) { return std::make_shared<Cache>(); });
}

// --- cachegen: the reference ---

void set_cachegen(MethodSpec& m, const std::string& key, const std::string& value, const std::string& spec) {
  if (key == "bits") {
    m.cachegen.cachegen_bits = parse_int(key, value, spec);
  } else if (key == "group") {
    m.cachegen.cachegen_group_size = parse_int(key, value, spec);
  } else if (key == "flush") {
    if (value != "per_call" && value != "group_aligned")
      throw InvalidArgument(fmt::format("method '{}': flush={} is not valid; use flush=per_call or flush=group_aligned", spec, value));
    m.cachegen.cachegen_flush = flush_mode_from_name(value);
  } else if (key == "delta") {
    m.cachegen.cachegen_use_delta = parse_bool(key, value, spec, "1", "0");
  } else {
    m.schedule = parse_bool(key, value, spec, "on", "off");
  }
}

std::string cachegen_text(const MethodSpec& m) {
  return fmt::format("cachegen:bits={},group={},flush={},delta={},schedule={}", m.cachegen.cachegen_bits, m.cachegen.cachegen_group_size,
                     flush_mode_name(m.cachegen.cachegen_flush), m.cachegen.cachegen_use_delta ? 1 : 0, m.schedule ? "on" : "off");
}

LayerCaches cachegen_caches(const MethodSpec& m, const ModelDescription& model, const Transformer*) {
  if (m.schedule) return KVCacheBuilder::for_model(model, m.cachegen);
  KVCacheConfig cfg = m.cachegen;
  cfg.cachegen_resolved_bits = cfg.cachegen_bits;
  return per_attention_layer(model, [&](int, int) { return std::make_shared<CacheGenKVCache>(cfg); });
}

// --- llama.cpp's blocks ---

void set_rotate(MethodSpec& m, const std::string& key, const std::string& value, const std::string& spec) {
  m.rotate = parse_bool(key, value, spec, "1", "0");
}

template <class Cache>
LayerCaches block_caches(const MethodSpec& m, const ModelDescription& model, const Transformer*) {
  return per_attention_layer(model, [&](int, int) { return std::make_shared<Cache>(m.rotate); });
}

template <MethodSpec::Kind K>
MethodRow block_row(const char* name, const char* cache, const char* summary, std::string canonical(const MethodSpec&),
                    LayerCaches make(const MethodSpec&, const ModelDescription&, const Transformer*), std::vector<MethodSetting> demo,
                    std::vector<std::string> bench) {
  return {.kind = K,
          .name = name,
          .family = MethodFamily::Peer,
          .summary = summary,
          .cache = cache,
          .keys = {{"rotate", "0", "0|1",
                    "1: each head's K/V row rotated by a fixed signed Hadamard transform before block quantization (llama.cpp PR #21038)"}},
          .set = set_rotate,
          .validate = nullptr,
          .canonical = canonical,
          .make = make,
          .rd = {name},
          .demo = std::move(demo),
          .bench_attention = std::move(bench)};
}

template <MethodSpec::Kind K>
std::string block_text(const MethodSpec& m) {
  static const std::string name = K == MethodSpec::Kind::Q8_0 ? "q8_0" : K == MethodSpec::Kind::Q4_0 ? "q4_0" : "q4_1";
  return m.rotate ? name + ":rotate=1" : name;
}

// --- kivi, lmcache, cachegen_paper ---

void set_kivi(MethodSpec& m, const std::string& key, const std::string& value, const std::string& spec) {
  (key == "bits" ? m.kivi.bits : key == "group" ? m.kivi.group : m.kivi.residual) = parse_int(key, value, spec);
}

void set_lmcache(MethodSpec& m, const std::string& key, const std::string& value, const std::string& spec) {
  if (key == "chunk")
    m.lmcache.chunk = parse_int(key, value, spec);
  else
    m.lmcache.scaled = parse_bool(key, value, spec, "scaled", "native");
}

void set_cachegen_paper(MethodSpec& m, const std::string& key, const std::string& value, const std::string& spec) {
  auto& c = m.cachegen_paper;
  if (key == "bin1" || key == "bin2" || key == "bin3")
    c.bins[static_cast<std::size_t>(key[3] - '1')] = parse_double(key, value, spec);
  else if (key == "group")
    c.group = parse_int(key, value, spec);
  else if (key == "chunk")
    c.chunk = parse_int(key, value, spec);
  else if (key == "profile_tokens")
    c.profile_tokens = parse_int(key, value, spec);
  else if (value.empty())
    throw InvalidArgument(fmt::format("method '{}': profile= needs a path (a file written by `veloxquant profile`)", spec));
  else
    c.profile = value;
}

std::string cachegen_paper_text(const MethodSpec& m) {
  const auto& c = m.cachegen_paper;
  return fmt::format("cachegen_paper:bin1={},bin2={},bin3={},group={},chunk={},{}", c.bins[0], c.bins[1], c.bins[2], c.group, c.chunk,
                     c.profile.empty() ? fmt::format("profile_tokens={}", c.profile_tokens) : "profile=" + c.profile);
}

LayerCaches cachegen_paper_caches(const MethodSpec& m, const ModelDescription& model, const Transformer* weights) {
  int n_attention = 0;
  for (const auto& d : model.layer_head_dims) n_attention += d.has_value();
  std::shared_ptr<const CachegenPaperProfile> profile;
  if (n_attention > 0) profile = cachegen_paper_profile_for(m.cachegen_paper, weights, n_attention);
  return per_attention_layer(
      model, [&](int layer, int n) { return std::make_shared<CachegenPaperKVCache>(m.cachegen_paper, layer, n, profile); });
}

}  // namespace

std::vector<MethodRow> baseline_rows() {
  return {{.kind = MethodSpec::Kind::Fp32,
           .name = "fp32",
           .family = MethodFamily::Baseline,
           .summary = "the exact cache: K/V as given, float32",
           .cache = "KVCache (cache/kv_cache.hpp)",
           .canonical = [](const MethodSpec&) { return std::string("fp32"); },
           .make = plain_caches<KVCache>,
           .saves_vqkv = true,
           .eval = {"fp32"}},
          {.kind = MethodSpec::Kind::Fp16,
           .name = "fp16",
           .family = MethodFamily::Baseline,
           .summary = "K/V rounded to float16 (half to even): what an fp16 KV cache holds, billed 2 bytes per element",
           .cache = "Fp16KVCache (cache/fp16_cache.hpp)",
           .canonical = [](const MethodSpec&) { return std::string("fp16"); },
           .make = plain_caches<Fp16KVCache>,
           .eval = {"fp16"},
           .rd = {"fp16"},
           .demo = {{"fp16", "baseline"}}}};
}

std::vector<MethodRow> reference_rows() {
  return {{.kind = MethodSpec::Kind::CacheGen,
           .name = "cachegen",
           .family = MethodFamily::Reference,
           .summary = "the reference's CacheGen (VeloxQuant-MLX): grouped quantization, token deltas; here with real rANS streams",
           .cache = "CacheGenKVCache (cache/cachegen_cache.hpp), KVCacheBuilder (cache/builder.hpp)",
           .keys = {{"bits", "4", "N", "base bit width, 1..8"},
                    {"group", "32", "G", "tokens per quantization group, >= 1"},
                    {"flush", "group_aligned", "per_call|group_aligned", "per_call: every call quantizes what it holds (the reference)"},
                    {"delta", "1", "0|1", "entropy of token deltas (1) or of raw codes (0)"},
                    {"schedule", "on", "on|off",
                     "on: CacheGen's layer-wise bits (KVCacheBuilder::for_model, base = bits); off: every layer at exactly bits"}},
           .set = set_cachegen,
           .validate = [](const MethodSpec& m) { m.cachegen.validate(); },
           .canonical = cachegen_text,
           .make = cachegen_caches,
           .saves_vqkv = true,
           .eval = {"cachegen:bits=4", "cachegen:bits=3", "cachegen:bits=2", "cachegen:bits=4,schedule=off", "cachegen:bits=4,flush=per_call"},
           .rd = {"cachegen:bits=2", "cachegen:bits=3", "cachegen:bits=4", "cachegen:bits=5", "cachegen:bits=2,schedule=off",
                  "cachegen:bits=3,schedule=off", "cachegen:bits=4,schedule=off", "cachegen:bits=5,schedule=off",
                  "cachegen:bits=2,flush=per_call", "cachegen:bits=3,flush=per_call", "cachegen:bits=4,flush=per_call",
                  "cachegen:bits=5,flush=per_call"},
           .demo = {{"cachegen:flush=per_call", "reference CacheGen, as it runs"},
                    {"cachegen:bits=4,schedule=off,flush=per_call", "reference CacheGen, best setting"}}}};
}

std::vector<MethodRow> peer_rows() {
  using K = MethodSpec::Kind;
  MethodRow kivi{
      .kind = K::Kivi,
      .name = "kivi",
      .family = MethodFamily::Peer,
      .summary = "KIVI (ICML'24): keys per channel, values per token, asymmetric; a full-precision residual window",
      .cache = "KiviKVCache (peers/kivi_cache.hpp)",
      .keys = {{"bits", "2", "2|4", "code width of keys and values"},
               {"group", "32", "G", "tokens per key group, channels per value group, >= 1"},
               {"residual", "128", "R", "full-precision window, a positive multiple of group"}},
      .set = set_kivi,
      .validate = [](const MethodSpec& m) { m.kivi.validate(); },
      .canonical = [](const MethodSpec& m) { return fmt::format("kivi:bits={},group={},residual={}", m.kivi.bits, m.kivi.group, m.kivi.residual); },
      .make =
          [](const MethodSpec& m, const ModelDescription& model, const Transformer*) {
            return per_attention_layer(model, [&](int, int) { return std::make_shared<KiviKVCache>(m.kivi); });
          },
      .rd = {"kivi:bits=2", "kivi:bits=4"},
      .demo = {{"kivi:bits=4", "peer"}, {"kivi:bits=2", "peer"}}};
  MethodRow q8 = block_row<K::Q8_0>("q8_0", "Q8_0KVCache (peers/ggml_block_cache.hpp)", "llama.cpp's q8_0 blocks: 32 values, one float16 scale, int8 codes", block_text<K::Q8_0>,
                                    block_caches<Q8_0KVCache>, {{"q8_0", "peer (llama.cpp)"}}, {"q8_0", "q8_0:rotate=1"});
  MethodRow q40 = block_row<K::Q4_0>("q4_0", "Q4_0KVCache (peers/ggml_block_cache.hpp)", "llama.cpp's q4_0 blocks: 32 values, one float16 scale, 4-bit codes", block_text<K::Q4_0>,
                                     block_caches<Q4_0KVCache>, {{"q4_0", "peer (llama.cpp)"}}, {"q4_0", "q4_0:rotate=1"});
  MethodRow q41 = block_row<K::Q4_1>("q4_1", "Q4_1KVCache (peers/ggml_block_cache.hpp)", "llama.cpp's q4_1 blocks: 32 values, float16 scale and minimum, 4-bit codes",
                                     block_text<K::Q4_1>, block_caches<Q4_1KVCache>, {}, {"q4_1"});
  MethodRow fp8{.kind = K::Fp8,
                .name = "fp8",
                .family = MethodFamily::Peer,
                .summary = "float8 e4m3 with a per-head scale per call",
                .cache = "Fp8KVCache (peers/fp8_cache.hpp)",
                .canonical = [](const MethodSpec&) { return std::string("fp8"); },
                .make = plain_caches<Fp8KVCache>,
                .rd = {"fp8"},
                .demo = {{"fp8", "peer"}},
                .bench_attention = {"fp8"}};
  MethodRow lmcache{
      .kind = K::Lmcache,
      .name = "lmcache",
      .family = MethodFamily::Peer,
      .summary = "LMCache's CacheGen codec: per-chunk tables shipped with the chunk",
      .cache = "LmcacheKVCache (peers/lmcache_cache.hpp)",
      .keys = {{"chunk", "256", "N", "tokens per chunk (per-chunk tables shipped with it), 1..65536"},
               {"schedule", "scaled", "scaled|native", "bins boundaries scaled to depth, or LMCache's own rule"}},
      .set = set_lmcache,
      .validate = [](const MethodSpec& m) { m.lmcache.validate(); },
      .canonical =
          [](const MethodSpec& m) { return fmt::format("lmcache:chunk={},schedule={}", m.lmcache.chunk, m.lmcache.scaled ? "scaled" : "native"); },
      .make =
          [](const MethodSpec& m, const ModelDescription& model, const Transformer*) {
            return per_attention_layer(model, [&](int layer, int n) { return std::make_shared<LmcacheKVCache>(m.lmcache, layer, n); });
          },
      .rd = {"lmcache", "lmcache:schedule=native"}};
  MethodRow paper{
      .kind = K::CachegenPaper,
      .name = "cachegen_paper",
      .family = MethodFamily::Peer,
      .summary = "the SIGCOMM'24 CacheGen paper's codec: anchors, binned deltas, profiled per-channel tables",
      .cache = "CachegenPaperKVCache (peers/cachegen_paper_cache.hpp)",
      .keys = {{"bin1", "0.5", "B", "delta bin size of the first third of layers (units of the delta's absmax), in [0.01, 2)"},
               {"bin2", "1", "B", "delta bin size of the middle third, in [0.01, 2)"},
               {"bin3", "1.5", "B", "delta bin size of the last third, in [0.01, 2)"},
               {"group", "10", "G", "tokens per group (one 8-bit anchor), 1..1024"},
               {"chunk", "1500", "N", "tokens per independently coded chunk, a multiple of group, at most 2^20"},
               {"profile", "", "PATH", "tables from `veloxquant profile`; without it, profiled on the fly from the model"},
               {"profile_tokens", "4096", "N", "tokens the on-the-fly profile samples from the model"}},
      .set = set_cachegen_paper,
      .validate = [](const MethodSpec& m) { m.cachegen_paper.validate(); },
      .canonical = cachegen_paper_text,
      .make = cachegen_paper_caches,
      .rd = {"cachegen_paper:bin1=0.0625,bin2=0.125,bin3=0.1875", "cachegen_paper:bin1=0.125,bin2=0.25,bin3=0.375", "cachegen_paper"}};
  return {kivi, q8, q40, q41, fp8, lmcache, paper};
}

}  // namespace vq::detail
