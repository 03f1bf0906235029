// Methods scored with llama.cpp's own logits through a llama-server this object starts
// (serve/llama_engine.hpp).
#include "veloxquant/serve/llama_engine.hpp"

#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "veloxquant/core/error.hpp"
#include "veloxquant/format/llama_state.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/gguf.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/serve/local_process.hpp"
#include "llama_http.hpp"

namespace vq {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// n_probs asking for every token: the server gives min(this, vocabulary).
constexpr int kAllTokens = 1 << 24;

}  // namespace

struct LlamaEngine::Impl {
  LlamaEngineOptions o;
  fs::path work;
  int port = 0;
  std::unique_ptr<LocalProcess> server;
  std::unique_ptr<httplib::Client> http;
  GgufShape gguf;  // its fingerprint is what a vq profile names
  LlamaStateModel shape;
  // The model, when our GGUF reader loads its weights (vq then takes its transforms from them);
  // otherwise vq has no transform unless a spec names a profile, as in the prompt cache. Read by
  // the first evaluate (calibrate, which only takes states, never reads the weights).
  std::unique_ptr<Transformer> model;
  bool weights_tried = false;
  ModelDescription description;
  int bos_id = 1;
  // A token whose piece is plain text ("a"): the one token each scoring request samples, so the
  // server never holds back its reply's probabilities (it does for a partial UTF-8 byte or an
  // end-of-generation token). The bias acts in the sampler; the distribution reported is the raw
  // logits' softmax, which no bias touches.
  int plain_token = -1;

  explicit Impl(LlamaEngineOptions options) : o(std::move(options)) {
    if (!o.log) o.log = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
    require(!o.model.empty(), "--engine llama: give the GGUF file llama-server runs (--model X.gguf)");
    if (!fs::is_regular_file(o.model)) throw IoError(fmt::format("{}: cannot open model (no such file)", o.model));
    gguf = load_gguf_shape(o.model);  // a file that is not GGUF fails here, with its own message
    require(gguf.key_length == gguf.value_length, "{}: key length {} and value length {} differ, which --engine llama does not support",
            o.model, gguf.key_length, gguf.value_length);
    shape = {gguf.n_layers, gguf.n_kv_heads, gguf.key_length, gguf.value_length};
    description = ModelDescription::uniform(gguf.n_layers, gguf.key_length);
    if (o.server.empty()) o.server = fs::exists(".llama/bin/llama-server") ? ".llama/bin/llama-server" : "llama-server";
    work = fs::temp_directory_path() / fmt::format("vq-llama-engine-{}-{}", ::getpid(), reinterpret_cast<std::uintptr_t>(this));
    fs::create_directories(work / "slots");
    port = free_local_port();
    // F32 K and V: the saved state is the exact cache, and a method's reconstruction is restored as
    // it is. Flash attention off (V transposed in the state; either layout reads). No host prompt
    // cache (--cache-ram 0): the slot holds exactly what was evaluated or restored.
    const int p = port;
    try {
      server = std::make_unique<LocalProcess>(
          std::vector<std::string>{o.server, "-m", o.model, "-c", std::to_string(o.context), "-np", "1", "-t", std::to_string(o.threads),
                                   "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--cache-ram", "0", "--slot-save-path",
                                   (work / "slots").string(), "--host", "127.0.0.1", "--port", std::to_string(p)},
          (work / "server.log").string(), [p] { return http_health_ok(p); });
    } catch (...) {
      std::error_code ec;
      fs::remove_all(work, ec);
      throw;
    }
    http = std::make_unique<httplib::Client>("127.0.0.1", port);
    http->set_keep_alive(true);
    http->set_tcp_nodelay(true);  // one small request after another: no Nagle wait for the delayed ACK (40 ms each)
    http->set_connection_timeout(5, 0);
    http->set_read_timeout(600, 0);
    http->set_write_timeout(60, 0);
    const auto b = post("/tokenize", {{"content", ""}, {"add_special", true}}).at("tokens");
    bos_id = b.is_array() && b.size() == 1 && b[0].is_number_integer() ? b[0].get<int>() : -1;
    require(bos_id >= 0, "{}: llama-server adds no single BOS token to a prompt; --engine llama needs one", o.model);
    const auto a = post("/tokenize", {{"content", "a"}, {"add_special", false}}).at("tokens");
    plain_token = a.is_array() && !a.empty() && a[0].is_number_integer() ? a[0].get<int>() : -1;
  }

