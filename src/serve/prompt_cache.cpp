// The prompt-cache proxy (serve/prompt_cache.hpp): HTTP in front of llama-server (cpp-httplib),
// the store's lookup, loader and put (store/), and llama.cpp's slot files (format/llama_state.hpp).
#include "veloxquant/serve/prompt_cache.hpp"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "veloxquant/core/error.hpp"
#include "veloxquant/format/llama_state.hpp"
#include "veloxquant/format/llama_state_image.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/gguf.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/kv_store.hpp"
#include "veloxquant/store/prefix_chunks.hpp"
#include "veloxquant/store/prefix_loader.hpp"
#include "llama_http.hpp"

namespace vq {

namespace {

using json = nlohmann::json;

// Bodies a proxy buffers (a request, a non-streaming reply); larger ones are refused, not read.
constexpr std::size_t kMaxBodyBytes = serve_detail::kMaxLlamaBodyBytes;

// host and port of http://HOST:PORT[/]; InvalidArgument otherwise (no TLS: the server is local).
std::pair<std::string, int> parse_upstream(const std::string& url) {
  const std::string scheme = "http://";
  require(url.rfind(scheme, 0) == 0, "--upstream {}: give the llama-server as http://HOST:PORT", url);
  std::string rest = url.substr(scheme.size());
  if (!rest.empty() && rest.back() == '/') rest.pop_back();
  const auto colon = rest.rfind(':');
  require(colon != std::string::npos && colon > 0 && rest.find('/') == std::string::npos, "--upstream {}: give it as http://HOST:PORT", url);
  int port = 0;
  const std::string p = rest.substr(colon + 1);
  require(!p.empty() && p.size() <= 5 && p.find_first_not_of("0123456789") == std::string::npos && (port = std::stoi(p)) >= 1 && port <= 65535,
          "--upstream {}: port '{}' is not in 1..65535", url, p);
  return {rest.substr(0, colon), port};
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

}  // namespace

// The slot image's buffers (format/llama_state_image.hpp) kept between restores, at most: 256 MiB
// holds a 2,048-token prefix of a 7B-shaped model's F16 cache (32 layers x 8 KV heads of 128, 128
// KiB a token), or 21,845 tokens of bench prompt-cache's realistic shape (12 KiB a token).
constexpr std::size_t kKeepImageBytes = std::size_t{256} << 20;

struct PromptCacheProxy::Impl {
  PromptCacheOptions o;
  std::string host;
  int port = 0;
  // The model, when our GGUF reader loads its weights (llama2.c-shaped llama with F32/F16/Q8_0
  // tensors): `vq` levels then take their transforms from them. Otherwise (K-quant weights, other
  // RoPE bases, tokenizers or architectures) only its shape is read (GgufShape) and `vq` levels code
  // K/V without a transform unless they name a profile (vq/profile.hpp; `veloxquant calibrate`);
  // the fingerprint is then the whole file's.
  std::unique_ptr<Transformer> model;
  ModelDescription description;  // per layer: the head size (the shape-only caches)
  int kv_heads = 0, head_size = 0;
  std::uint64_t fingerprint = 0;
  std::vector<std::shared_ptr<const VqProfile>> profiles;  // of the vq levels that name one (profile=PATH)
  std::unique_ptr<KVStore> store;
  LlamaStateModel shape;
  LlamaState layout;                // the server's slot files: type, V layout, streams (no layers)
  std::unique_ptr<LlamaStateImage> image;  // restores decode into it (made with the first; one slot at a time)
  std::vector<std::int32_t> slot_tokens;  // what the slot holds, as last saved or restored by us
  // One request through the cache at a time, from its lookup until its slot is stored: a gate any
  // thread may open (the storing runs on a thread of its own after the reply went out).
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool gate_busy = false;
  struct Pass {  // holds the gate; opens it when the last holder lets go
    Impl& m;
    explicit Pass(Impl& impl) : m(impl) {
      std::unique_lock<std::mutex> l(m.gate_mu);
      m.gate_cv.wait(l, [&] { return !m.gate_busy; });
      m.gate_busy = true;
    }
    ~Pass() {
      {
        std::lock_guard<std::mutex> l(m.gate_mu);
        m.gate_busy = false;
      }
      m.gate_cv.notify_all();
    }
  };
  // The last storing thread (it holds a Pass while it runs); joined by the next and at the end.
  std::mutex afters_mu;
  std::thread after_thread;
  httplib::Server server;
  int bound_port = 0;

