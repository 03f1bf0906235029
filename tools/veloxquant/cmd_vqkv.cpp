// veloxquant compress / decompress / inspect: the .vqkv container from the command line
// (format/vqkv.hpp, docs/format.md).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "json_out.hpp"
#include "model_options.hpp"
#include "output_paths.hpp"
#include "printable.hpp"
#include "numeric_options.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/npy.hpp"
#include "veloxquant/format/llama_state.hpp"
#include "veloxquant/format/safetensors.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/gguf.hpp"
#include "veloxquant/methods/method_table.hpp"
#include "veloxquant/model/vq_layer_models.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"

namespace vqcli {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct CompressOptions {
  std::string keys, values, kv, llama_state, model, tokenizer, text, out, method = "cachegen", flush;
  int ctx = 0, bits = 0, group_size = 0;
  std::int64_t chunk = 0, chunk_tokens = vq::VqkvSaveOptions{}.chunk_tokens;
  bool json = false;
};

// A model file as the checkpoint it holds: a GGUF file or a llama2.c checkpoint (no tokenizer read).
vq::Checkpoint load_checkpoint(const std::string& path) {
  if (vq::is_gguf_file(path)) return vq::load_gguf(path).checkpoint;
  return vq::Checkpoint::load(path);
}

// The method: --method, with --bits / --group-size / --flush overriding a cachegen spec's keys.
// A llama.cpp state also takes fp16 (its rows stored as float16: exact for an F16 state).
vq::MethodSpec method_of(const CompressOptions& o) {
  vq::MethodSpec spec = vq::MethodSpec::parse(o.method);
  const bool overrides = o.bits != 0 || o.group_size != 0 || !o.flush.empty();
  if (overrides) {
    vq::require(spec.kind == vq::MethodSpec::Kind::CacheGen, "--bits, --group-size and --flush apply to --method cachegen only");
    if (o.bits != 0) spec.cachegen.cachegen_bits = o.bits;
    if (o.group_size != 0) spec.cachegen.cachegen_group_size = o.group_size;
    if (!o.flush.empty()) spec.cachegen.cachegen_flush = vq::flush_mode_from_name(o.flush);
    spec.cachegen.validate();
  }
  // The method table's rows that save to .vqkv: the compressing ones, then the exact baseline.
  std::vector<std::string> rows;
  for (const bool baseline : {false, true})
    for (const auto& r : vq::method_table())
      if (r.saves_vqkv && (r.family == vq::MethodFamily::Baseline) == baseline) rows.emplace_back(r.name);
  std::string saved;
  for (std::size_t i = 0; i < rows.size(); ++i) saved += (i == 0 ? "" : i + 1 == rows.size() ? " or " : ", ") + rows[i];
  vq::require(vq::method_row(spec.kind).saves_vqkv || (spec.kind == vq::MethodSpec::Kind::Fp16 && !o.llama_state.empty()),
              "--method {}: a .vqkv file holds {} caches (and fp16 from --llama-state)", o.method, saved);
  return spec;
}

// Feed one layer's K/V to its cache, `chunk` tokens per call (0: all at once).
void feed(vq::KVCache& cache, const vq::Tensor& k, const vq::Tensor& v, std::int64_t chunk) {
  const std::int64_t S = k.dim(2);
  const std::int64_t step = chunk > 0 ? chunk : std::max<std::int64_t>(S, 1);
  for (std::int64_t s = 0; s < S; s += step) {
    const std::int64_t e = std::min(S, s + step);
    cache.update_and_fetch(k.slice(2, s, e), v.slice(2, s, e));
  }
}

// The .vqkv metadata that lets decompress write the state back as llama.cpp saved it: the fields the
// K/V tensors do not carry, and the token ids (decimal, comma-separated: the format's metadata is
// where a file keeps what is not a cache; 256 tokens of stories260K take about 1 KB).
constexpr const char* kLlamaStateKey = "llama_state";
constexpr const char* kLlamaTokensKey = "llama_state.tokens";

void put_llama_state_metadata(vq::PromptMetadata& meta, const vq::LlamaState& st) {
  meta[kLlamaStateKey] = fmt::format("type={},v_trans={},n_stream={},stream={},seq_id={}{}", vq::ggml_type_name(vq::ggml_type_of(st.dtype)),
                                     st.v_trans ? 1 : 0, st.n_stream, st.stream, st.seq_id, st.server_tokens ? ",server_tokens=1" : "");
  std::string t;
  for (std::size_t i = 0; i < st.tokens.size(); ++i) t += (i ? "," : "") + std::to_string(st.tokens[i]);
  meta[kLlamaTokensKey] = t;
}

// Compress a llama.cpp state: one cache per layer of the model it was saved from, fed its K/V in
// calls of --chunk cells. fp16 stores the rows as float16 in plain caches.
std::vector<std::shared_ptr<vq::KVCache>> compress_llama_state(const CompressOptions& o, vq::MethodSpec spec, vq::PromptMetadata& meta,
                                                               double& input_fp16_bytes) {
  vq::require(!o.model.empty(), "--llama-state needs --model M (the model the state was saved from: its layers, KV heads and head size)");
  vq::require(o.ctx == 0 && o.text.empty() && o.tokenizer.empty(), "--llama-state takes no --ctx, --text or --tokenizer (the state holds the cache)");
  vq::Transformer model(load_checkpoint(o.model));
  const auto& c = model.config();
  const vq::LlamaState st = vq::load_llama_state(o.llama_state, {c.n_layers, c.n_kv_heads, c.head_size(), c.head_size()});
  for (std::size_t i = 0; i < st.tokens.size(); ++i)
    vq::require(st.tokens[i] >= 0 && st.tokens[i] < c.vocab_size, "{}: token {} is id {}, outside the vocabulary of {} (another model's state?)",
                o.llama_state, i, st.tokens[i], c.vocab_size);
  const bool fp16 = spec.kind == vq::MethodSpec::Kind::Fp16;
  if (fp16) spec = vq::MethodSpec::parse("fp32");
  auto caches = vq::make_caches(spec, model);
  for (std::size_t i = 0; i < st.layers.size(); ++i) {
    const auto& l = st.layers[i];
    if (fp16) feed(*caches[i], l.keys.to(vq::DType::F16), l.values.to(vq::DType::F16), o.chunk);
    else feed(*caches[i], l.keys, l.values, o.chunk);
    input_fp16_bytes += 2.0 * static_cast<double>(l.keys.numel() + l.values.numel());
  }
  put_llama_state_metadata(meta, st);
  meta["source"] = std::filesystem::path(o.llama_state).filename().string();
  meta["model"] = std::filesystem::path(o.model).filename().string();
  return caches;
}

int run_compress(const CompressOptions& o) {
  const int sources = (!o.keys.empty() || !o.values.empty()) + !o.kv.empty() + !o.llama_state.empty() +
                      (o.llama_state.empty() && (o.ctx > 0 || !o.model.empty() || !o.text.empty()));
  vq::require(sources == 1,
              "give exactly one input: --keys K.npy --values V.npy, --kv FILE.safetensors, --llama-state FILE --model M, or --model/--text with --ctx N");
  const vq::MethodSpec spec = method_of(o);
  vq::PromptMetadata meta{{"method", spec.to_string()}, {"writer", "veloxquant 0.1.0"}};
  std::vector<std::shared_ptr<vq::KVCache>> caches;
  double input_fp16_bytes = 0;
  const auto t0 = Clock::now();
  auto feed_layers = [&](const std::vector<vq::KVPair>& layers) {
    for (const auto& l : layers)  // before the head dim is narrowed to int to describe the model
      vq::require(l.keys.dim(3) <= vq::kMaxHeadDim && l.values.dim(3) <= vq::kMaxHeadDim,
                  "keys {} / values {}: head dim must be at most {}", vq::shape_string(l.keys.shape()),
                  vq::shape_string(l.values.shape()), vq::kMaxHeadDim);
    caches = vq::make_caches(spec, vq::ModelDescription::uniform(static_cast<int>(layers.size()), static_cast<int>(layers[0].keys.dim(3))));
    for (std::size_t i = 0; i < layers.size(); ++i) {
      feed(*caches[i], layers[i].keys, layers[i].values, o.chunk);
      input_fp16_bytes += 2.0 * static_cast<double>(layers[i].keys.numel() + layers[i].values.numel());
    }
  };
  if (!o.keys.empty() || !o.values.empty()) {
    vq::require(!o.keys.empty() && !o.values.empty(), "--keys and --values go together");
    vq::KVPair p{vq::read_npy(o.keys), vq::read_npy(o.values)};
    vq::require(p.keys.dim(0) == p.values.dim(0) && p.keys.dim(1) == p.values.dim(1) && p.keys.dim(2) == p.values.dim(2),
                "{} has shape {} but {} has shape {}: B, H and S must agree", o.keys, vq::shape_string(p.keys.shape()), o.values,
                            vq::shape_string(p.values.shape()));
    vq::require(p.keys.dtype() == p.values.dtype(),
                "{} is {} but {} is {}", o.keys, vq::dtype_name(p.keys.dtype()), o.values, vq::dtype_name(p.values.dtype()));
    meta["source"] = fmt::format("{} {}", std::filesystem::path(o.keys).filename().string(), std::filesystem::path(o.values).filename().string());
    feed_layers({p});
  } else if (!o.llama_state.empty()) {
    caches = compress_llama_state(o, spec, meta, input_fp16_bytes);
  } else if (!o.kv.empty()) {
    const auto layers = vq::read_kv_safetensors(o.kv);
    meta["source"] = std::filesystem::path(o.kv).filename().string();
    feed_layers(layers);
  } else {
    vq::require(o.ctx > 0, "--ctx N (tokens of --text to run through the model) is required with --model/--text");
    const vq::ModelFiles files = vq::resolve_model_files(o.model.empty() ? std::nullopt : std::optional<std::filesystem::path>(o.model),
                                                         o.tokenizer.empty() ? std::nullopt : std::optional<std::filesystem::path>(o.tokenizer));
    vq::LoadedModel loaded = vq::load_model(files);
    vq::Transformer model(std::move(loaded.checkpoint));
    const vq::Tokenizer tok = std::move(loaded.tokenizer);
    vq::require(o.ctx <= model.config().seq_len, "--ctx {} is longer than the model's context ({})", o.ctx, model.config().seq_len);
    const std::string text_path = text_path_or_default(o.text);
    const std::string text = read_text(text_path, static_cast<std::size_t>(o.ctx) * 64);  // plenty for ctx tokens
    std::vector<int> tokens = tok.encode(text, /*bos=*/true);
    vq::require(static_cast<int>(tokens.size()) >= o.ctx, "{} holds only {} tokens, fewer than --ctx {}", text_path, tokens.size(), o.ctx);
    tokens.resize(static_cast<std::size_t>(o.ctx));
    caches = vq::make_caches(spec, model);
    const std::size_t step = o.chunk > 0 ? static_cast<std::size_t>(o.chunk) : tokens.size();
    for (std::size_t s = 0; s < tokens.size(); s += step)
      model.forward(std::span<const int>(tokens).subspan(s, std::min(step, tokens.size() - s)), caches);
    const auto& c = model.config();
    input_fp16_bytes = 2.0 * 2.0 * c.n_layers * c.n_kv_heads * (c.dim / c.n_heads) * static_cast<double>(o.ctx);
    meta["source"] = fmt::format("{} on {} tokens of {}", files.model.filename().string(), o.ctx, std::filesystem::path(text_path).filename().string());
    meta["model"] = files.model.filename().string();
  }
  vq::VqkvSaveOptions so;
  so.chunk_tokens = o.chunk_tokens;
  vq::save_prompt_cache(o.out, caches, meta, so);
  const double secs = seconds_since(t0);
  const auto bytes = std::filesystem::file_size(o.out);
  const double bits = input_fp16_bytes > 0 ? 16.0 * static_cast<double>(bytes) / input_fp16_bytes : 0.0;
  if (o.json) {
    nlohmann::json j{{"path", o.out},           {"bytes", bytes},   {"layers", caches.size()},
                     {"tokens", caches[0]->offset()}, {"method", spec.to_string()}, {"fp16_bytes", input_fp16_bytes},
                     {"bits_per_element", bits}, {"seconds", secs}};
    if (!o.llama_state.empty()) j["llama_state_bytes"] = std::filesystem::file_size(o.llama_state);
    fmt::print("{}\n", json_text(j, -1));  // a path need not be UTF-8
  } else {
    fmt::print("wrote {}: {} bytes, {} layers x {} tokens, {}; {:.3f} bits/element ({:.2f}x smaller than fp16); {:.2f} s\n", o.out, bytes,
               caches.size(), caches[0]->offset(), spec.to_string(), bits, bits > 0 ? 16.0 / bits : 0.0, secs);
  }
  return 0;
}

struct DecompressOptions {
  std::string in, out, keys_out, values_out, llama_state_out, model;
  int layer = -1;
};

// The layer models of vq layers saved from a model: --model (or the default model files, as
// compress looks them up), loaded only when a layer asks for one.
vq::VqLayerModelSource vq_models_of(const std::string& model) {
  auto cached = std::make_shared<vq::VqLayerModelSource>();
  return [model, cached](const vq::VqModelSource& want) {
    if (!*cached) {
      const auto path = model.empty() ? vq::find_default_model() : std::optional<std::filesystem::path>(model);
      vq::require(path.has_value(), "a vq layer needs the model with fingerprint {:016x}: give it with --model (no {} in {})", want.fingerprint,
                  vq::kDefaultModelFile, "$VELOXQUANT_MODEL_DIR, ./models or ../shared/models");
      *cached = vq::vq_layer_models(std::make_shared<const vq::Checkpoint>(load_checkpoint(path->string())));
    }
    return (*cached)(want);
  };
}

// The llama.cpp state held by a .vqkv compressed from one (its llama_state metadata), with the
// caches' K/V converted back to the state's type.
vq::LlamaState llama_state_of(const vq::PromptCache& pc, const std::string& in) {
  const auto it = pc.metadata.find(kLlamaStateKey);
  const auto tt = pc.metadata.find(kLlamaTokensKey);
  if (it == pc.metadata.end() || tt == pc.metadata.end())
    throw vq::FormatError(fmt::format("{}: not compressed from a llama.cpp state (no {} / {} metadata): use -o or --keys-out", in,
                                      kLlamaStateKey, kLlamaTokensKey));
  auto bad = [&](const std::string& why) -> vq::FormatError {
    return vq::FormatError(fmt::format("{}: metadata {}: {}", in, kLlamaStateKey, why));
  };
  // Every field exactly as compress writes it: name=unsigned decimal (type: a name), in this order.
  vq::LlamaState st;
  std::map<std::string, std::string> f;
  std::stringstream ss(it->second);
  for (std::string kv; std::getline(ss, kv, ',');) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || f.count(kv.substr(0, eq))) throw bad(fmt::format("'{}' is not a new name=value field", printable(kv)));
    f[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  auto number = [&](const char* key, std::uint64_t max) -> std::uint64_t {
    const auto v = f.find(key);
    if (v == f.end()) throw bad(fmt::format("no {} field", key));
    const std::string& s = v->second;
    if (s.empty() || s.size() > 10 || s.find_first_not_of("0123456789") != std::string::npos || std::stoull(s) > max)
      throw bad(fmt::format("{}={} is not an integer in 0 .. {}", key, printable(s), max));
    return std::stoull(s);
  };
  const auto type = f.find("type");
  if (type == f.end()) throw bad("no type field");
  if (type->second == "f32") st.dtype = vq::DType::F32;
  else if (type->second == "f16") st.dtype = vq::DType::F16;
  else if (type->second == "bf16") st.dtype = vq::DType::BF16;
  else throw bad(fmt::format("type={} is not f32, f16 or bf16", printable(type->second)));
  st.v_trans = number("v_trans", 1) == 1;
  st.n_stream = static_cast<std::uint32_t>(number("n_stream", 0xffffffffu));
  st.stream = static_cast<std::uint32_t>(number("stream", 0xffffffffu));
  st.seq_id = static_cast<std::int32_t>(number("seq_id", 0x7fffffff));
  // server_tokens=1 (the state came from a llama-server slot file) is there only when set.
  st.server_tokens = f.count("server_tokens") && number("server_tokens", 1) == 1;
  if (f.size() != (f.count("server_tokens") ? 6u : 5u))
    throw bad("unknown fields (expected type, v_trans, n_stream, stream, seq_id and, from a llama-server slot, server_tokens)");
  if (st.n_stream == 0 || st.stream >= st.n_stream) throw bad(fmt::format("stream {} of {} streams", st.stream, st.n_stream));
  const std::string& toks = tt->second;
  std::size_t p = 0;
  while (p < toks.size()) {
    const std::size_t e = std::min(toks.find(',', p), toks.size());
    const std::string t = toks.substr(p, e - p);
    if (t.empty() || t.size() > 10 || t.find_first_not_of("0123456789") != std::string::npos || std::stoull(t) > 0x7fffffffu)
      throw vq::FormatError(fmt::format("{}: metadata {}: '{}' is not a token id", in, kLlamaTokensKey, printable(t)));
    st.tokens.push_back(static_cast<std::int32_t>(std::stoull(t)));
    p = e + 1;
    if (e + 1 == toks.size()) throw vq::FormatError(fmt::format("{}: metadata {}: ends in a comma", in, kLlamaTokensKey));
  }
  for (const auto& c : pc.caches) {
    const vq::KVState kv = c->state();
    st.layers.push_back({kv.keys, kv.values});
  }
  if (st.layers.empty() || st.layers[0].keys.dim(2) == 0) throw vq::FormatError(fmt::format("{}: holds no tokens: no llama.cpp state to write", in));
  if (st.layers[0].keys.dim(0) != 1) throw vq::FormatError(fmt::format("{}: holds a batch of {}: a llama.cpp state holds one sequence", in, st.layers[0].keys.dim(0)));
  for (const auto& l : st.layers)
    if (l.keys.dim(2) != st.layers[0].keys.dim(2))
      throw vq::FormatError(fmt::format("{}: its layers hold different token counts: no llama.cpp state", in));
  return st;
}

int run_decompress(const DecompressOptions& o) {
  const bool npy = !o.keys_out.empty() || !o.values_out.empty();
  vq::require((npy ? 1 : 0) + !o.out.empty() + !o.llama_state_out.empty() == 1,
              "give either -o OUT.safetensors, --keys-out K.npy --values-out V.npy or --llama-state-out OUT (one output)");
  vq::require(!npy || (!o.keys_out.empty() && !o.values_out.empty()), "--keys-out and --values-out go together");
  if (npy) require_distinct_outputs(o.keys_out, "--keys-out", o.values_out, "--values-out");
  vq::VqkvLoadOptions lo;
  lo.vq_models = vq_models_of(o.model);
  const vq::PromptCache pc = vq::load_prompt_cache(o.in, lo);
  if (!o.llama_state_out.empty()) {
    vq::require(o.layer < 0, "--layer applies to .npy output only");
    vq::save_llama_state(o.llama_state_out, llama_state_of(pc, o.in));
    return 0;
  }
  if (npy) {
    const int n = static_cast<int>(pc.caches.size());
    vq::require(o.layer >= 0 || n == 1, "{} holds {} layers: choose one with --layer I, or write them all with -o OUT.safetensors", o.in, n);
    const int l = o.layer >= 0 ? o.layer : 0;
    vq::require(l < n, "--layer {} is out of range (the file holds layers 0..{})", l, n - 1);
    const vq::KVState st = pc.caches[static_cast<std::size_t>(l)]->state();
    vq::write_npy(o.keys_out, st.keys.contiguous());
    vq::write_npy(o.values_out, st.values.contiguous());
    return 0;
  }
  vq::require(o.layer < 0, "--layer applies to .npy output only");
  std::vector<vq::KVPair> layers;
  for (const auto& c : pc.caches) {
    const vq::KVState st = c->state();
    layers.push_back({st.keys, st.values});
  }
  vq::write_kv_safetensors(o.out, layers, pc.metadata);
  return 0;
}

nlohmann::json bytes_json(const vq::VqkvBytes& b, double elements) {
  const double total = static_cast<double>(b.total());
  return {{"payload", b.payload},   {"tables", b.tables},       {"scales_zeros", b.scales_zeros},
          {"residual", b.residual}, {"headers", b.headers},     {"checksums", b.checksums},
          {"total", b.total()},     {"bits_per_element", elements > 0 ? 8.0 * total / elements : 0.0},
          {"ratio_to_fp16", elements > 0 ? total / (2.0 * elements) : 0.0}};
}

// A layer's configuration in one line: CacheGen's, or a vq layer's (its codes are counted under
// the keys: one CODES block holds both sides).
std::string config_text(const vq::VqkvLayerInfo& l) {
  if (l.config) return l.config->to_string();
  if (!l.vq) return "";
  const std::string model = l.vq_model ? fmt::format("model {:016x} layer {}, basis={},shape={},rope={},rope_theta={}", l.vq_model->fingerprint,
                                                     l.vq_model->layer, vq::vq_basis_name(l.vq_model->basis.basis),
                                                     l.vq_model->basis.shape ? "on" : "off", l.vq_model->basis.rope ? "on" : "off",
                                                     l.vq_model->basis.rope_theta) +
                                             (l.vq_model->basis.per_head ? ",block=head" : "")
                                       : std::string("no model (identity transforms)");
  return fmt::format("bits={},calib={},residual={},k_offset={},v_offset={}; {}; codes of both sides counted under keys", l.vq->bits, l.vq->calib,
                     l.vq->residual, l.vq->k_offset, l.vq->v_offset, model);
}

int run_inspect(const std::string& path, bool json) {
  const auto bytes = vq::read_file_bytes(path);
  vq::VqkvInfo in;
  try {
    in = vq::inspect_prompt_cache(bytes);
  } catch (const vq::FormatError& e) {
    throw vq::FormatError(fmt::format("{}: {}", path, e.what()));
  }
  const double slices = static_cast<double>(in.batch * in.heads);
  auto elements = [&](const vq::VqkvLayerInfo& l, int side) {
    return slices * static_cast<double>(l.offset) * static_cast<double>(side == 0 ? in.key_dim : in.value_dim);
  };
  vq::VqkvBytes sum = in.file;
  double all_elements = 0;
  for (const auto& l : in.layers) {
    sum.add(l.keys);
    sum.add(l.values);
    all_elements += elements(l, 0) + elements(l, 1);
  }
  vq::require(sum.total() == in.file_bytes, "internal error: the byte breakdown does not sum to the file size");
  if (json) {
    nlohmann::json j{{"file_bytes", in.file_bytes}, {"version", in.version}, {"dtype", vq::dtype_name(in.dtype)},
                     {"batch", in.batch}, {"heads", in.heads}, {"key_dim", in.key_dim}, {"value_dim", in.value_dim},
                     {"tokens", in.tokens}, {"chunk_tokens", in.chunk_tokens}, {"metadata", in.metadata},
                     {"file", bytes_json(in.file, 0)}, {"layers", nlohmann::json::array()}, {"total", bytes_json(sum, all_elements)}};
    for (std::size_t i = 0; i < in.layers.size(); ++i) {
      const auto& l = in.layers[i];
      j["layers"].push_back({{"layer", i}, {"kind", l.kind}, {"config", config_text(l)}, {"offset", l.offset},
                             {"quantized_keys", l.quantized_keys}, {"quantized_values", l.quantized_values},
                             {"keys", bytes_json(l.keys, elements(l, 0))}, {"values", bytes_json(l.values, elements(l, 1))}});
      if (l.vq) {
        nlohmann::json model = nullptr;
        if (l.vq_model)
          model = {{"fingerprint", fmt::format("{:016x}", l.vq_model->fingerprint)}, {"layer", l.vq_model->layer},
                   {"basis", vq::vq_basis_name(l.vq_model->basis.basis)}, {"shape", l.vq_model->basis.shape},
                   {"rope", l.vq_model->basis.rope}, {"rope_theta", l.vq_model->basis.rope_theta},
                   {"block", l.vq_model->basis.per_head ? "head" : "row"}};
        j["layers"].back()["vq"] = {{"bits", l.vq->bits}, {"calib", l.vq->calib}, {"residual", l.vq->residual},
                                    {"k_offset", l.vq->k_offset}, {"v_offset", l.vq->v_offset}, {"model", model}};
      }
    }
    // Metadata is bytes: invalid UTF-8 becomes U+FFFD (JSON strings are Unicode; dump() would throw),
    // and everything but printable ASCII is a \u escape (C1 controls would reach a terminal raw).
    fmt::print("{}\n", j.dump(2, ' ', true, nlohmann::json::error_handler_t::replace));
    return 0;
  }
  fmt::print("{}: .vqkv version {}, {} bytes\n", path, in.version, in.file_bytes);
  fmt::print("shape: {} layers x [B {}, H {}, S {}, D_k {} / D_v {}] {}, chunks of {} tokens\n", in.layers.size(), in.batch, in.heads,
             in.tokens, in.key_dim, in.value_dim, vq::dtype_name(in.dtype), in.chunk_tokens);
  for (const auto& [k, v] : in.metadata) fmt::print("metadata: {} = {}\n", printable(k), printable(v));  // no raw terminal escapes
  fmt::print("{:<6} {:<7} {:>10} {:>9} {:>12} {:>9} {:>8} {:>9} {:>11} {:>9} {:>8}\n", "layer", "side", "payload", "tables", "scales+zeros",
             "residual", "headers", "checksums", "total", "bits/elem", "vs fp16");
  auto row = [](const std::string& layer, const char* side, const vq::VqkvBytes& b, double el) {
    fmt::print("{:<6} {:<7} {:>10} {:>9} {:>12} {:>9} {:>8} {:>9} {:>11} {:>9} {:>8}\n", layer, side, b.payload, b.tables, b.scales_zeros,
               b.residual, b.headers, b.checksums, b.total(), el > 0 ? fmt::format("{:.3f}", 8.0 * static_cast<double>(b.total()) / el) : "-",
               el > 0 ? fmt::format("{:.3f}", static_cast<double>(b.total()) / (2.0 * el)) : "-");
  };
  for (std::size_t i = 0; i < in.layers.size(); ++i) {
    const auto& l = in.layers[i];
    fmt::print("layer {}: {} {} ({} tokens; closed: keys {}, values {})\n", i, l.kind, config_text(l), l.offset, l.quantized_keys,
               l.quantized_values);
    row(std::to_string(i), "keys", l.keys, elements(l, 0));
    row(std::to_string(i), "values", l.values, elements(l, 1));
  }
  row("file", "header", in.file, 0);
  row("all", "", sum, all_elements);
  fmt::print("the rows sum to the file size ({} bytes); every checksum verified\n", in.file_bytes);
  return 0;
}

}  // namespace

