// Prefix chunks (store/prefix_chunks.hpp): chained keys, one .vqkv blob per chunk and level, and a
// directory blob per chunk.
#include "veloxquant/store/prefix_chunks.hpp"

#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include <fmt/core.h>
#include <nlohmann/json.hpp>
#include <zstd.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/vq_layer_models.hpp"
#include "veloxquant/cache/fp16_cache.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/sealed_store.hpp"
#include "veloxquant/vq/profile.hpp"
#include "veloxquant/vq/vq_cache.hpp"
#include "veloxquant/vq/vq_reconstruct_at.hpp"

namespace vq {

namespace {
constexpr const char* kMetaModel = "vqkv.store.model";
constexpr const char* kMetaLevel = "vqkv.store.level";
constexpr const char* kMetaIndex = "vqkv.store.chunk";
constexpr const char* kMetaTokens = "vqkv.store.tokens";
constexpr const char* kMetaChain = "vqkv.store.chain";  // the chunk's key hash: its whole prefix
constexpr const char* kMetaFirst = "vqkv.store.first_position";  // live-coded vq chunks only

std::string hex16(std::uint64_t v) { return fmt::format("{:016x}", v); }

std::string tokens_text(std::span<const int> tokens) {
  std::string s;
  for (std::size_t i = 0; i < tokens.size(); ++i) s += fmt::format("{}{}", i ? "," : "", tokens[i]);
  return s;
}

void hash_floats(XXH64_state_t* st, const std::vector<float>& v) {
  const std::uint64_t n = v.size();
  XXH64_update(st, &n, sizeof n);
  XXH64_update(st, v.data(), v.size() * sizeof(float));
}

// Fresh (empty) caches of a level for one chunk. A vq level's caches are rebuilt around the layer
// models of `templates` (make_caches of that level, made once per put): building a layer model
// (an eigen-decomposition per head) costs seconds at head_dim 128, far more than coding a chunk.
// The same config and layer model make the same cache as make_caches would, bit for bit.
std::vector<std::shared_ptr<KVCache>> fresh_caches(const std::string& level, const Transformer& model,
                                                   const std::vector<std::shared_ptr<KVCache>>* templates) {
  if (!templates) return make_caches(level, model);
  std::vector<std::shared_ptr<KVCache>> out;
  for (const auto& t : *templates) {
    const auto* v = dynamic_cast<const VqKVCache*>(t.get());
    if (!v || v->offset() != 0) return make_caches(level, model);  // other classes are cheap to make
    std::shared_ptr<const VqLayerModel> layer;
    if (!v->model_from_data() && v->layer_model()) layer = std::shared_ptr<const VqLayerModel>(t, v->layer_model());  // owned by `t`
    out.push_back(std::make_shared<VqKVCache>(v->config(), layer));
  }
  return out;
}
// The blob of one chunk's caches (one per layer) with the metadata decode_chunk checks.
Blob chunk_blob(const std::vector<std::shared_ptr<KVCache>>& caches, std::uint64_t fingerprint, const std::string& level, int index,
                std::uint64_t chain, std::span<const int> tokens, std::optional<std::int64_t> first_position = std::nullopt) {
  PromptMetadata meta{{kMetaModel, hex16(fingerprint)},
                      {kMetaLevel, level},
                      {kMetaIndex, std::to_string(index)},
                      {kMetaChain, hex16(chain)},
                      {kMetaTokens, tokens_text(tokens)}};
  if (first_position) meta[kMetaFirst] = std::to_string(*first_position);
  VqkvSaveOptions opts;
  opts.chunk_tokens = std::max<std::int64_t>(1, static_cast<std::int64_t>(tokens.size()));
  try {
    return serialize_prompt_cache(caches, meta, opts);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("level '{}' cannot be stored: {}", level, e.what()));
  }
}

// The empty exact state (no tokens) that restore takes beside a vq layer's codes: every token coded.
KVState no_exact_rows(const VqLayerModel& layer, DType dtype) {
  const int H = layer.kv_heads;
  return {Tensor::uninitialized({1, H, 0, layer.k.n / H}, dtype), Tensor::uninitialized({1, H, 0, layer.v.n / H}, dtype)};
}

// A chunk's K/V as float32: state() gives fresh tensors (or the dropped cache's own), so contiguous
// float32 ones are passed on as they are, not copied again.
Tensor as_f32(const Tensor& t) { return t.dtype() == DType::F32 && t.is_contiguous() ? t : t.to(DType::F32); }

// Chunk i of a live-coded vq level: the live caches' codes of tokens [t0, t0 + C) (every one
// quantized: residual 0, calibrated within chunk 0), each restored into a cache of its own.
Blob live_chunk_blob(const std::vector<std::shared_ptr<KVCache>>& live, std::uint64_t fingerprint, const std::string& level, int index,
                     std::uint64_t chain, std::span<const int> tokens, std::int64_t t0, DType dtype) {
  const auto C = static_cast<std::int64_t>(tokens.size());
  std::vector<std::shared_ptr<KVCache>> caches;
  for (const auto& c : live) {
    const auto& v = dynamic_cast<const VqKVCache&>(*c);
    const std::shared_ptr<const VqLayerModel> layer(c, v.layer_model());  // owned by the live cache
    caches.push_back(VqKVCache::restore(v.config(), layer, v.codes(t0, t0 + C), no_exact_rows(*layer, dtype)));
  }
  return chunk_blob(caches, fingerprint, level, index, chain, tokens, t0);
}

// A live-coded level's widths hint (ChunkDirectory::Entry::widths): its live caches' field widths now.
std::vector<std::uint8_t> live_widths(const std::vector<std::shared_ptr<KVCache>>& live) {
  std::vector<std::uint8_t> w;
  for (const auto& c : live) {
    const auto& v = dynamic_cast<const VqKVCache&>(*c);
    if (v.key_widths().empty() || v.value_widths().empty()) return {};  // not calibrated yet
    w.insert(w.end(), v.key_widths().begin(), v.key_widths().end());
    w.insert(w.end(), v.value_widths().begin(), v.value_widths().end());
  }
  return w;
}

}  // namespace

