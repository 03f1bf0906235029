// veloxquant bench codec (bench attention: cmd_bench_attention.cpp): veloxquant's rANS against general-purpose coders on the same code streams.
//
// A "stream" is one side (K or V) of one CacheGenKVCache (group_aligned, no layer schedule, at
// --bits): every coder compresses each stream separately (one call per stream) and the bytes are
// summed, so every coder pays its per-call overhead (tables, frame headers, lane states) the same
// number of times. The peers get the codes channel-major (each channel's tokens contiguous), so
// their context models see the correlation along tokens that the per-channel models see.
// veloxquant-rans bytes are the stream codec's buffer (cache/stream_codec.hpp) minus its float32
// scales and minima, which the peers do not code either: header + tables + payload.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "bench_attention.hpp"
#include "bench_prompt_cache.hpp"
#include "commands.hpp"
#include "json_out.hpp"
#include "model_options.hpp"
#include "numeric_options.hpp"
#include "veloxquant/cache/attention.hpp"
#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/cache/stream_codec.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/input_file.hpp"
#include "veloxquant/core/npy.hpp"
#include "veloxquant/entropy/channel_histograms.hpp"
#include "veloxquant/entropy/context_coder.hpp"
#include "veloxquant/entropy/frequency_table.hpp"
#include "veloxquant/entropy/order1_coder.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "veloxquant/eval/model_windows.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/peers/peer_coders.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"
#include "veloxquant/transform/bit_pack.hpp"
#include "veloxquant/vq/codec.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace vqcli {