Runner add_compress(CLI::App& app) {
  auto o = std::make_shared<CompressOptions>();
  auto* kin = app.add_option("--keys", o->keys, "keys .npy [B, H, S, D], float32 or float16 (one layer)")->check(CLI::ExistingFile);
  app.add_option("--values", o->values, "values .npy [B, H, S, D]")->check(CLI::ExistingFile)->needs(kin);
  app.add_option("--kv", o->kv, "safetensors with layers.{i}.keys / layers.{i}.values [B, H, S, D]")->check(CLI::ExistingFile);
  app.add_option("--llama-state", o->llama_state, "a sequence state saved by llama.cpp (saveStateToFile; f32/f16/bf16 cache), with --model "
                                                  "the model it was saved from (docs/format.md)")->check(CLI::ExistingFile);
  add_model_options(app, o->model, o->tokenizer);
  app.add_option("--text", o->text, "text to run through the model (default: tinystories_val.txt beside the model)");
  app.add_option("--ctx", o->ctx, "tokens of the text (BOS first) to prefill through the model")->transform(integer_in(1, std::numeric_limits<int>::max()));
  app.add_option("--method", o->method, "cache method spec: cachegen[:bits=..,group=..,flush=..,schedule=..], vq[:bits=..,...] or fp32 "
                                        "(--llama-state: also fp16) (default: cachegen)");
  app.add_option("--bits", o->bits, "cachegen base bits (overrides the spec)")->transform(integer_in(1, 8));
  app.add_option("--group-size", o->group_size, "cachegen tokens per group (overrides the spec)")->transform(integer_in(1, std::numeric_limits<int>::max()));
  app.add_option("--flush", o->flush, "cachegen flush mode: per_call | group_aligned (overrides the spec)");
  app.add_option("--chunk", o->chunk, "tokens per update_and_fetch call (default: all at once)")->transform(integer_in(0, kMaxCount));
  app.add_option("--chunk-tokens", o->chunk_tokens, "tokens per block of the file (default 2048)")->transform(integer_in(1, kMaxCount));
  app.add_option("-o,--output", o->out, "output .vqkv file")->required();
  app.add_flag("--json", o->json, "print one JSON object");
  return [o] { return run_compress(*o); };
}