std::uint64_t model_fingerprint(const Transformer& model) {
  const Checkpoint& ck = model.checkpoint();
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  const ModelConfig& c = ck.config;
  const std::int64_t fields[] = {c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.seq_len, c.shared_classifier};
  XXH64_update(st, fields, sizeof fields);
  for (const auto* v : {&ck.token_embedding, &ck.rms_att, &ck.wq, &ck.wk, &ck.wv, &ck.wo, &ck.rms_ffn, &ck.w1, &ck.w2, &ck.w3,
                        &ck.rms_final, &ck.wcls})
    hash_floats(st, *v);
  const std::uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

std::uint64_t named_model_fingerprint(std::string_view identity) { return XXH64(identity.data(), identity.size(), 0); }

LevelCaches model_level_caches(const Transformer& model) {
  return [&model](const std::string& level) { return make_caches(level, model); };
}

std::string store_level(const std::string& spec) {
  MethodSpec m = MethodSpec::parse(spec);
  if (m.kind == MethodSpec::Kind::Vq && !m.vq_profile.empty()) m.vq_profile = vq_profile_ref(load_vq_profile(m.vq_profile));
  return m.to_string();
}

std::vector<std::string> parse_levels(const std::string& list) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= list.size()) {
    const auto end = std::min(list.find(';', start), list.size());
    std::string part = list.substr(start, end - start);
    part.erase(0, part.find_first_not_of(" \t"));
    part.erase(part.find_last_not_of(" \t") + 1);
    if (!part.empty()) {
      const std::string canon = store_level(part);
      if (std::find(out.begin(), out.end(), canon) == out.end()) out.push_back(canon);
    }
    start = end + 1;
  }
  if (std::find(out.begin(), out.end(), "fp32") == out.end()) out.push_back("fp32");
  return out;
}