  explicit Impl(PromptCacheOptions options)
      : o(std::move(options)) {
    require_file(o.model);
    std::tie(host, port) = parse_upstream(o.upstream);
    require(!o.slot_dir.empty() && std::filesystem::is_directory(o.slot_dir),
            "--slot-dir {}: not a directory (give the llama-server's --slot-save-path)", o.slot_dir);
    require(o.chunk_tokens >= 1 && o.chunk_tokens <= 1 << 20, "--chunk-tokens {} is not in 1..2^20", o.chunk_tokens);
    require(o.slot >= 0, "--slot {} must be >= 0", o.slot);
    require(!o.levels.empty(), "--levels: give at least one method spec");
    for (auto& l : o.levels) l = MethodSpec::parse(l).to_string();
    if (!o.log) o.log = [](const std::string& line) { fmt::print(stderr, "veloxquant prompt-cache: {}\n", line); };
    const GgufShape g = load_gguf_shape(o.model);  // a malformed file fails here, with its own message
    std::string why;
    if (auto m = load_gguf_if_ours(o.model, g, why)) {
      model = std::make_unique<Transformer>(std::move(m->checkpoint));
    } else {
      require(g.key_length == g.value_length, "{}: key length {} and value length {} differ, which the prompt cache does not support",
              o.model, g.key_length, g.value_length);
      o.log(fmt::format("{}: its weights are not ours to read ({}); its shape is ({} layers, {} KV heads of {}): vq levels have no "
                        "transform from the weights (a level with profile=PATH from `veloxquant calibrate` gets one)",
                        o.model, why, g.n_layers, g.n_kv_heads, g.key_length));
      shape = {g.n_layers, g.n_kv_heads, g.key_length, g.value_length};
      fingerprint = g.fingerprint;
    }
    if (model) {
      const ModelConfig& c = model->config();
      shape = {c.n_layers, c.n_kv_heads, c.head_size(), c.head_size()};
      fingerprint = model_fingerprint(*model);
    }
    kv_heads = shape.kv_heads;
    head_size = shape.key_dim;
    // vq levels with a profile: fitted on this very file (its bytes' hash), else refused now.
    profiles = check_method_profiles(o.levels, g.fingerprint, o.model);
    description = ModelDescription::uniform(shape.layers, head_size);
    store = open_store(o.store);
    probe_layout();
    warm_layer_models();
  }

  // `vq` levels with the model's basis build each layer's model once per process (an eigen-
  // decomposition per layer: 18.7 s for issue 30's realistic shape, 12 layers of 768). Built now, on
  // the storing thread and holding the gate, so the first request after a start waits for it
  // rather than paying it unannounced in its time to first token; passthrough routes are served
  // meanwhile.
  void warm_layer_models() {
    std::vector<std::string> vq_levels;
    if (!model) return;  // no weights: nothing to build ahead (a profile's layers are cheap)
    for (const auto& l : o.levels)
      if (MethodSpec::parse(l).kind == MethodSpec::Kind::Vq) vq_levels.push_back(l);
    if (vq_levels.empty()) return;
    later(
        [this, vq_levels] {
          const auto t = std::chrono::steady_clock::now();
          try {
            for (const auto& l : vq_levels) (void)make_caches(l, *model);
            o.log(fmt::format("vq layer models of {} built in {:.0f} ms (once per start)", fmt::join(vq_levels, "; "),
                              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count()));
          } catch (const std::exception& e) {
            o.log(fmt::format("building the vq layer models failed ({}); the first request builds them", e.what()));
          }
        },
        std::make_shared<Pass>(*this));
  }

  static const std::string& require_file(const std::string& path) {
    require(!path.empty(), "--model: give the GGUF file the llama-server runs");
    if (!std::filesystem::is_regular_file(path)) throw IoError(fmt::format("{}: cannot open model (no such file)", path));
    return path;
  }

  httplib::Client client() const {
    httplib::Client c(host, port);
    c.set_tcp_nodelay(true);  // a request's headers and body go out at once: no Nagle wait for a delayed ACK (40 ms)
    c.set_connection_timeout(5, 0);
    c.set_read_timeout(600, 0);
    c.set_write_timeout(60, 0);
    return c;
  }

  json post(const std::string& route, const json& body) const {
    auto c = client();
    return serve_detail::post_json(c, o.upstream, route, body);
  }