  ~Impl() {
    http.reset();
    server.reset();
    std::error_code ec;
    fs::remove_all(work, ec);
  }

  json post(const std::string& route, const json& body) const {
    return serve_detail::post_json(*http, fmt::format("http://127.0.0.1:{}", port), route, body);
  }

  void load_weights() {
    if (weights_tried) return;
    weights_tried = true;
    std::string why;
    if (auto m = load_gguf_if_ours(o.model, gguf, why))
      model = std::make_unique<Transformer>(std::move(m->checkpoint));
    else
      o.log(fmt::format("{}: its weights are not ours to read ({}): vq has no transform from the weights (vq:...,profile=PATH from "
                        "`veloxquant calibrate` gives it one)", o.model, why));
  }

  std::vector<std::shared_ptr<KVCache>> caches_of(const std::string& method) const {
    return model ? make_caches(method, *model) : make_caches(MethodSpec::parse(method), description);
  }

  // Log-probabilities over the vocabulary of the token after `prompt`, from the slot (the server
  // reuses what the slot holds and evaluates the rest, at least one token).
  std::vector<double> next_logprobs(std::span<const int> prompt, std::size_t vocab_hint) const {
    const json r = post("/completion", {{"prompt", std::vector<int>(prompt.begin(), prompt.end())},
                                        {"n_predict", 1},
                                        {"n_probs", kAllTokens},
                                        {"id_slot", 0},
                                        {"cache_prompt", true},
                                        {"temperature", 0},
                                        {"logit_bias", plain_token >= 0 ? json::array({json::array({plain_token, 1e4})}) : json::array()}});
    const json* probs = nullptr;
    if (r.contains("completion_probabilities") && r["completion_probabilities"].is_array() && !r["completion_probabilities"].empty())
      probs = &r["completion_probabilities"][0]["top_logprobs"];
    if (!probs || !probs->is_array() || probs->empty())
      throw FormatError("llama-server: /completion gave no next-token distribution (completion_probabilities[0].top_logprobs)");
    const std::size_t V = vocab_hint > 0 ? vocab_hint : probs->size();
    if (probs->size() != V)
      throw FormatError(fmt::format("llama-server: /completion gave {} token probabilities, expected the whole vocabulary ({})", probs->size(), V));
    std::vector<double> lp(V, std::numeric_limits<double>::quiet_NaN());
    for (const auto& e : *probs) {
      const long id = e.value("id", -1L);
      if (id < 0 || static_cast<std::size_t>(id) >= V || !e.contains("logprob") || !e["logprob"].is_number())
        throw FormatError(fmt::format("llama-server: /completion gave a token probability out of place (id {})", id));
      lp[static_cast<std::size_t>(id)] = e["logprob"].get<double>();
    }
    for (double x : lp)
      if (std::isnan(x)) throw FormatError("llama-server: /completion's distribution misses a token");
    return lp;
  }

  // Scored positions of one window, [S][V] log-probabilities, from the context saved in slot file
  // `file` (n tokens). llama-server evaluates at least one token of every prompt, so the first
  // prediction (after the context's last token) recomputes that token from the restored cache;
  // the slot is then restored again, and the continuation is evaluated after the whole restored
  // context, every context token's K/V as the file holds them (the reuse protocol).
  std::vector<std::vector<double>> score(std::span<const int> seq, int ctx, const char* file, std::size_t& vocab) const {
    std::vector<std::vector<double>> out;
    for (std::size_t i = static_cast<std::size_t>(ctx); i < seq.size(); ++i) {
      if (i <= static_cast<std::size_t>(ctx) + 1) restore(file, ctx);
      out.push_back(next_logprobs(seq.subspan(0, i), vocab));
      vocab = out.back().size();
    }
    return out;
  }