std::uint64_t chain_hash(std::uint64_t prev, std::uint64_t fingerprint, const std::string& level, std::span<const int> tokens) {
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  XXH64_update(st, &prev, sizeof prev);
  XXH64_update(st, &fingerprint, sizeof fingerprint);
  const std::uint64_t n = level.size();
  XXH64_update(st, &n, sizeof n);  // length first: no two (level, tokens) pairs share a byte string
  XXH64_update(st, level.data(), level.size());
  XXH64_update(st, tokens.data(), tokens.size() * sizeof(int));
  const std::uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

std::string chunk_key(const std::string& level, std::uint64_t hash) {
  return fmt::format("vq-{:08x}-{}", static_cast<std::uint32_t>(XXH64(level.data(), level.size(), 0)), hex16(hash));
}

std::optional<std::uint64_t> chunk_key_hash(std::string_view key) {
  // "vq-" 8 hex "-" 16 hex
  if (key.size() != 28 || key.substr(0, 3) != "vq-" || key[11] != '-') return std::nullopt;
  std::uint64_t h = 0;
  const auto hex = key.substr(12);
  const auto [p, ec] = std::from_chars(hex.data(), hex.data() + hex.size(), h, 16);
  if (ec != std::errc() || p != hex.data() + hex.size()) return std::nullopt;
  return h;
}

std::uint64_t directory_hash(std::uint64_t prev, int chunk_tokens, std::span<const int> tokens) {
  return chain_hash(prev, 0, fmt::format("dir:{}", chunk_tokens), tokens);
}

std::string directory_key(std::uint64_t hash) { return "vq-dir-" + hex16(hash); }

ChunkKV level_chunk_kv(const Transformer& model, const std::string& level, const ChunkKV& exact) {
  auto caches = make_caches(level, model);
  require(caches.size() == exact.size(), "level_chunk_kv: {} layers of K/V for a model of {} layers", exact.size(), caches.size());
  ChunkKV out;
  for (std::size_t l = 0; l < caches.size(); ++l) {
    caches[l]->update(exact[l].keys, exact[l].values);
    const KVState s = caches[l]->state();
    out.push_back({s.keys.to(DType::F32), s.values.to(DType::F32)});
  }
  return out;
}

Blob encode_chunk(const Transformer& model, std::uint64_t fingerprint, const std::string& level, int index, std::uint64_t chain,
                  std::span<const int> tokens, const ChunkKV& exact) {
  return encode_chunk(model_level_caches(model), fingerprint, level, index, chain, tokens, exact);
}

Blob encode_chunk(const LevelCaches& fresh, std::uint64_t fingerprint, const std::string& level, int index, std::uint64_t chain,
                  std::span<const int> tokens, const ChunkKV& exact) {
  auto caches = fresh(level);
  require(caches.size() == exact.size(), "encode_chunk: {} layers of K/V for a model of {} layers", exact.size(), caches.size());
  for (std::size_t l = 0; l < caches.size(); ++l) {
    require(exact[l].keys.dim(2) == static_cast<std::int64_t>(tokens.size()), "encode_chunk: layer {} holds {} tokens, the chunk {}", l,
            exact[l].keys.dim(2), tokens.size());
    caches[l]->update(exact[l].keys, exact[l].values);
    if (caches[l]->kind() == "Fp16KVCache") {
      // float32 rows holding float16 values: the same values as a plain float16 cache, exactly.
      const KVState s = caches[l]->state();
      auto plain = std::make_shared<KVCache>();
      plain->from_state({s.keys.to(DType::F16), s.values.to(DType::F16)});
      caches[l] = plain;
    }
  }
  return chunk_blob(caches, fingerprint, level, index, chain, tokens);
}

namespace {
ChunkCodes decode_chunk_as(std::span<const std::uint8_t> blob, std::uint64_t fingerprint, const std::string& level, int index,
                           std::uint64_t chain, std::span<const int> tokens, const VqLayerModelSource& vq_models, bool vq_codes,
                           VqCodeBuffers* buffers = nullptr);
}  // namespace

ChunkKV decode_chunk(std::span<const std::uint8_t> blob, std::uint64_t fingerprint, const std::string& level, int index,
                     std::uint64_t chain, std::span<const int> tokens, const VqLayerModelSource& vq_models) {
  return decode_chunk_as(blob, fingerprint, level, index, chain, tokens, vq_models, false).kv;
}

ChunkCodes decode_chunk_codes(std::span<const std::uint8_t> blob, std::uint64_t fingerprint, const std::string& level, int index,
                              std::uint64_t chain, std::span<const int> tokens, const VqLayerModelSource& vq_models,
                              VqCodeBuffers* buffers) {
  return decode_chunk_as(blob, fingerprint, level, index, chain, tokens, vq_models, true, buffers);
}

ChunkLayer vq_chunk_rows(const VqStoredLayer& v, std::int64_t first_position) {
  try {
    require(v.layer != nullptr, "a vq chunk layer without its layer model");
    const KVState s = first_position == 0  // restore(...)->state()'s checks and bits
                          ? vq_restored_state(v.config, v.layer, v.codes, no_exact_rows(*v.layer, v.dtype))
                          : vq_reconstruct_at(v.codes, *v.layer, v.dtype, first_position);
    return {as_f32(s.keys), as_f32(s.values)};
  } catch (const InvalidArgument& e) {
    throw FormatError(fmt::format("vq layer: {}", e.what()));
  }
}

bool live_coded_level(const std::vector<std::shared_ptr<KVCache>>& caches, int chunk_tokens) {
  if (caches.empty()) return false;
  for (const auto& c : caches) {
    const auto* v = dynamic_cast<const VqKVCache*>(c.get());
    if (!v || v->model_from_data() || !v->layer_model() || v->offset() != 0) return false;
    const VqConfig& k = v->config();
    if (k.residual != 0 || k.sinks != 0 || k.calib > chunk_tokens) return false;
  }
  return true;
}

namespace {
ChunkCodes decode_chunk_as(std::span<const std::uint8_t> blob, std::uint64_t fingerprint, const std::string& level, int index,
                           std::uint64_t chain, std::span<const int> tokens, const VqLayerModelSource& vq_models, bool vq_codes,
                           VqCodeBuffers* buffers) {
  VqkvLoadOptions lo;
  lo.vq_code_buffers = buffers;
  lo.vq_models = vq_models;
  lo.dense_states = true;  // the K/V only: vq layers go from codes to rows without a resident cache
  lo.vq_codes = true;  // vq layers of codes only come as codes: rows made below unless the caller wants codes
  PromptCache pc = deserialize_prompt_cache(blob, lo);
  const auto meta = [&](const char* k) {
    const auto it = pc.metadata.find(k);
    return it == pc.metadata.end() ? std::string("(none)") : it->second;
  };
  if (meta(kMetaModel) != hex16(fingerprint))
    throw FormatError(fmt::format("blob of another model (fingerprint {}, expected {})", meta(kMetaModel), hex16(fingerprint)));
  if (meta(kMetaLevel) != level) throw FormatError(fmt::format("blob of another method ('{}', expected '{}')", meta(kMetaLevel), level));
  if (meta(kMetaIndex) != std::to_string(index))
    throw FormatError(fmt::format("blob of another chunk index ({}, expected {})", meta(kMetaIndex), index));
  if (meta(kMetaTokens) != tokens_text(tokens)) throw FormatError("blob of another token sequence");
  // After the tokens: a blob whose own tokens match but whose prefix differs is served nowhere else.
  if (!pc.metadata.count(kMetaChain)) throw FormatError("blob without the hash of its prefix (written by an older veloxquant)");
  if (meta(kMetaChain) != hex16(chain))
    throw FormatError(fmt::format("blob of another prefix (its prefix hash {}, this prompt's {})", meta(kMetaChain).substr(0, 16), hex16(chain)));
  ChunkCodes out;
  if (const auto it = pc.metadata.find(kMetaFirst); it != pc.metadata.end()) {
    const std::string& v = it->second;
    std::int64_t p = -1;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), p);
    if (ec != std::errc() || end != v.data() + v.size() || p != static_cast<std::int64_t>(index) * static_cast<std::int64_t>(tokens.size()))
      throw FormatError(fmt::format("blob of another first position ('{}', expected {})", v,
                                    static_cast<std::int64_t>(index) * static_cast<std::int64_t>(tokens.size())));
    out.first_position = p;
  }
  out.vq = std::move(pc.vq_layers);
  out.vq.resize(pc.states.size());
  for (std::size_t l = 0; l < pc.states.size(); ++l) {
    if (out.vq[l]) {
      if (out.vq[l]->codes.tokens != static_cast<std::int64_t>(tokens.size()))
        throw FormatError(fmt::format("blob holds {} tokens per layer, the chunk {}", out.vq[l]->codes.tokens, tokens.size()));
      if (vq_codes) {
        out.kv.push_back({});
        continue;
      }
      out.kv.push_back(vq_chunk_rows(*out.vq[l], out.first_position));
      out.vq[l].reset();
      continue;
    }
    const KVState& s = pc.states[l];
    if (s.keys.dim(2) != static_cast<std::int64_t>(tokens.size()) || s.values.dim(2) != static_cast<std::int64_t>(tokens.size()))
      throw FormatError(fmt::format("blob holds {} tokens per layer, the chunk {}", s.keys.dim(2), tokens.size()));
    out.kv.push_back({as_f32(s.keys), as_f32(s.values)});
  }
  return out;
}
}  // namespace