namespace {

struct BenchOptions {
  std::string keys, values, model, tokenizer, text, method;
  bool synthetic = false, json = false;
  int bits = 4, windows = 8;
};

struct Source {
  std::string name;
  std::vector<vq::QuantizedStream> streams;
  std::int64_t tokens_per_channel = 0;  // per stream
};

void add_cache_streams(Source& src, const vq::CacheGenKVCache& cache) {
  for (const auto* s : {&cache.key_stream(), &cache.value_stream()})
    if (s->quantized_tokens() > 0 && s->slices() > 0) src.streams.push_back(*s);
}

vq::KVCacheConfig bench_config(int bits) {
  vq::KVCacheConfig cfg;
  cfg.cachegen_bits = bits;
  cfg.cachegen_flush = vq::FlushMode::GroupAligned;
  cfg.validate();
  return cfg;
}

Source from_tensors(const vq::Tensor& k, const vq::Tensor& v, int bits, std::string name) {
  vq::require(k.dim(0) == v.dim(0) && k.dim(1) == v.dim(1) && k.dim(2) == v.dim(2) && k.dtype() == v.dtype(),
              "keys {} and values {} must agree in B, H, S and dtype", vq::shape_string(k.shape()), vq::shape_string(v.shape()));
  vq::CacheGenKVCache cache(bench_config(bits));
  cache.update_and_fetch(k, v);
  Source src{std::move(name), {}, cache.key_stream().quantized_tokens()};
  add_cache_streams(src, cache);
  return src;
}

// Runs the model over --windows context-length windows (eval/model_windows.hpp), fresh caches of
// `spec` for each, and hands every window's caches to `take`; returns the description of the run.
std::string run_model_windows(const BenchOptions& o, const vq::MethodSpec& spec, const std::function<void(const vq::WindowCaches&)>& take) {
  if (!std::filesystem::is_regular_file(o.model)) throw vq::IoError(fmt::format("{}: cannot open model (no such file)", o.model));
  const std::string tok_path = o.tokenizer.empty() ? beside_model(o.model, "tok512.bin") : o.tokenizer;
  const std::string text_path = o.text.empty() ? beside_model(o.model, "tinystories_val.txt") : o.text;
  vq::require(!text_path.empty(), "--text is required (no tinystories_val.txt beside the model)");
  const vq::ModelFiles files = vq::resolve_model_files(optional_path(o.model), optional_path(tok_path));
  vq::LoadedModel loaded = vq::load_model(files);
  vq::Transformer model(std::move(loaded.checkpoint));
  std::string text = vq::read_input_text(text_path, "text");
  const int window = model.config().seq_len;
  const std::size_t want = static_cast<std::size_t>(o.windows) * static_cast<std::size_t>(window) * 16;
  if (text.size() > want) text.resize(want);
  const std::vector<int> tokens = loaded.tokenizer.encode(text, /*bos=*/false);
  const int n_windows = vq::run_model_windows(model, tokens, o.windows, spec, take);
  vq::require(n_windows >= 1, "{}: too little text for one {}-token window", text_path, window);
  return fmt::format("model {} ({} windows x {} tokens, {} layers, K and V)", files.model.filename().string(), n_windows, window,
                     model.config().n_layers);
}

Source from_model(const BenchOptions& o) {
  vq::MethodSpec spec;
  spec.kind = vq::MethodSpec::Kind::CacheGen;
  spec.cachegen = bench_config(o.bits);
  spec.schedule = false;
  Source src;
  src.name = run_model_windows(o, spec, [&](const std::vector<std::shared_ptr<vq::KVCache>>& caches) {
    for (const auto& c : caches)
      if (const auto* cg = dynamic_cast<const vq::CacheGenKVCache*>(c.get())) {
        add_cache_streams(src, *cg);
        src.tokens_per_channel = cg->key_stream().quantized_tokens();
      }
  });
  return src;
}

// Codes of a stream, channel-major: [slice][channel][token].
std::vector<std::uint8_t> channel_major(const vq::QuantizedStream& s) {
  const auto n = static_cast<std::size_t>(s.quantized_tokens()), d = static_cast<std::size_t>(s.dim());
  std::vector<std::uint8_t> out;
  out.reserve(n * d * static_cast<std::size_t>(s.slices()));
  for (std::int64_t sl = 0; sl < s.slices(); ++sl) {
    const auto codes = s.codes(sl);
    for (std::size_t c = 0; c < d; ++c)
      for (std::size_t t = 0; t < n; ++t) out.push_back(codes[t * d + c]);
  }
  return out;
}

// A stream's codes as the order-1 coder (entropy/order1_coder.hpp) takes them, unpacked into `keep`
// (its timing has always included the unpacking); without `keep`, the shape alone (for decoding).
vq::Order1Codes order1_codes(const vq::QuantizedStream& s, std::vector<std::vector<std::uint8_t>>* keep) {
  vq::Order1Codes c{{}, static_cast<std::size_t>(s.quantized_tokens()), static_cast<std::size_t>(s.dim()), s.bits()};
  if (keep) keep->reserve(static_cast<std::size_t>(s.slices()));
  for (std::int64_t sl = 0; sl < s.slices(); ++sl) {
    if (keep) keep->push_back(s.codes(sl));
    c.slices.push_back(keep ? std::span<const std::uint8_t>(keep->back()) : std::span<const std::uint8_t>());
  }
  return c;
}

struct CoderResult {
  std::string name;
  std::uint64_t bytes = 0;
  double encode_s = 0, decode_s = 0;
  bool roundtrip_ok = true;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs encode over every stream (then decode and compare), repeating while a pass took < 0.2 s
// in total (at most 5 passes), and keeps each side's fastest pass.
CoderResult measure(const std::string& name, std::size_t n_streams,
                    const std::function<std::vector<std::uint8_t>(std::size_t)>& enc,
                    const std::function<std::uint64_t(const std::vector<std::uint8_t>&)>& counted,
                    const std::function<bool(std::size_t, const std::vector<std::uint8_t>&)>& dec_ok) {
  CoderResult r;
  r.name = name;
  r.encode_s = r.decode_s = 1e300;
  std::vector<std::vector<std::uint8_t>> bufs(n_streams);
  double spent = 0;
  for (int pass = 0; pass < 5 && (pass == 0 || spent < 0.2); ++pass) {
    auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < n_streams; ++i) bufs[i] = enc(i);
    const double te = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    bool ok = true;
    for (std::size_t i = 0; i < n_streams; ++i) ok = dec_ok(i, bufs[i]) && ok;
    const double td = seconds_since(t0);
    r.encode_s = std::min(r.encode_s, te);
    r.decode_s = std::min(r.decode_s, td);
    r.roundtrip_ok = r.roundtrip_ok && ok;
    spent += te + td;
  }
  for (const auto& b : bufs) r.bytes += counted(b);
  return r;
}

// ---- bench codec --method vq:... : our method's codes (vq/codec.hpp) against the peers ----
// One "layer" is one VqKVCache's quantized codes (K and V sides, [rows, n] row-major int16): our
// coder codes it with vq_encode (header, models and rANS stream: every byte the cache bills for
// its codes), the peers get the same codes row-major, K then V, one byte per code when every code
// of the run fits int8, else two (little-endian int16), one call per layer.
struct VqSource {
  std::string name;
  std::vector<vq::VqLayerCodes> layers;
};

void add_vq_layers(VqSource& src, const std::vector<std::shared_ptr<vq::KVCache>>& caches) {
  for (const auto& c : caches)
    if (const auto* v = dynamic_cast<const vq::VqKVCache*>(c.get()); v && v->quantized_tokens() > 0) src.layers.push_back(v->codes());
}

VqSource vq_from_tensors(const vq::Tensor& k, const vq::Tensor& v, const vq::MethodSpec& spec, std::string name) {
  vq::require(k.dim(0) == v.dim(0) && k.dim(1) == v.dim(1) && k.dim(2) == v.dim(2) && k.dtype() == v.dtype(),
              "keys {} and values {} must agree in B, H, S and dtype", vq::shape_string(k.shape()), vq::shape_string(v.shape()));
  auto cache = std::make_shared<vq::VqKVCache>(spec.vq);  // no model: identity transforms
  cache->update_and_fetch(k, v);
  VqSource src{std::move(name), {}};
  add_vq_layers(src, {cache});
  return src;
}

int run_bench_codec_vq(const BenchOptions& o, const vq::MethodSpec& spec) {
  VqSource src;
  if (o.synthetic) {
    vq::SyntheticKVConfig sc;
    sc.tokens = 4096;
    const auto kv = vq::make_synthetic_kv(sc);
    src = vq_from_tensors(kv.keys, kv.values, spec,
                          "synthetic (make_synthetic_kv: 1 x 8 heads x 4096 tokens x D=128: a 7B-shaped layer, identity transforms)");
  } else if (!o.model.empty()) {
    src.name = run_model_windows(o, spec, [&](const std::vector<std::shared_ptr<vq::KVCache>>& caches) { add_vq_layers(src, caches); }) +
               " (the model's transforms)";
  } else {
    vq::require(!o.keys.empty() && !o.values.empty(), "--keys and --values go together");
    src = vq_from_tensors(vq::read_npy(o.keys), vq::read_npy(o.values), spec, fmt::format("{} / {} (identity transforms)", o.keys, o.values));
  }
  vq::require(!src.layers.empty(), "no quantized token in the input (fewer tokens than calib={}?)", spec.vq.calib);
  const std::size_t nl = src.layers.size();
  bool fits8 = true;
  std::uint64_t symbols = 0;
  for (const auto& l : src.layers)
    for (const auto* s : {&l.k, &l.v}) {
      symbols += s->codes.size();
      for (const auto q : s->codes) fits8 &= q >= -128 && q <= 127;
    }
  std::vector<std::vector<std::uint8_t>> raw(nl);
  for (std::size_t i = 0; i < nl; ++i)
    for (const auto* s : {&src.layers[i].k, &src.layers[i].v})
      for (const auto q : s->codes) {
        raw[i].push_back(static_cast<std::uint8_t>(q));
        if (!fits8) raw[i].push_back(static_cast<std::uint8_t>(static_cast<std::uint16_t>(q) >> 8));
      }
  const auto max_codes = [&](std::size_t i) {
    return static_cast<std::uint64_t>(src.layers[i].rows() * (src.layers[i].k.n + src.layers[i].v.n));
  };
  const auto same = [](const vq::VqLayerCodes& a, const vq::VqLayerCodes& b) { return a.k.codes == b.k.codes && a.v.codes == b.v.codes; };
  // Untimed warm-up: 0.2 s of our coder.
  for (const auto t0 = std::chrono::steady_clock::now(); seconds_since(t0) < 0.2;)
    for (std::size_t i = 0; i < nl; ++i) (void)vq::vq_decode(vq::vq_encode(src.layers[i]), max_codes(i));
  std::vector<CoderResult> results;
  results.push_back(measure(
      "veloxquant-vq", nl, [&](std::size_t i) { return vq::vq_encode(src.layers[i]); },
      [](const std::vector<std::uint8_t>& b) { return static_cast<std::uint64_t>(b.size()); },
      [&](std::size_t i, const std::vector<std::uint8_t>& b) { return same(vq::vq_decode(b, max_codes(i)), src.layers[i]); }));
  for (const auto& peer : vq::peer_coders(8))  // bytes as they are: no bit packing
    results.push_back(measure(
        peer.name, nl, [&](std::size_t i) { return peer.encode(raw[i]); },
        [](const std::vector<std::uint8_t>& b) { return static_cast<std::uint64_t>(b.size()); },
        [&](std::size_t i, const std::vector<std::uint8_t>& b) { return peer.decode(b, raw[i].size()) == raw[i]; }));
  const double msym = static_cast<double>(symbols) / 1e6;
  const std::uint64_t raw_bytes = symbols * (fits8 ? 1 : 2);
  if (o.json) {
    nlohmann::json j;
    j["source"] = src.name;
    j["method"] = spec.to_string();
    j["layers"] = nl;
    j["symbols"] = symbols;
    j["peer_input"] = fits8 ? "int8" : "int16";
    j["peer_input_bytes"] = raw_bytes;
    j["coders"] = nlohmann::json::array();
    for (const auto& r : results)
      j["coders"].push_back({{"name", r.name},
                             {"bytes", r.bytes},
                             {"bits_per_symbol", 8.0 * static_cast<double>(r.bytes) / static_cast<double>(symbols)},
                             {"encode_msym_s", msym / r.encode_s},
                             {"decode_msym_s", msym / r.decode_s},
                             {"roundtrip_ok", r.roundtrip_ok}});
    fmt::print("{}\n", json_text(j));
  } else {
    fmt::print("source: {}\n", src.name);
    fmt::print("method {}: {} layers, {} codes; peers get them as {} ({} B)\n", spec.to_string(), nl, symbols, fits8 ? "int8" : "int16",
               raw_bytes);
    fmt::print("{:<24} {:>10} {:>9} {:>10} {:>10} {:>6}\n", "coder", "bytes", "bits/sym", "enc Msym/s", "dec Msym/s", "ok");
    for (const auto& r : results)
      fmt::print("{:<24} {:>10} {:>9.4f} {:>10.1f} {:>10.1f} {:>6}\n", r.name, r.bytes, 8.0 * static_cast<double>(r.bytes) / static_cast<double>(symbols),
                 msym / r.encode_s, msym / r.decode_s, r.roundtrip_ok ? "yes" : "NO");
    fmt::print("(one call per layer; veloxquant-vq bytes are vq_encode's whole output: header, steps, offsets, models, rANS stream)\n");
  }
  for (const auto& r : results)
    if (!r.roundtrip_ok) {
      fmt::print(stderr, "veloxquant: error: {} did not round-trip\n", r.name);
      return 1;
    }
  return 0;
}

int run_bench_codec(const BenchOptions& o) {
  if (!o.method.empty()) {
    const vq::MethodSpec spec = vq::MethodSpec::parse(o.method);
    vq::require(spec.kind == vq::MethodSpec::Kind::Vq, "--method takes our method's specs (vq:bits=B,...), got '{}'", o.method);
    const int n_sources = (!o.keys.empty() || !o.values.empty()) + !o.model.empty() + o.synthetic;
    vq::require(n_sources == 1, "give exactly one source: --keys K.npy --values V.npy, --model M, or --synthetic");
    return run_bench_codec_vq(o, spec);
  }
  const int n_sources = (!o.keys.empty() || !o.values.empty()) + !o.model.empty() + o.synthetic;
  vq::require(n_sources == 1, "give exactly one source: --keys K.npy --values V.npy, --model M, or --synthetic");
  Source src;
  if (o.synthetic) {
    vq::SyntheticKVConfig sc;
    sc.tokens = 4096;
    const auto kv = vq::make_synthetic_kv(sc);
    src = from_tensors(kv.keys, kv.values, o.bits, "synthetic (make_synthetic_kv: 1 x 8 heads x 4096 tokens x D=128, K and V)");
  } else if (!o.model.empty()) {
    src = from_model(o);
  } else {
    vq::require(!o.keys.empty() && !o.values.empty(), "--keys and --values go together");
    src = from_tensors(vq::read_npy(o.keys), vq::read_npy(o.values), o.bits, fmt::format("{} / {}", o.keys, o.values));
  }
  vq::require(!src.streams.empty(), "no closed quantization group in the input (fewer tokens than the group size?)");

  const auto& streams = src.streams;
  const std::size_t ns = streams.size();
  std::vector<std::vector<std::uint8_t>> cm(ns);
  std::uint64_t symbols = 0, fixed = 0;
  for (std::size_t i = 0; i < ns; ++i) {
    cm[i] = channel_major(streams[i]);
    symbols += cm[i].size();
    fixed += vq::packed_size(cm[i].size(), o.bits);
  }

  // Shannon bounds: sum over (stream, slice, channel) of N * H, for codes, deltas and order-1.
  double h_codes = 0, h_delta = 0, h_o1 = 0;
  {
    const int A = 1 << o.bits;
    for (std::size_t i = 0; i < ns; ++i) {
      const auto& s = streams[i];
      const auto n = static_cast<std::size_t>(s.quantized_tokens());
      const std::size_t chans = static_cast<std::size_t>(s.slices() * s.dim());
      vq::ChannelHistograms hc(chans, 0, A), hd(chans, -(A - 1), 2 * A - 1), h1(chans * static_cast<std::size_t>(A), 0, A);
      for (std::size_t ch = 0; ch < chans; ++ch) {
        const std::uint8_t* x = cm[i].data() + ch * n;
        int prev = 0;
        for (std::size_t t = 0; t < n; ++t) {
          hc.add(ch, x[t]);
          hd.add(ch, x[t] - prev);
          h1.add(ch * static_cast<std::size_t>(A) + static_cast<std::size_t>(prev), x[t]);
          prev = x[t];
        }
      }
      for (std::size_t k = 0; k < hc.count(); ++k) h_codes += hc.total_bits(k), h_delta += hd.total_bits(k);
      for (std::size_t k = 0; k < h1.count(); ++k) h_o1 += h1.total_bits(k);
    }
  }
  // The bound of the default coder's own model, and what that model costs: for the context coder
  // (bits <= 4) the codes' empirical entropy given the classes its model chose per stream, and the
  // model's serialised bytes; for per-channel tables the order-0 bound and the tables' bytes.
  const vq::SymbolTransform def = vq::default_transform(o.bits);
  double h_ctx = 0;
  std::uint64_t default_tables = 0;
  for (std::size_t i = 0; i < ns; ++i) {
    const auto& s = streams[i];
    if (def != vq::SymbolTransform::Context) {
      vq::EncodedStreamSize size;
      (void)vq::encode_stream(s, {}, size);
      default_tables += size.tables;
      continue;
    }
    const auto n = static_cast<std::size_t>(s.quantized_tokens()), d = static_cast<std::size_t>(s.dim());
    const vq::ContextLayout layout = vq::context_layout(s);
    const auto codes = vq::context_slices(s);
    const vq::ContextModel model = vq::ContextModel::build(vq::ContextSlices(codes), layout);
    default_tables += model.serialized_size();
    const int A = 1 << o.bits;
    vq::ChannelHistograms hk(static_cast<std::size_t>(model.classes()), 0, A);
    for (const auto& c : codes)
      for (std::size_t t = 0; t < n; ++t)
        for (std::size_t ch = 0; ch < d; ++ch)
          hk.add(static_cast<std::size_t>(model.class_of(layout.group_start[t] ? A : c[(t - 1) * d + ch])), c[t * d + ch]);
    for (std::size_t k = 0; k < hk.count(); ++k) h_ctx += hk.total_bits(k);
  }
  const auto to_bytes = [](double b) { return static_cast<std::uint64_t>(std::ceil(b / 8.0)); };
  const std::uint64_t shannon_codes = to_bytes(h_codes), shannon_delta = to_bytes(h_delta), shannon_o1 = to_bytes(h_o1);
  const std::uint64_t shannon_context = to_bytes(h_ctx);
  const std::uint64_t shannon_default = def == vq::SymbolTransform::Context ? shannon_context : shannon_codes;

  // Untimed warm-up (CPU clock, caches, allocator, one-time tables): 0.2 s of the default coder,
  // else the first row measured reads slower than the same coder measured later.
  for (const auto t0 = std::chrono::steady_clock::now(); seconds_since(t0) < 0.2;)
    for (const auto& s : streams) {
      const auto b = vq::encode_stream(s);
      (void)vq::decode_stream(b, static_cast<std::uint64_t>(s.slices() * s.quantized_tokens() * s.dim()));
    }

  std::vector<CoderResult> results;
  const auto vq_rans = [&](const std::string& name, vq::SymbolTransform tr) {  // the stream codec with this transform
    vq::StreamCodecOptions opt;
    opt.transform = tr;
    return measure(
        name, ns, [&](std::size_t i) { return vq::encode_stream(streams[i], opt); },
        [](const std::vector<std::uint8_t>& b) { return static_cast<std::uint64_t>(b.size()); },
        [&](std::size_t i, const std::vector<std::uint8_t>& b) {
          const auto ds = vq::decode_stream(b, cm[i].size());
          for (std::int64_t sl = 0; sl < streams[i].slices(); ++sl) {
            const auto a = streams[i].codes(sl);
            const auto c = ds.slice_codes(sl);
            if (!std::equal(a.begin(), a.end(), c.begin(), c.end())) return false;
          }
          return true;
        });
  };
  results.push_back(vq_rans("veloxquant-rans", vq::default_transform(o.bits)));
  results.push_back(vq_rans("veloxquant-rans-codes", vq::SymbolTransform::Codes));
  results.push_back(vq_rans("veloxquant-rans-delta", vq::SymbolTransform::TokenDelta));
  if (o.bits <= vq::kContextMaxBits) results.push_back(vq_rans("veloxquant-rans-context", vq::SymbolTransform::Context));
  // Subtract the float32 metadata, the same for every transform: 8 bytes per (group, channel, slice).
  std::uint64_t meta_bytes = 0;
  for (const auto& s : streams) meta_bytes += static_cast<std::uint64_t>(s.n_groups() * s.dim() * s.slices()) * 8;
  for (auto& r : results) r.bytes -= meta_bytes;
  for (const bool pooled : {false, true})
    results.push_back(measure(
        pooled ? "veloxquant-rans-order1-pooled" : "veloxquant-rans-order1", ns,
        [&](std::size_t i) {
          std::vector<std::vector<std::uint8_t>> unpacked;
          return vq::order1_encode(order1_codes(streams[i], &unpacked), pooled);
        },
        [](const std::vector<std::uint8_t>& b) { return static_cast<std::uint64_t>(b.size()); },
        [&](std::size_t i, const std::vector<std::uint8_t>& b) { return vq::order1_decode(b, order1_codes(streams[i], nullptr), pooled) == cm[i]; }));
  for (const auto& peer : vq::peer_coders(o.bits))
    results.push_back(measure(
        peer.name, ns, [&](std::size_t i) { return peer.encode(cm[i]); },
        [](const std::vector<std::uint8_t>& b) { return static_cast<std::uint64_t>(b.size()); },
        [&](std::size_t i, const std::vector<std::uint8_t>& b) { return peer.decode(b, cm[i].size()) == cm[i]; }));

  const double fp16_mb = static_cast<double>(symbols) * 2.0 / 1e6;
  const double msym = static_cast<double>(symbols) / 1e6;
  if (o.json) {
    nlohmann::json j;
    j["source"] = src.name;
    j["bits"] = o.bits;
    j["streams"] = ns;
    j["symbols"] = symbols;
    j["tokens_per_channel"] = src.tokens_per_channel;
    j["shannon_bytes"] = shannon_default;
    j["default_model_table_bytes"] = default_tables;
    j["default_vs_bound"] = static_cast<double>(results[0].bytes) / static_cast<double>(shannon_default + default_tables);
    j["shannon_codes_bytes"] = shannon_codes;
    j["shannon_delta_bytes"] = shannon_delta;
    j["shannon_order1_bytes"] = shannon_o1;
    if (def == vq::SymbolTransform::Context) j["shannon_context_bytes"] = shannon_context;
    j["fixed_width_bytes"] = fixed;
    j["coders"] = nlohmann::json::array();
    for (const auto& r : results)
      j["coders"].push_back({{"name", r.name},
                             {"bytes", r.bytes},
                             {"ratio_to_fixed_width", static_cast<double>(r.bytes) / static_cast<double>(fixed)},
                             {"bits_per_symbol", 8.0 * static_cast<double>(r.bytes) / static_cast<double>(symbols)},
                             {"encode_msym_s", msym / r.encode_s},
                             {"decode_msym_s", msym / r.decode_s},
                             {"encode_mb_s", fp16_mb / r.encode_s},
                             {"decode_mb_s", fp16_mb / r.decode_s},
                             {"roundtrip_ok", r.roundtrip_ok}});
    fmt::print("{}\n", json_text(j));
  } else {
    fmt::print("source: {}\n", src.name);
    fmt::print("{} streams, {} symbols ({} tokens per channel), {}-bit codes\n", ns, symbols, src.tokens_per_channel, o.bits);
    fmt::print("Shannon bound (sum over channels of N*H): codes {} B ({:.4f} bits/sym), token delta {} B ({:.4f}), order-1 {} B ({:.4f})\n",
               shannon_codes, 8.0 * static_cast<double>(shannon_codes) / static_cast<double>(symbols), shannon_delta,
               8.0 * static_cast<double>(shannon_delta) / static_cast<double>(symbols), shannon_o1,
               8.0 * static_cast<double>(shannon_o1) / static_cast<double>(symbols));
    fmt::print("fixed width (bit-packed): {} B\n", fixed);
    fmt::print("default coder ({}): its model's bound {} B ({:.4f} bits/sym) + its tables {} B; coded / (bound + tables) = {:.4f}\n",
               def == vq::SymbolTransform::Context ? "context model" : "per-channel order-0", shannon_default,
               8.0 * static_cast<double>(shannon_default) / static_cast<double>(symbols), default_tables,
               static_cast<double>(results[0].bytes) / static_cast<double>(shannon_default + default_tables));
    fmt::print("{:<24} {:>10} {:>7} {:>9} {:>10} {:>10} {:>10} {:>10} {:>6}\n", "coder", "bytes", "ratio", "bits/sym", "enc Msym/s",
               "dec Msym/s", "enc MB/s", "dec MB/s", "ok");
    for (const auto& r : results)
      fmt::print("{:<24} {:>10} {:>7.4f} {:>9.4f} {:>10.1f} {:>10.1f} {:>10.1f} {:>10.1f} {:>6}\n", r.name, r.bytes,
                 static_cast<double>(r.bytes) / static_cast<double>(fixed), 8.0 * static_cast<double>(r.bytes) / static_cast<double>(symbols),
                 msym / r.encode_s, msym / r.decode_s, fp16_mb / r.encode_s, fp16_mb / r.decode_s, r.roundtrip_ok ? "yes" : "NO");
    fmt::print("(one call per stream = cache side; peers get codes channel-major; veloxquant-rans is the cache's default ({}); its bytes\n"
               " exclude the float32 scales and minima; MB/s = MB of fp16 K/V represented; order1: per-(channel, context) histograms +\n"
               " grouped rANS segments; order1-pooled: one set of context histograms per stream, shared by its channels)\n",
               def == vq::SymbolTransform::Context ? "veloxquant-rans-context" : "veloxquant-rans-codes");
  }
  for (const auto& r : results)
    if (!r.roundtrip_ok) {
      fmt::print(stderr, "veloxquant: error: {} did not round-trip\n", r.name);
      return 1;
    }
  return 0;
}

}  // namespace