  void restore(const char* file, std::int64_t n) const {
    const json r = post("/slots/0?action=restore", {{"filename", slot_file(file)}});
    require(r.value("n_restored", -1L) == n, "llama-server restored {} tokens of {}", r.value("n_restored", -1L), n);
  }

  // The context evaluated into the empty slot (nothing predicted) and saved: slot file "context",
  // and its state.
  LlamaState context_state(std::span<const int> context) const {
    post("/slots/0?action=erase", json::object());
    post("/completion", {{"prompt", std::vector<int>(context.begin(), context.end())},
                         {"n_predict", 0},
                         {"id_slot", 0},
                         {"cache_prompt", true},
                         {"temperature", 0}});
    post("/slots/0?action=save", {{"filename", slot_file("context")}});
    LlamaState st = load_llama_state(slot_path("context"), shape);
    require(st.cells() == static_cast<std::int64_t>(context.size()), "llama-server saved {} cells of a {}-token context", st.cells(),
            context.size());
    return st;
  }

  std::string slot_file(const char* what) const { return fmt::format("vq-engine-{}.bin", what); }
  std::string slot_path(const char* what) const { return (work / "slots" / slot_file(what)).string(); }

  // The method's reconstruction of the saved context, as slot file "method"; its caches' bits.
  CacheBits write_method(const LlamaState& saved, const std::string& method, int chunk) {
    auto caches = caches_of(method);
    require(caches.size() == saved.layers.size(), "{}: {} caches for {} layers", method, caches.size(), saved.layers.size());
    LlamaState st = saved;
    const std::int64_t n = saved.cells();
    for (std::size_t l = 0; l < caches.size(); ++l) {
      caches[l]->expect_tokens(n);
      feed_in_chunks(*caches[l], saved.layers[l].keys.to(DType::F32), saved.layers[l].values.to(DType::F32), chunk);
    }
    const CacheBits bits = cache_bits(caches);
    for (std::size_t l = 0; l < caches.size(); ++l) {
      const KVState kv = caches[l]->state();
      st.layers[l] = {kv.keys.contiguous(true), kv.values.contiguous(true)};
      for (const Tensor* t : {&st.layers[l].keys, &st.layers[l].values})
        for (float x : t->to_f32_vector())
          if (!std::isfinite(x)) throw InvalidArgument(fmt::format("{}: layer {} reconstructs a non-finite K/V value", method, l));
    }
    save_llama_state(slot_path("method"), st);
    return bits;
  }
};