VqLayerModelSource chunk_vq_models(const Transformer& model) {
  // Non-owning: the caller keeps the model alive for as long as it uses the source. The layer models
  // are the Transformer's own (Transformer::vq_layer_model: built once per model and shared by its
  // copies), so a put and every later load of the same model build each layer once.
  const std::uint64_t fingerprint = vq_model_fingerprint(model.checkpoint());
  const int layers = model.config().n_layers;
  return [&model, fingerprint, layers](const VqModelSource& want) {
    require(want.fingerprint == fingerprint,
            "a vq layer was saved from the model with fingerprint {:016x}; the model given has fingerprint {:016x} (load it with the "
            "model it was compressed with)", want.fingerprint, fingerprint);
    require(want.layer >= 0 && want.layer < layers, "a vq layer names model layer {}; the model has {}", want.layer, layers);
    return model.vq_layer_model(want.layer, want.basis);
  };
}

namespace {
// A directory's width hints: zstd (they repeat a few values), then base64 (JSON text).
constexpr char kBase64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
std::string base64(const std::vector<std::uint8_t>& in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  for (std::size_t i = 0; i < in.size(); i += 3) {
    const std::uint32_t v = std::uint32_t{in[i]} << 16 | (i + 1 < in.size() ? std::uint32_t{in[i + 1]} << 8 : 0) |
                            (i + 2 < in.size() ? std::uint32_t{in[i + 2]} : 0);
    const std::size_t rem = std::min<std::size_t>(3, in.size() - i);  // bytes in this group: chars 0..rem, then '='
    for (std::size_t k = 0; k < 4; ++k) out += k <= rem ? kBase64[(v >> (18 - 6 * k)) & 63] : '=';
  }
  return out;
}
std::vector<std::uint8_t> unbase64(const std::string& in) {
  if (in.size() % 4 != 0) throw FormatError("malformed chunk directory: widths are not base64");
  std::vector<std::uint8_t> out;
  out.reserve(in.size() / 4 * 3);
  for (std::size_t i = 0; i < in.size(); i += 4) {
    std::uint32_t v = 0;
    int pad = 0;
    for (std::size_t k = 0; k < 4; ++k) {
      const char ch = in[i + k];
      const char* at = ch ? std::strchr(kBase64, ch) : nullptr;
      if (ch == '=' && i + 4 == in.size() && k >= 2) ++pad;
      else if (!at || pad) throw FormatError("malformed chunk directory: widths are not base64");
      v = v << 6 | (at ? static_cast<std::uint32_t>(at - kBase64) : 0);
    }
    for (int k = 0; k < 3 - pad; ++k) out.push_back(static_cast<std::uint8_t>(v >> (16 - 8 * k)));
  }
  return out;
}
std::string pack_widths(const std::vector<std::uint8_t>& w) {
  std::vector<std::uint8_t> z(ZSTD_compressBound(w.size()));
  const std::size_t n = ZSTD_compress(z.data(), z.size(), w.data(), w.size(), 3);
  if (ZSTD_isError(n)) throw Error(fmt::format("chunk directory: zstd failed ({})", ZSTD_getErrorName(n)));
  z.resize(n);
  return base64(z);
}
std::vector<std::uint8_t> unpack_widths(const std::string& text, std::uint64_t count) {
  // 2^24: 4096 layers of two 2048-wide sides; a forged count is refused before allocating.
  if (count > (std::uint64_t{1} << 24)) throw FormatError("malformed chunk directory: too many widths");
  const std::vector<std::uint8_t> z = unbase64(text);
  std::vector<std::uint8_t> w(count);
  const std::size_t n = ZSTD_decompress(w.data(), w.size(), z.data(), z.size());
  if (ZSTD_isError(n) || n != count) throw FormatError("malformed chunk directory: its widths do not decompress");
  return w;
}
}  // namespace