Runner add_bench(CLI::App& app) {
  app.require_subcommand(1);
  auto o = std::make_shared<BenchOptions>();
  CLI::App* codec = app.add_subcommand("codec", "veloxquant's rANS against htscodecs, zstd and lz4 on the same KV code streams");
  codec->add_option("--keys", o->keys, "keys .npy [B, H, S, D]");
  codec->add_option("--values", o->values, "values .npy [B, H, S, D]");
  codec->add_option("--model", o->model, "llama2.c checkpoint: codes of every layer's K and V over --windows context-length windows");
  codec->add_option("--tokenizer", o->tokenizer, "llama2.c tokenizer (default: tok512.bin beside the model)");
  codec->add_option("--text", o->text, "text to run (default: tinystories_val.txt beside the model)");
  codec->add_option("--windows", o->windows, "model: windows of seq_len tokens, each a fresh set of caches")
      ->capture_default_str()
      ->transform(integer_in(1, 1 << 20));
  codec->add_flag("--synthetic", o->synthetic, "synthetic LLM-like K/V (8 heads x 4096 tokens x D=128)");
  codec->add_option("--bits", o->bits, "bits per code, 1..8")->capture_default_str()->transform(integer_in(1, 8));
  codec->add_option("--method", o->method,
                    "our method instead of CacheGen streams: vq:bits=B,... (its spec); its layers' codes with vq_encode against the peers");
  codec->add_flag("--json", o->json, "print one JSON object");
  auto a = std::make_shared<BenchAttentionOptions>();
  CLI::App* attention = app.add_subcommand("attention", "one decode step of attention over each storage form (dense fp32/fp16, llama.cpp blocks, ...)");
  attention->add_option("--context", a->contexts, "context lengths in tokens (repeatable)")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  attention->add_option("--methods", a->methods, "storage forms besides fp32 and fp16: method specs, ';'-separated or repeated")
      ->delimiter(';')
      ->capture_default_str();
  attention->add_option("--threads", a->threads,
                        "threads that attend uses (flash decoding: a long context's token splits side by side); 0 = every core. "
                        "memcpy stays one thread")
      ->capture_default_str()
      ->transform(integer_in(0, vq::kMaxAttentionThreads));
  attention->add_option("--rounds", a->rounds,
                        "rounds per context, each timing memcpy and one step of every form in a rotated order; medians and paired "
                        "ratios over rounds are reported")
      ->capture_default_str()
      ->transform(integer_in(1, 1000));
  attention->add_flag("--json", a->json,
                      "print one JSON object: {memcpy_gb_s, threads, clock, rounds, rows: [{method, context, us_per_step, resident_bytes, "
                      "speedup_vs_fp16, speedup_vs_fp16_min, speedup_vs_fp16_max, vs_memcpy}]}");
#ifdef VQ_HAVE_PROMPT_CACHE
  auto pc = std::make_shared<BenchPromptCacheOptions>();
  CLI::App* prompt_cache = app.add_subcommand(
      "prompt-cache", "time to first token through `veloxquant prompt-cache` (hits from each store) against llama-server recomputing");
  prompt_cache->add_option("--llama-server", pc->llama_server, "llama-server binary (default .llama/bin/llama-server, else on PATH)");
  prompt_cache->add_flag("--realistic", pc->realistic,
                         "a llama-shaped GGUF from a seed (dim 768, 12 layers, 12/4 heads of 64, Q8_0) instead of stories260K");
  prompt_cache->add_option("--tokens", pc->tokens, "prompt tokens after BOS")->capture_default_str()->transform(integer_in(1, 1 << 20));
  prompt_cache->add_option("--chunk-tokens", pc->chunk_tokens, "tokens per stored chunk")->capture_default_str()->transform(integer_in(1, 1 << 20));
  prompt_cache->add_option("--levels", pc->levels, "what the proxy stores: method specs, ';'-separated; auto: the proxy's default for the model's heads")->delimiter(';')->capture_default_str();
  prompt_cache->add_option("--stores", pc->stores, "stores to time, ;-separated: file:auto, redis:auto (servers of the bench's own; options may follow, e.g. redis:auto?ram=512M for the RAM tier in front of it) or URLs")
      ->delimiter(';')
      ->capture_default_str();
  prompt_cache->add_option("--rounds", pc->rounds, "rounds (each a hit and a recompute)")->capture_default_str()->transform(integer_in(1, 1000));
  prompt_cache->add_option("--threads", pc->threads, "llama-server's -t")->capture_default_str()->transform(integer_in(1, 1024));
  prompt_cache->add_option("--slot-dir", pc->slot_dir,
                           "the server's --slot-save-path, where the proxy writes slot files (default: a folder of the bench's own in /dev/shm, else in the temporary directory)");
  prompt_cache->add_option("--settle-ms", pc->settle_ms,
                           "idle milliseconds before each timed request, so it starts on an idle server (llama.cpp's threads poll for work after a request); 0: back to back")
      ->capture_default_str()
      ->transform(integer_in(0, 600000));
  prompt_cache->add_option("--seed", pc->seed, "seed of the prompt (and of --realistic's weights)")->capture_default_str();
  prompt_cache->add_flag("--verbose", pc->verbose, "the proxy's line per request (what it restored and where the time went) on stderr");
  prompt_cache->add_flag("--json", pc->json, "print one JSON object: {model, prompt_tokens, chunk_tokens, levels, rounds, threads, settle_ms, rows: [...]}");
  return [o, a, attention, pc, prompt_cache] {
    if (prompt_cache->parsed()) return run_bench_prompt_cache(*pc);
    return attention->parsed() ? run_bench_attention(*a) : run_bench_codec(*o);
  };
#else
  return [o, a, attention] { return attention->parsed() ? run_bench_attention(*a) : run_bench_codec(*o); };
#endif
}

}  // namespace vqcli