  std::string slot_route(const char* action) const { return fmt::format("/slots/{}?action={}", o.slot, action); }
  std::string slot_file(const char* what) const { return fmt::format("veloxquant-{}-slot{}.bin", what, o.slot); }
  std::string slot_path(const char* what) const { return (std::filesystem::path(o.slot_dir) / slot_file(what)).string(); }

  LlamaState save_slot() {
    post(slot_route("save"), {{"filename", slot_file("saved")}});
    return load_llama_state(slot_path("saved"), shape);
  }

  // The server's slot layout, from a one-token prompt (nothing predicted) saved from the slot (then
  // erased).
  void probe_layout() {
    try {
      post("/completion", {{"prompt", "a"}, {"n_predict", 0}, {"id_slot", o.slot}, {"cache_prompt", true}, {"temperature", 0}});
      layout = save_slot();
    } catch (const FormatError& e) {
      throw FormatError(fmt::format("the slot llama-server saved does not fit {} ({}): give the GGUF the server runs", o.model, e.what()));
    }
    layout.layers.clear();
    layout.tokens.clear();
    post(slot_route("erase"), json::object());
    slot_tokens.clear();
  }

  std::vector<int> tokenize(const json& prompt) const {
    if (prompt.is_string()) {
      const json r = post("/tokenize", {{"content", prompt.get<std::string>()}, {"add_special", true}, {"parse_special", true}});
      return r.at("tokens").get<std::vector<int>>();
    }
    if (prompt.is_array() && !prompt.empty() && std::all_of(prompt.begin(), prompt.end(), [](const json& t) { return t.is_number_integer(); }))
      return prompt.get<std::vector<int>>();
    return {};  // several prompts, mixed content: not cached
  }

  static std::size_t common_prefix(const std::vector<std::int32_t>& a, const std::vector<int>& b) {
    std::size_t n = 0;
    while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
    return n;
  }

  // How many tokens the server's slot holds now (GET /slots: n_prompt_tokens; 0 when it has run no
  // task, e.g. after a restart, or when /slots is off): what we last saved or restored is trusted
  // only up to that.
  std::size_t slot_holds() const {
    auto c = client();
    httplib::Request get;
    get.method = "GET";
    get.path = "/slots";
    const auto r = serve_detail::send_bounded(c, std::move(get), kMaxBodyBytes);
    if (r.error != httplib::Error::Success || r.status != 200) return 0;
    try {
      for (const auto& s : json::parse(r.body))
        if (s.is_object() && s.value("id", -1) == o.slot) return static_cast<std::size_t>(std::max(0, s.value("n_prompt_tokens", 0)));
    } catch (const json::exception&) {
    }
    return 0;
  }