Runner add_decompress(CLI::App& app) {
  auto o = std::make_shared<DecompressOptions>();
  app.add_option("input", o->in, ".vqkv file")->required()->check(CLI::ExistingFile);
  app.add_option("-o,--output", o->out, "output safetensors (layers.{i}.keys / layers.{i}.values)");
  app.add_option("--keys-out", o->keys_out, "output keys .npy (one layer)");
  app.add_option("--values-out", o->values_out, "output values .npy (one layer)");
  app.add_option("--llama-state-out", o->llama_state_out, "output llama.cpp sequence state (loadStateFromFile), for a file compressed "
                                                          "from --llama-state");
  app.add_option("--layer", o->layer, "layer to write as .npy (required when the file holds several)")->transform(integer_in(0, std::numeric_limits<int>::max()));
  app.add_option("--model", o->model, "model (llama2.c checkpoint or GGUF) that vq layers were compressed with (default: looked up as compress does; "
                                      "a file of another model's fingerprint is refused)");
  return [o] { return run_decompress(*o); };
}

Runner add_inspect(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  app.add_option("input", *path, ".vqkv file")->required()->check(CLI::ExistingFile);
  app.add_flag("--json", *json, "print one JSON object");
  return [path, json] { return run_inspect(*path, *json); };
}

}  // namespace vqcli