LlamaEngine::LlamaEngine(LlamaEngineOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
LlamaEngine::~LlamaEngine() = default;

std::vector<int> LlamaEngine::tokenize(const std::string& text) const {
  const json r = impl_->post("/tokenize", {{"content", text}, {"add_special", false}, {"parse_special", false}});
  const json& t = r.at("tokens");
  require(t.is_array(), "llama-server: /tokenize gave no token list");
  return t.get<std::vector<int>>();
}

int LlamaEngine::bos() const { return impl_->bos_id; }

const GgufShape& LlamaEngine::gguf_shape() const { return impl_->gguf; }

LlamaState LlamaEngine::context_state(std::span<const int> context) { return impl_->context_state(context); }

std::vector<MethodResult> LlamaEngine::evaluate(const std::vector<int>& tokens, const std::vector<std::string>& methods,
                                                const EvalOptions& options) {
  Impl& m = *impl_;
  require(options.protocol == EvalProtocol::Reuse,
          "--engine llama scores the reuse protocol only (a context compressed, restored into llama-server, the rest scored): give "
          "--protocol reuse");
  require(options.exact_prefill,
          "--engine llama prefills the context exactly (llama.cpp computes it) and compresses it afterwards: --prefill method is ours only");
  options.validate(m.o.context);
  require(!methods.empty(), "no methods to evaluate");
  (void)check_method_profiles(methods, m.gguf.fingerprint, m.o.model);
  m.load_weights();
  require(!tokens.empty(), "the text holds no tokens");
  EvalOptions o = options;
  if (static_cast<std::int64_t>(tokens.size()) < o.window - 1) o.window = static_cast<int>(tokens.size()) + 1;
  require(o.ctx >= 1 && o.ctx < o.window, "the text holds {} tokens: nothing is left to score after a --ctx of {}", tokens.size(), o.ctx);
  const int per_window = o.window - 1;
  const std::int64_t S = o.window - o.ctx;
  std::int64_t n_windows = static_cast<std::int64_t>(tokens.size()) / per_window;
  if (o.max_tokens > 0) n_windows = std::min<std::int64_t>(n_windows, o.max_tokens / S + (o.max_tokens % S != 0));
  const std::size_t M = methods.size();
  const std::size_t n_runs = static_cast<std::size_t>(n_windows) * (M + 1);
  std::size_t done = 0;
  std::vector<ScoreSums> acc(M);
  std::vector<std::string> errors(M);
  double ref_nll = 0;
  std::int64_t ref_tokens = 0;
  std::size_t vocab = 0;

  for (std::int64_t w = 0; w < n_windows; ++w) {
    std::vector<int> seq{m.bos_id};
    seq.insert(seq.end(), tokens.begin() + w * per_window, tokens.begin() + (w + 1) * per_window);
    const std::span<const int> s(seq);
    // 1: the context into the slot (nothing predicted), saved exact.
    const LlamaState saved = m.context_state(s.subspan(0, static_cast<std::size_t>(o.ctx)));
    // 2: the reference, from the exact slot.
    const auto ref = m.score(s, o.ctx, "context", vocab);
    std::vector<std::vector<double>> ref_p(ref.size());
    std::vector<std::size_t> ref_top(ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i) {
      ref_p[i].resize(vocab);
      for (std::size_t v = 0; v < vocab; ++v) ref_p[i][v] = std::exp(ref[i][v]);
      ref_top[i] = static_cast<std::size_t>(std::max_element(ref[i].begin(), ref[i].end()) - ref[i].begin());
      ref_nll -= ref[i][static_cast<std::size_t>(seq[static_cast<std::size_t>(o.ctx) + i])];
      ++ref_tokens;
    }
    if (o.progress) o.progress(static_cast<double>(++done) / static_cast<double>(n_runs));
    // 3: each method's context restored, the same positions scored.
    for (std::size_t j = 0; j < M; ++j) {
      // A method that cannot code this context (its own error, not the server's) becomes a row with
      // that error; the others go on.
      if (errors[j].empty()) {
        try {
          acc[j].bits.add(m.write_method(saved, methods[j], o.chunk));
        } catch (const InvalidArgument& e) {
          errors[j] = e.what();
        } catch (const FormatError& e) {
          errors[j] = e.what();
        }
      }
      if (errors[j].empty()) {
        const auto got = m.score(s, o.ctx, "method", vocab);
        for (std::size_t i = 0; i < got.size(); ++i) {
          acc[j].kl += next_token_kl(ref[i], ref_p[i], got[i]);
          acc[j].nll -= got[i][static_cast<std::size_t>(seq[static_cast<std::size_t>(o.ctx) + i])];
          acc[j].agree += static_cast<std::size_t>(std::max_element(got[i].begin(), got[i].end()) - got[i].begin()) == ref_top[i];
          ++acc[j].tokens;
        }
      }
      if (o.progress) o.progress(static_cast<double>(++done) / static_cast<double>(n_runs));
    }
  }
  const double ppl_ref = std::exp(ref_nll / static_cast<double>(ref_tokens));
  std::vector<MethodResult> out;
  for (std::size_t j = 0; j < M; ++j)
    out.push_back(errors[j].empty() ? acc[j].result(methods[j], ppl_ref) : MethodResult::failed(methods[j], errors[j]));
  return out;
}

}  // namespace vq