// Version 2: entries name their model, the directory its chunk size (version 1 directories were
// keyed per level list and model, and are no longer looked up).
Blob encode_directory(const ChunkDirectory& dir) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& e : dir.entries) {
    j.push_back({{"model", hex16(e.model)}, {"level", e.level}, {"key", e.key}, {"bytes", e.bytes}});
    if (!e.widths.empty()) j.back()["widths"] = {{"count", e.widths.size()}, {"zstd_base64", pack_widths(e.widths)}};
  }
  const std::string text = nlohmann::json{{"vqkv_chunk_directory", 2}, {"chunk_tokens", dir.chunk_tokens}, {"levels", j}}.dump();
  return Blob(text.begin(), text.end());
}

namespace {
// An index blob's size, refused before it is parsed.
void check_index_size(std::span<const std::uint8_t> blob, const char* what) {
  if (blob.size() > kMaxIndexBlobBytes)
    throw FormatError(fmt::format("{} of {} bytes (at most {})", what, blob.size(), kMaxIndexBlobBytes));
}
// An integer field within [lo, hi] (a float, or a number out of range, is malformed: no cast of
// an out-of-range value).
int json_int(const nlohmann::json& v, const char* what, int lo, int hi) {
  if (!v.is_number_integer()) throw FormatError(fmt::format("malformed index blob: {} is not an integer", what));
  const bool neg = v.is_number_unsigned() ? false : v.get<std::int64_t>() < 0;
  const std::int64_t x = neg ? v.get<std::int64_t>() : static_cast<std::int64_t>(std::min<std::uint64_t>(v.get<std::uint64_t>(), std::uint64_t{1} << 62));
  if (x < lo || x > hi) throw FormatError(fmt::format("malformed index blob: {} {} is out of [{}, {}]", what, x, lo, hi));
  return static_cast<int>(x);
}
std::uint64_t parse_hex16(const std::string& text) {
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v, 16);
  if (text.size() != 16 || ec != std::errc() || end != text.data() + text.size())
    throw FormatError(fmt::format("malformed chunk directory: model '{}' is not 16 hex digits", text.substr(0, 40)));
  return v;
}
}  // namespace