  // Steps 2-3: the stored prefix of `tokens` into the slot when it beats what the slot holds.
  void restore(const std::vector<int>& tokens, PromptCacheEvent& ev) {
    const std::size_t held = std::min(common_prefix(slot_tokens, tokens), slot_holds());
    // The most a load can give (whole chunks, the last token left to the server): when the slot
    // holds that much already, nothing is fetched or decoded.
    const std::size_t chunk = static_cast<std::size_t>(o.chunk_tokens);
    if (held > 0 && held >= (tokens.size() - 1) / chunk * chunk) {
      ev.note = fmt::format("the slot already holds {} of the prompt's tokens", held);
      return;
    }
    LoaderOptions lo;
    lo.scheme = {.model_fingerprint = fingerprint, .chunk_tokens = o.chunk_tokens, .levels = {}};
    lo.allow_recompute = false;
    if (!profiles.empty()) lo.vq_models = vq_profile_models(profiles, model ? chunk_vq_models(*model) : VqLayerModelSource{});
    // The chunks decode straight into the slot file's layout (format/llama_state_image.hpp), in
    // buffers kept from one restore to the next: no float32 copy of the prefix, no new pages.
    if (!image) image = std::make_unique<LlamaStateImage>(layout, shape);
    auto& caches = image->begin(static_cast<std::int64_t>(tokens.size()));
    std::vector<std::string> warnings;
    const auto warn = [&](const std::string& w) { warnings.push_back(w); };
    const LoadReport rep = model ? load_prefix(*store, *model, caches, tokens, lo, warn)
                                 : load_prefix(*store, ChunkShape{kv_heads, head_size}, caches, tokens, lo, warn);
    ev.load_ms = rep.load_ms;
    for (const auto& w : warnings) o.log(w);
    const auto t_write = std::chrono::steady_clock::now();
    const auto reused = static_cast<std::size_t>(rep.tokens_reused);
    if (reused == 0 || reused <= held) {
      if (reused > 0) ev.note = fmt::format("the slot already holds {} of the prompt's tokens", held);
      return;
    }
    // Written over the file of the last restore (a scratch file the server reads at once; unsynced,
    // not through core/atomic_file.hpp, whose fsync would put tens of MB of disk writes on the hit
    // path).
    const std::span<const std::int32_t> restored(tokens.data(), reused);
    image->write(slot_path("restore"), restored);
    const auto t_restore = std::chrono::steady_clock::now();
    ev.write_ms = std::chrono::duration<double, std::milli>(t_restore - t_write).count();
    try {
      const json r = post(slot_route("restore"), {{"filename", slot_file("restore")}});
      const auto n = r.value("n_restored", -1);
      require(n == static_cast<long>(reused), "the server restored {} tokens of {}", n, reused);
    } catch (...) {
      slot_tokens.clear();
      try {
        post(slot_route("erase"), json::object());
      } catch (...) {
      }
      throw;
    }
    slot_tokens.assign(restored.begin(), restored.end());
    // Kept for the next restore up to a bound: a longer prefix's buffers go back once it is restored.
    if (image->nbytes() > kKeepImageBytes) image->release();
    ev.restored_tokens = static_cast<int>(reused);
    ev.restore_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_restore).count();
    std::vector<std::pair<std::string, int>> levels;  // level, chunks, in order of first use
    for (const auto& c : rep.chunks) {
      auto it = std::find_if(levels.begin(), levels.end(), [&](const auto& e) { return e.first == c.level; });
      if (it == levels.end()) levels.emplace_back(c.level, 1);
      else ++it->second;
    }
    std::string at;
    for (const auto& [l, n] : levels) at += fmt::format("{}{} x{}", at.empty() ? "" : ", ", l, n);
    double fetch_ms = 0, decode_ms = 0;  // summed over the chunks (decoders overlap the fetches and each other)
    for (const auto& c : rep.chunks) fetch_ms += c.fetch_ms, decode_ms += c.decode_ms;
    ev.note = fmt::format("{} chunks of {} tokens from the store ({}); load {:.0f} ms (chunks' fetch {:.0f} ms, decode {:.0f} ms, summed), "
                          "slot file {:.0f} ms, server restore {:.0f} ms",
                          rep.chunks.size(), o.chunk_tokens, at, ev.load_ms, fetch_ms, decode_ms, ev.write_ms, ev.restore_ms);
  }

  // Step 5: the slot's whole chunks into the store (those stored already are skipped by put).
  void store_slot(PromptCacheEvent& ev) {
    LlamaState st = save_slot();
    const std::size_t n = std::min<std::size_t>(st.tokens.size(), static_cast<std::size_t>(st.cells()));
    slot_tokens = st.tokens;
    if (n < static_cast<std::size_t>(o.chunk_tokens)) return;
    std::vector<KVState> exact;
    for (const auto& l : st.layers)
      exact.push_back({l.keys.slice(2, 0, static_cast<std::int64_t>(n)).to(DType::F32), l.values.slice(2, 0, static_cast<std::int64_t>(n)).to(DType::F32)});
    const ChunkScheme scheme{.model_fingerprint = fingerprint, .chunk_tokens = o.chunk_tokens, .levels = o.levels};
    const std::vector<int> toks(st.tokens.begin(), st.tokens.begin() + static_cast<std::ptrdiff_t>(n));
    const PutReport put = model ? put_context(*store, *model, scheme, toks, exact)
                                : put_context(*store, [this](const std::string& level) { return make_caches(MethodSpec::parse(level), description); },
                                              scheme, toks, exact);
    ev.stored_tokens = put.chunks_written * o.chunk_tokens;
    ev.stored_bytes = put.bytes_written;
  }

