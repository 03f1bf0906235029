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
// KiB a token), or 21,845 tokens of bench prompt-cache's realistic shape (12 KiB a token). Shared
// by the slots: each keeps at most its share.
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
  // The server slots the cache uses. A request through the cache leases one (the free slot whose
  // tokens share the longest prefix with its prompt) from before its restore until its slot is
  // stored (on a thread of its own, after the reply went out).
  struct Slot {
    int id = 0;
    std::vector<std::int32_t> tokens;        // what the slot holds, as last saved or restored by us
    std::unique_ptr<LlamaStateImage> image;  // restores into this slot decode into it (made with the first)
    bool busy = false;
  };
  std::vector<Slot> slots;
  std::mutex slots_mu;
  std::condition_variable slots_cv;
  bool warming = false;  // the layer models are being built: no lease until they are
  // Puts, one at a time (each reads, merges and replaces its chunks' directories). Loads take no
  // lock: the store is thread-safe (store/kv_store.hpp), a put writes a chunk's blobs before the
  // directory entry that lists them, and each slot decodes into an image of its own, so restores
  // into different slots run side by side, beside a put.
  std::mutex put_mu;
  struct Lease {  // holds a slot; gives it back when the last holder lets go
    Impl& m;
    Slot* slot;
    Lease(Impl& impl, const std::vector<int>& tokens) : m(impl), slot(nullptr) {
      std::unique_lock<std::mutex> l(m.slots_mu);
      m.slots_cv.wait(l, [&] { return !m.warming && std::any_of(m.slots.begin(), m.slots.end(), [](const Slot& s) { return !s.busy; }); });
      std::size_t best = 0;
      for (auto& s : m.slots) {
        if (s.busy) continue;
        const std::size_t shared = common_prefix(s.tokens, tokens);
        if (!slot || shared > best) slot = &s, best = shared;
      }
      slot->busy = true;
    }
    ~Lease() {
      {
        std::lock_guard<std::mutex> l(m.slots_mu);
        slot->busy = false;
      }
      m.slots_cv.notify_all();
    }
  };
  // Tasks run after a reply (storing a slot), each on a detached thread of its own; counted so that
  // wait_idle and the destructor can wait for them.
  std::mutex afters_mu;
  std::condition_variable afters_cv;
  int afters = 0;
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
    require(o.slots >= 1 && o.slots <= 1024, "--slots {} is not in 1..1024", o.slots);
    for (int i = 0; i < o.slots; ++i) slots.emplace_back().id = o.slot + i;
    for (const auto& l : o.levels) (void)MethodSpec::parse(l);  // a bad spec fails before any work
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
    if (o.levels.empty()) o.levels = prompt_cache_default_levels(head_size);
    // vq levels with a profile: fitted on this very file (its bytes' hash), else refused now; then
    // named in the store by their hash, not by this host's path.
    profiles = check_method_profiles(o.levels, g.fingerprint, o.model);
    for (auto& l : o.levels) l = store_level(l);
    description = ModelDescription::uniform(shape.layers, head_size);
    store = open_store(o.store);
    probe_layout();
    warm_layer_models();
  }

  // `vq` levels with the model's basis build each layer's model once per process (an eigen-
  // decomposition per layer: 18.7 s for issue 30's realistic shape, 12 layers of 768). Built now, on
  // a thread of its own, and no slot is leased until they are, so the first request after a start
  // waits for it rather than paying it unannounced in its time to first token; passthrough routes
  // are served meanwhile.
  void warm_layer_models() {
    std::vector<std::string> vq_levels;
    if (!model) return;  // no weights: nothing to build ahead (a profile's layers are cheap)
    for (const auto& l : o.levels)
      if (MethodSpec::parse(l).kind == MethodSpec::Kind::Vq) vq_levels.push_back(l);
    if (vq_levels.empty()) return;
    {
      std::lock_guard<std::mutex> l(slots_mu);
      warming = true;
    }
    later([this, vq_levels] {
      const auto t = std::chrono::steady_clock::now();
      try {
        for (const auto& l : vq_levels) (void)make_caches(l, *model);
        o.log(fmt::format("vq layer models of {} built in {:.0f} ms (once per start)", fmt::join(vq_levels, "; "),
                          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count()));
      } catch (const std::exception& e) {
        o.log(fmt::format("building the vq layer models failed ({}); the first request builds them", e.what()));
      }
      {
        std::lock_guard<std::mutex> l(slots_mu);
        warming = false;
      }
      slots_cv.notify_all();
    });
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

  static std::string slot_route(int id, const char* action) { return fmt::format("/slots/{}?action={}", id, action); }
  static std::string slot_file(const char* what, int id) { return fmt::format("veloxquant-{}-slot{}.bin", what, id); }
  std::string slot_path(const char* what, int id) const { return (std::filesystem::path(o.slot_dir) / slot_file(what, id)).string(); }

  LlamaState save_slot(int id) {
    post(slot_route(id, "save"), {{"filename", slot_file("saved", id)}});
    return load_llama_state(slot_path("saved", id), shape);
  }

  // The server's slot layout, from a one-token prompt (nothing predicted) saved from the slot (then
  // erased).
  void probe_layout() {
    try {
      post("/completion", {{"prompt", "a"}, {"n_predict", 0}, {"id_slot", o.slot}, {"cache_prompt", true}, {"temperature", 0}});
      layout = save_slot(o.slot);
    } catch (const FormatError& e) {
      throw FormatError(fmt::format("the slot llama-server saved does not fit {} ({}): give the GGUF the server runs", o.model, e.what()));
    }
    layout.layers.clear();
    layout.tokens.clear();
    post(slot_route(o.slot, "erase"), json::object());
    // Every slot the cache is to use must exist (GET /slots lists them; a server started with
    // --no-slots lists none, and a missing slot then fails its first restore, served by recompute).
    if (const auto listed = slot_list(); !listed.empty())
      for (const Slot& sl : slots)
        if (std::none_of(listed.begin(), listed.end(), [&](const auto& e) { return e.first == sl.id; }))
          throw InvalidArgument(fmt::format("--slot {} --slots {}: the server at {} has no slot {} (it has {}; start llama-server with -np {})",
                                            o.slot, o.slots, o.upstream, sl.id, listed.size(), o.slot + o.slots));
  }

  // The slots GET /slots lists: their ids (empty when the server lists none or answers otherwise)
  // and what each holds (n_prompt_tokens).
  std::vector<std::pair<int, int>> slot_list() const {
    auto c = client();
    httplib::Request get;
    get.method = "GET";
    get.path = "/slots";
    const auto r = serve_detail::send_bounded(c, std::move(get), kMaxBodyBytes);
    std::vector<std::pair<int, int>> out;
    if (r.error != httplib::Error::Success || r.status != 200) return out;
    try {
      const json j = json::parse(r.body);
      if (!j.is_array()) return out;
      for (const auto& sl : j)
        if (sl.is_object() && sl.contains("id") && sl["id"].is_number_integer())
          out.emplace_back(sl["id"].get<int>(), sl.value("n_prompt_tokens", 0));
    } catch (const json::exception&) {
      out.clear();
    }
    return out;
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

  // How many tokens server slot `id` holds now (GET /slots: n_prompt_tokens; 0 when it has run no
  // task, e.g. after a restart, or when /slots is off): what we last saved or restored is trusted
  // only up to that.
  std::size_t slot_holds(int id) const {
    for (const auto& [sid, n] : slot_list())
      if (sid == id) return static_cast<std::size_t>(std::max(0, n));
    return 0;
  }

  // Steps 2-3: the stored prefix of `tokens` into the slot when it beats what the slot holds.
  void restore(const std::vector<int>& tokens, Slot& slot, PromptCacheEvent& ev) {
    const std::size_t held = std::min(common_prefix(slot.tokens, tokens), slot_holds(slot.id));
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
    auto& image = slot.image;
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
    image->write(slot_path("restore", slot.id), restored);
    const auto t_restore = std::chrono::steady_clock::now();
    ev.write_ms = std::chrono::duration<double, std::milli>(t_restore - t_write).count();
    try {
      const json r = post(slot_route(slot.id, "restore"), {{"filename", slot_file("restore", slot.id)}});
      const auto n = r.value("n_restored", -1);
      require(n == static_cast<long>(reused), "the server restored {} tokens of {}", n, reused);
    } catch (...) {
      slot.tokens.clear();
      try {
        post(slot_route(slot.id, "erase"), json::object());
      } catch (...) {
      }
      throw;
    }
    slot.tokens.assign(restored.begin(), restored.end());
    // Kept for the next restore up to a bound: a longer prefix's buffers go back once it is restored.
    if (image->nbytes() > kKeepImageBytes / slots.size()) image->release();
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
    ev.note = fmt::format("slot {}: {} chunks of {} tokens from the store ({}); load {:.0f} ms (chunks' fetch {:.0f} ms, decode {:.0f} ms, summed), "
                          "slot file {:.0f} ms, server restore {:.0f} ms",
                          slot.id, rep.chunks.size(), o.chunk_tokens, at, ev.load_ms, fetch_ms, decode_ms, ev.write_ms, ev.restore_ms);
  }

  // Step 5: the slot's whole chunks into the store (those stored already are skipped by put).
  void store_slot(Slot& slot, PromptCacheEvent& ev) {
    LlamaState st = save_slot(slot.id);
    const std::size_t n = std::min<std::size_t>(st.tokens.size(), static_cast<std::size_t>(st.cells()));
    slot.tokens = st.tokens;
    if (n < static_cast<std::size_t>(o.chunk_tokens)) return;
    std::vector<KVState> exact;
    for (const auto& l : st.layers)
      exact.push_back({l.keys.slice(2, 0, static_cast<std::int64_t>(n)).to(DType::F32), l.values.slice(2, 0, static_cast<std::int64_t>(n)).to(DType::F32)});
    const ChunkScheme scheme{.model_fingerprint = fingerprint, .chunk_tokens = o.chunk_tokens, .levels = o.levels};
    const std::vector<int> toks(st.tokens.begin(), st.tokens.begin() + static_cast<std::ptrdiff_t>(n));
    std::lock_guard<std::mutex> g(put_mu);
    const PutReport put = model ? put_context(*store, *model, scheme, toks, exact)
                                : put_context(*store, [this](const std::string& level) { return make_caches(MethodSpec::parse(level), description); },
                                              scheme, toks, exact);
    ev.stored_tokens = put.chunks_written * o.chunk_tokens;
    ev.stored_bytes = put.bytes_written;
  }

  // Step 1 for a completion body (chat: its messages, through the server's own chat template, POST
  // /apply-template): its JSON and tokens, or false (the reason in ev.note) when the cache passes it
  // through as it is.
  bool prepare(const std::string& body, bool chat, PromptCacheEvent& ev, json& req, std::vector<int>& tokens) {
    try {
      req = json::parse(body);
    } catch (const json::exception&) {
      ev.note = "the request is not JSON: passed through";
      return false;
    }
    if (!req.is_object() || !req.contains(chat ? "messages" : "prompt")) {
      ev.note = chat ? "no messages: passed through" : "no prompt: passed through";
      return false;
    }
    try {
      tokens = tokenize(chat ? post("/apply-template", req).at("prompt") : req["prompt"]);
    } catch (const std::exception& e) {
      ev.note = fmt::format("tokenizing failed ({}): passed through", e.what());
      return false;
    }
    if (tokens.empty()) {
      ev.note = "a prompt the cache does not key (several prompts or mixed content): passed through";
      return false;
    }
    ev.prompt_tokens = static_cast<int>(tokens.size());
    return true;
  }

  void after(Slot& slot, PromptCacheEvent& ev) {
    try {
      store_slot(slot, ev);
    } catch (const std::exception& e) {
      slot.tokens.clear();
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
  // (the request's slot lease, or null) is held until `done` has run.
  void forward(const httplib::Request& req, httplib::Response& res, const std::string& body, std::function<void()> done,
               std::shared_ptr<void> pass) {
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

  // Runs `done` on a detached thread of its own, holding `pass` (a request's slot lease, or null):
  // counted, so that wait_idle and the destructor wait for it.
  void later(std::function<void()> done, std::shared_ptr<void> pass = nullptr) {
    {
      std::lock_guard<std::mutex> g(afters_mu);
      ++afters;
    }
    std::thread([this, done = std::move(done), pass = std::move(pass)]() mutable {
      done();
      pass.reset();
      std::lock_guard<std::mutex> g(afters_mu);  // notified under the lock: the destructor cannot pass its wait before this thread is done with the Impl
      --afters;
      afters_cv.notify_all();
    }).detach();
  }

  // Until no slot is leased and no task runs after a reply.
  void wait_idle() {
    {
      std::unique_lock<std::mutex> l(slots_mu);
      slots_cv.wait(l, [&] { return !warming && std::none_of(slots.begin(), slots.end(), [](const Slot& sl) { return sl.busy; }); });
    }
    std::unique_lock<std::mutex> l(afters_mu);
    afters_cv.wait(l, [&] { return afters == 0; });
  }

  ~Impl() {
    server.stop();
    wait_idle();
  }

  void handle(const httplib::Request& req, httplib::Response& res, bool cacheable, bool chat = false) {
    if (req.body.size() > kMaxBodyBytes) {
      res.status = 413;
      res.set_content(R"({"error":{"code":413,"message":"veloxquant prompt-cache: request body over 64 MiB","type":"invalid_request_error"}})",
                      "application/json");
      return;
    }
    if (!cacheable || req.method != "POST") return forward(req, res, req.body, {}, nullptr);
    auto ev = std::make_shared<PromptCacheEvent>();
    json body;
    std::vector<int> tokens;
    if (!prepare(req.body, chat, *ev, body, tokens)) return forward(req, res, req.body, [this, ev] { report(*ev); }, nullptr);
    // A slot of its own until its slot is stored (after the reply): requests run side by side, one per slot.
    auto lease = std::make_shared<Lease>(*this, tokens);
    Slot& slot = *lease->slot;
    try {
      restore(tokens, slot, *ev);
    } catch (const std::exception& e) {
      ev->note = fmt::format("restoring from the store failed ({}): the server computes the prompt", e.what());
      ev->restored_tokens = 0;
    }
    body["id_slot"] = slot.id;
    body["cache_prompt"] = true;
    forward(req, res, body.dump(), [this, ev, &slot] { after(slot, *ev), report(*ev); }, std::move(lease));
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

void PromptCacheProxy::wait_idle() { impl_->wait_idle(); }

const std::vector<std::string>& PromptCacheProxy::levels() const { return impl_->o.levels; }

std::vector<std::string> prompt_cache_default_levels(int head_size) {
  return {MethodSpec::parse(head_size >= 64 ? "vq:bits=2,block=head" : "vq:bits=2").to_string()};
}

}  // namespace vq