ChunkDirectory decode_directory(std::span<const std::uint8_t> blob) {
  check_index_size(blob, "chunk directory");
  ChunkDirectory d;
  try {
    const auto j = nlohmann::json::parse(blob.begin(), blob.end());
    if (json_int(j.at("vqkv_chunk_directory"), "version", 0, 1 << 30) != 2) throw FormatError("chunk directory of an unknown version");
    d.chunk_tokens = json_int(j.at("chunk_tokens"), "chunk size", 1, 1 << 30);
    const auto& levels = j.at("levels");
    if (!levels.is_array() || levels.size() > kMaxDirectoryEntries)
      throw FormatError(fmt::format("malformed chunk directory: more than {} entries, or not a list", kMaxDirectoryEntries));
    for (const auto& e : levels) {
      d.entries.push_back({e.at("level").get<std::string>(), e.at("key").get<std::string>(), e.at("bytes").get<std::uint64_t>(), {},
                           parse_hex16(e.at("model").get<std::string>())});
      if (const auto w = e.find("widths"); w != e.end())
        d.entries.back().widths = unpack_widths(w->at("zstd_base64").get<std::string>(), w->at("count").get<std::uint64_t>());
    }
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("malformed chunk directory: {}", e.what()));
  }
  return d;
}

Blob encode_chunk_sizes(const std::vector<int>& sizes) {
  const std::string text = nlohmann::json{{"vqkv_chunk_sizes", 1}, {"sizes", sizes}}.dump();
  return Blob(text.begin(), text.end());
}

std::vector<int> decode_chunk_sizes(std::span<const std::uint8_t> blob) {
  check_index_size(blob, "chunk-sizes list");
  std::vector<int> sizes;
  try {
    const auto j = nlohmann::json::parse(blob.begin(), blob.end());
    if (json_int(j.at("vqkv_chunk_sizes"), "version", 0, 1 << 30) != 1) throw FormatError("chunk-sizes list of an unknown version");
    const auto& list = j.at("sizes");
    if (!list.is_array() || list.size() > kMaxChunkSizes)
      throw FormatError(fmt::format("malformed chunk-sizes list: more than {} sizes, or not a list", kMaxChunkSizes));
    for (const auto& v : list) {
      const int c = json_int(v, "chunk size", 1, 1 << 30);
      if (std::find(sizes.begin(), sizes.end(), c) == sizes.end()) sizes.push_back(c);
    }
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("malformed chunk-sizes list: {}", e.what()));
  }
  return sizes;
}

namespace {
// Read-modify-replace of an index blob: `merge` turns what is there (nullopt: nothing, or a blob
// that does not decode) into what should be, or nullopt when nothing needs writing. After a
// replace, read back and merge again (a concurrent writer may have replaced it meanwhile): up to 3
// writes. What a lost race drops is a miss for readers until the next put, never a wrong blob.
// `read`: what the caller already read (decoded, nullopt: nothing or corrupt), taken for the first
// round instead of a second get. Returns the size of the last blob written (0: none).
template <class T>
std::uint64_t merge_index_blob(KVStore& store, const std::string& key, const std::function<T(std::span<const std::uint8_t>)>& decode,
                      const std::function<std::optional<Blob>(const std::optional<T>&)>& merge,
                      std::optional<std::optional<T>> read = std::nullopt) {
  std::uint64_t written = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::optional<T> now;
    if (attempt == 0 && read) now = std::move(*read);
    else {
      try {
        if (const auto blob = store.get_at_most(key, kMaxIndexBlobBytes)) now = decode(*blob);
      } catch (const StoreAuthError& e) {  // sealed under another secret: never overwritten (see sealed_store.hpp)
        throw IoError(fmt::format("index blob '{}' not updated: {}", key, e.what()));
      } catch (const FormatError&) {  // corrupt or foreign: replaced by ours
      }
    }
    const auto next = merge(now);
    if (!next) break;
    store.replace(key, *next);
    written = next->size();
  }
  return written;
}