  // Steps 1-3 for a completion body (chat: its messages, through the server's own chat template,
  // POST /apply-template); the body to forward (id_slot, cache_prompt set when cached).
  std::string before(const std::string& body, bool chat, PromptCacheEvent& ev, bool& cached) {
    cached = false;
    json req;
    try {
      req = json::parse(body);
    } catch (const json::exception&) {
      ev.note = "the request is not JSON: passed through";
      return body;
    }
    if (!req.is_object() || !req.contains(chat ? "messages" : "prompt")) {
      ev.note = chat ? "no messages: passed through" : "no prompt: passed through";
      return body;
    }
    std::vector<int> tokens;
    try {
      tokens = tokenize(chat ? post("/apply-template", req).at("prompt") : req["prompt"]);
    } catch (const std::exception& e) {
      ev.note = fmt::format("tokenizing failed ({}): passed through", e.what());
      return body;
    }
    if (tokens.empty()) {
      ev.note = "a prompt the cache does not key (several prompts or mixed content): passed through";
      return body;
    }
    ev.prompt_tokens = static_cast<int>(tokens.size());
    try {
      restore(tokens, ev);
    } catch (const std::exception& e) {
      ev.note = fmt::format("restoring from the store failed ({}): the server computes the prompt", e.what());
      ev.restored_tokens = 0;
    }
    req["id_slot"] = o.slot;
    req["cache_prompt"] = true;
    cached = true;
    return req.dump();
  }

  void after(PromptCacheEvent& ev) {
    try {
      store_slot(ev);
    } catch (const std::exception& e) {
      slot_tokens.clear();
      ev.note += (ev.note.empty() ? "" : "; ") + fmt::format("storing the slot failed ({}): nothing stored lost", e.what());
    }
  }

  void report(const PromptCacheEvent& ev) const {
    o.log(fmt::format("{} prompt tokens, {} restored from the store, {} stored ({} bytes written){}{}", ev.prompt_tokens, ev.restored_tokens,
                      ev.stored_tokens, ev.stored_bytes, ev.note.empty() ? "" : "; ", ev.note));
  }

  static httplib::Headers forward_headers(const httplib::Request& req) {
    httplib::Headers h;
    for (const auto& [k, v] : req.headers) {
      const std::string lk = lower(k);
      if (lk == "host" || lk == "content-length" || lk == "connection" || lk == "transfer-encoding" || lk == "remote_addr" ||
          lk == "remote_port" || lk == "local_addr" || lk == "local_port")
        continue;
      h.emplace(k, v);
    }
    return h;
  }