// Adds entries to chunk position's directory: those whose (model, level) it lacks.
// `read`: the directory as the caller read it just before.
std::uint64_t add_to_directory(KVStore& store, const std::string& key, int chunk_tokens, const std::vector<ChunkDirectory::Entry>& add,
                               const std::optional<ChunkDirectory>& read) {
  return merge_index_blob<ChunkDirectory>(
      store, key, [](std::span<const std::uint8_t> b) { return decode_directory(b); },
      [&](const std::optional<ChunkDirectory>& now) -> std::optional<Blob> {
        ChunkDirectory d = now && now->chunk_tokens == chunk_tokens ? *now : ChunkDirectory{};
        d.chunk_tokens = chunk_tokens;
        bool changed = !now || now->chunk_tokens != chunk_tokens;
        for (const auto& e : add) {
          const auto same = [&](const ChunkDirectory::Entry& x) { return x.model == e.model && x.level == e.level; };
          const auto it = std::find_if(d.entries.begin(), d.entries.end(), same);
          if (it != d.entries.end() && it->key == e.key) continue;
          if (it != d.entries.end()) *it = e;  // a forged or stale key for this prefix: ours is the chain's
          else d.entries.push_back(e);
          changed = true;
        }
        if (d.entries.size() > kMaxDirectoryEntries) d.entries.assign(add.begin(), add.end()), changed = true;
        return changed ? std::optional<Blob>(encode_directory(d)) : std::nullopt;
      },
      std::optional<std::optional<ChunkDirectory>>(read));
}

// Adds a chunk size to the store's list of them.
std::uint64_t add_chunk_size(KVStore& store, int chunk_tokens) {
  return merge_index_blob<std::vector<int>>(
      store, kChunkSizesKey, [](std::span<const std::uint8_t> b) { return decode_chunk_sizes(b); },
      [&](const std::optional<std::vector<int>>& now) -> std::optional<Blob> {
        std::vector<int> sizes = now.value_or(std::vector<int>{});
        if (now && std::find(sizes.begin(), sizes.end(), chunk_tokens) != sizes.end()) return std::nullopt;
        sizes.push_back(chunk_tokens);
        if (sizes.size() > kMaxChunkSizes) sizes.erase(sizes.begin());  // the oldest size goes
        return encode_chunk_sizes(sizes);
      });
}
}  // namespace

void forget_chunk(KVStore& store, const std::string& directory, const std::string& key) {
  store.remove(key);  // first: an entry left behind names a missing blob (a miss), never a bad one
  merge_index_blob<ChunkDirectory>(
      store, directory, [](std::span<const std::uint8_t> b) { return decode_directory(b); },
      [&](const std::optional<ChunkDirectory>& now) -> std::optional<Blob> {
        if (!now) return std::nullopt;  // nothing there, or a corrupt directory the next put replaces
        ChunkDirectory d = *now;
        std::erase_if(d.entries, [&](const ChunkDirectory::Entry& e) { return e.key == key; });
        if (d.entries.size() == now->entries.size()) return std::nullopt;
        return encode_directory(d);
      });
}

PutReport put_context(KVStore& store, const Transformer& model, const ChunkScheme& scheme, std::span<const int> tokens,
                      const std::vector<KVState>& exact) {
  // Each level's caches of the first chunk serve as templates for the rest (fresh_caches).
  std::map<std::string, std::vector<std::shared_ptr<KVCache>>> templates;
  const LevelCaches fresh = [&](const std::string& level) {
    auto& t = templates[level];
    if (t.empty()) t = make_caches(level, model);
    return fresh_caches(level, model, &t);
  };
  return put_context(store, fresh, scheme, tokens, exact);
}

PutReport put_context(KVStore& store, const LevelCaches& fresh, const ChunkScheme& scheme, std::span<const int> tokens,
                      const std::vector<KVState>& exact) {
  require(scheme.chunk_tokens >= 1, "chunk tokens must be >= 1, got {}", scheme.chunk_tokens);
  require(!scheme.levels.empty(), "put_context: no levels");
  const std::size_t C = static_cast<std::size_t>(scheme.chunk_tokens);
  // Eviction waits for the whole put, which then marks its chunks first-chunk-newest (a prefix is
  // evicted from its end, never stranding what follows a gap).
  struct Hold {
    KVStore& store;
    std::vector<std::string> used{kChunkSizesKey};  // the order mark_used takes: newest first
    explicit Hold(KVStore& s) : store(s) { store.hold_eviction(true); }
    ~Hold() {
      try {
        store.mark_used(used);
      } catch (...) {  // recency is a hint; the release below must happen
      }
      try {
        store.hold_eviction(false);
      } catch (...) {  // an eviction that failed leaves the store above capacity until the next write
      }
    }
  } hold(store);
  PutReport rep;
  rep.chunks = static_cast<int>(tokens.size() / C);
  std::vector<std::uint64_t> prev(scheme.levels.size(), 0);
  std::uint64_t dir_prev = 0;
  // Live-coded vq levels (see the header): one cache per layer fed every chunk, written or not.
  std::vector<std::vector<std::shared_ptr<KVCache>>> live(scheme.levels.size());
  for (std::size_t l = 0; l < scheme.levels.size() && rep.chunks > 0; ++l)
    if (MethodSpec::parse(scheme.levels[l]).kind == MethodSpec::Kind::Vq) {
      auto caches = fresh(scheme.levels[l]);
      if (live_coded_level(caches, scheme.chunk_tokens)) live[l] = std::move(caches);
    }
  for (int i = 0; i < rep.chunks; ++i) {
    const auto toks = tokens.subspan(static_cast<std::size_t>(i) * C, C);
    dir_prev = directory_hash(dir_prev, scheme.chunk_tokens, toks);
    const std::string dkey = directory_key(dir_prev);
    for (std::size_t l = 0; l < scheme.levels.size(); ++l) prev[l] = chain_hash(prev[l], scheme.model_fingerprint, scheme.levels[l], toks);
    ChunkKV chunk;
    for (const auto& s : exact)
      chunk.push_back({s.keys.slice(2, i * scheme.chunk_tokens, (i + 1) * scheme.chunk_tokens).contiguous(true),
                       s.values.slice(2, i * scheme.chunk_tokens, (i + 1) * scheme.chunk_tokens).contiguous(true)});
    for (auto& lv : live) {
      require(lv.empty() || lv.size() == chunk.size(), "put_context: {} layers of K/V for a model of {} layers", chunk.size(), lv.size());
      for (std::size_t k = 0; k < lv.size(); ++k) lv[k]->update(chunk[k].keys, chunk[k].values);
    }
    // The directory is written last: an entry it lists names a blob already there. A level it
    // lists for this model under this chunk's key is skipped.
    std::optional<ChunkDirectory> existing;
    try {
      if (const auto b = store.get_at_most(dkey, kMaxIndexBlobBytes)) existing = decode_directory(*b);
    } catch (const StoreAuthError& e) {  // sealed under another secret: this put stops here, nothing overwritten
      throw IoError(fmt::format("chunk {} not stored: {}", i, e.what()));
    } catch (const FormatError&) {  // corrupt or unsealed: rewritten below
    }
    ChunkDirectory dir;  // the scheme's levels, in its order
    std::vector<ChunkDirectory::Entry> added;
    for (std::size_t l = 0; l < scheme.levels.size(); ++l) {
      const std::string key = chunk_key(scheme.levels[l], prev[l]);
      if (existing && existing->chunk_tokens == scheme.chunk_tokens) {
        const auto it = std::find_if(existing->entries.begin(), existing->entries.end(), [&](const ChunkDirectory::Entry& e) {
          return e.model == scheme.model_fingerprint && e.level == scheme.levels[l] && e.key == key;
        });
        if (it != existing->entries.end()) {
          dir.entries.push_back(*it);
          continue;
        }
      }
      const Blob blob = live[l].empty() ? encode_chunk(fresh, scheme.model_fingerprint, scheme.levels[l], i, prev[l], toks, chunk)
                                        : live_chunk_blob(live[l], scheme.model_fingerprint, scheme.levels[l], i, prev[l], toks,
                                                          static_cast<std::int64_t>(i) * scheme.chunk_tokens, chunk[0].keys.dtype());
      store.put(key, blob);
      rep.bytes_written += blob.size();
      dir.entries.push_back({scheme.levels[l], key, blob.size(), live_widths(live[l]), scheme.model_fingerprint});
      added.push_back(dir.entries.back());
    }
    dir.chunk_tokens = scheme.chunk_tokens;
    for (const auto& e : dir.entries) hold.used.push_back(e.key);
    hold.used.push_back(dkey);
    if (!added.empty()) {
      rep.bytes_written += add_to_directory(store, dkey, scheme.chunk_tokens, added, existing);
      ++rep.chunks_written;
    }
    rep.directories.push_back(std::move(dir));
  }
  // Listed once the chunks are there (a reader that finds the size finds its chunks).
  if (rep.chunks > 0) rep.bytes_written += add_chunk_size(store, scheme.chunk_tokens);
  return rep;
}

}  // namespace vq