  // Forwards `req` with `body`; a streaming reply goes back chunk by chunk, then `done` runs; a
  // whole reply is copied and `done` runs on a thread of its own, after the reply went out. `pass`
  // (the cache gate, or null) is held until `done` has run.
  void forward(const httplib::Request& req, httplib::Response& res, const std::string& body, std::function<void()> done,
               std::shared_ptr<Pass> pass) {
    bool stream = false;
    if (!body.empty() && body.find("\"stream\"") != std::string::npos) {
      try {
        const json j = json::parse(body);
        stream = j.is_object() && j.value("stream", false);
      } catch (const json::exception&) {
      }
    }
    const std::string target = req.target.empty() ? req.path : req.target;
    const std::string content_type = req.has_header("Content-Type") ? req.get_header_value("Content-Type") : "application/json";
    if (!stream) {
      auto c = client();
      httplib::Request up;
      up.method = req.method;
      up.path = target;
      up.headers = forward_headers(req);
      up.body = body;
      if (!body.empty()) up.set_header("Content-Type", content_type);
      const auto r = serve_detail::send_bounded(c, std::move(up), kMaxBodyBytes);
      if (r.error != httplib::Error::Success) {
        const std::string why = r.over_limit ? fmt::format("its reply is over {} bytes (read no further)", kMaxBodyBytes)
                                             : fmt::format("did not answer ({})", httplib::to_string(r.error));
        res.status = 502;
        res.set_content(json{{"error", {{"code", 502}, {"message", fmt::format("veloxquant prompt-cache: llama-server {}: {}", o.upstream, why)},
                                        {"type", "unavailable_error"}}}}
                            .dump(),
                        "application/json");
        if (done) later(std::move(done), std::move(pass));
        return;
      }
      res.status = r.status;
      std::string reply_type = "application/json";
      for (const auto& [k, v] : r.headers) {
        const std::string lk = lower(k);
        if (lk == "content-type") reply_type = v;
        if (lk == "content-length" || lk == "transfer-encoding" || lk == "connection" || lk == "content-type") continue;
        res.set_header(k, v);
      }
      res.set_content(r.body, reply_type);
      if (done) later(std::move(done), std::move(pass));
      return;
    }
    // Streaming: the upstream reply's bytes are written to the client as they arrive.
    auto headers = forward_headers(req);
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, target, headers, body, content_type](std::size_t, httplib::DataSink& sink) {
          auto c = client();
          httplib::Request up;
          up.method = "POST";
          up.path = target;
          up.headers = headers;
          up.body = body;
          up.set_header("Content-Type", content_type);
          up.content_receiver = [&sink](const char* data, std::size_t n, std::uint64_t, std::uint64_t) { return sink.write(data, n); };
          const auto r = c.send(up);
          if (!r) o.log(fmt::format("llama-server {} stream failed ({})", o.upstream, httplib::to_string(r.error())));
          sink.done();
          return true;
        },
        [this, done, pass](bool) mutable {
          if (done) later(std::move(done), std::move(pass));
        });
  }

  // Runs `done` on a thread of its own, holding `pass` (the next request through the cache waits for
  // it). The previous such thread has let its pass go before this request got one, so joining it
  // here is immediate.
  void later(std::function<void()> done, std::shared_ptr<Pass> pass) {
    std::lock_guard<std::mutex> g(afters_mu);
    if (after_thread.joinable()) after_thread.join();
    after_thread = std::thread([done = std::move(done), pass = std::move(pass)]() mutable {
      done();
      pass.reset();
    });
  }

  ~Impl() {
    server.stop();
    std::lock_guard<std::mutex> g(afters_mu);
    if (after_thread.joinable()) after_thread.join();
  }

  void handle(const httplib::Request& req, httplib::Response& res, bool cacheable, bool chat = false) {
    if (req.body.size() > kMaxBodyBytes) {
      res.status = 413;
      res.set_content(R"({"error":{"code":413,"message":"veloxquant prompt-cache: request body over 64 MiB","type":"invalid_request_error"}})",
                      "application/json");
      return;
    }
    if (!cacheable || req.method != "POST") return forward(req, res, req.body, {}, nullptr);
    auto pass = std::make_shared<Pass>(*this);
    auto ev = std::make_shared<PromptCacheEvent>();
    bool cached = false;
    const std::string body = before(req.body, chat, *ev, cached);
    const auto done = [this, ev, cached] {
      if (cached) after(*ev);
      report(*ev);
    };
    forward(req, res, body, done, std::move(pass));
  }
};

PromptCacheProxy::PromptCacheProxy(PromptCacheOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  Impl& m = *impl_;
  const auto passthrough = [&m](const httplib::Request& req, httplib::Response& res) { m.handle(req, res, false); };
  const auto cached = [&m](const httplib::Request& req, httplib::Response& res) { m.handle(req, res, true); };
  m.server.set_payload_max_length(kMaxBodyBytes);
  m.server.set_tcp_nodelay(true);  // replies leave at once, not after the client's delayed ACK
  const auto chat = [&m](const httplib::Request& req, httplib::Response& res) { m.handle(req, res, true, true); };
  for (const char* route : {"/completion", "/completions", "/v1/completions"}) m.server.Post(route, cached);
  for (const char* route : {"/chat/completions", "/v1/chat/completions"}) m.server.Post(route, chat);
  m.server.Post(".*", passthrough);
  m.server.Get(".*", passthrough);
  m.server.Delete(".*", passthrough);
  m.server.Options(".*", passthrough);
}

PromptCacheProxy::~PromptCacheProxy() { impl_->server.stop(); }

void PromptCacheProxy::bind() {
  Impl& m = *impl_;
  if (m.o.listen_port == 0) {
    m.bound_port = m.server.bind_to_any_port(m.o.listen_host);
    if (m.bound_port <= 0) throw IoError(fmt::format("--listen {}:0: cannot listen", m.o.listen_host));
  } else {
    if (!m.server.bind_to_port(m.o.listen_host, m.o.listen_port))
      throw IoError(fmt::format("--listen {}:{}: cannot listen (in use?)", m.o.listen_host, m.o.listen_port));
    m.bound_port = m.o.listen_port;
  }
}

int PromptCacheProxy::port() const { return impl_->bound_port; }

void PromptCacheProxy::serve() { impl_->server.listen_after_bind(); }

void PromptCacheProxy::stop() { impl_->server.stop(); }

void PromptCacheProxy::wait_idle() { Impl::Pass pass(*impl_); }

}  // namespace vq
