#include "veloxquant/eval/evaluator.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <cmath>
#include <span>

#include <fmt/format.h>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/cache/fp16_cache.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"

namespace vq {

EvalProtocol eval_protocol_from_name(const std::string& name) {
  if (name == "stream") return EvalProtocol::Stream;
  if (name == "reuse") return EvalProtocol::Reuse;
  throw InvalidArgument("unknown protocol '" + name + "' (expected stream or reuse)");
}

const char* eval_protocol_name(EvalProtocol p) { return p == EvalProtocol::Stream ? "stream" : "reuse"; }

void EvalOptions::validate(int seq_len) const {
  require(window >= 2 && window <= seq_len, "--window must be in 2..{} (the model's seq_len), got {}", seq_len, window);
  require(chunk >= 1, "--chunk must be >= 1, got {}", chunk);
  require(max_tokens >= 0, "--max-tokens must be >= 0, got {}", max_tokens);
  if (protocol == EvalProtocol::Reuse)
    require(ctx >= 1 && ctx < window, "reuse needs 1 <= --ctx < --window, got ctx {} and window {}", ctx, window);
  else
    require(ctx >= 0, "--ctx must be >= 0, got {}", ctx);
  require(!exact_prefill || protocol == EvalProtocol::Reuse, "--prefill exact needs --protocol reuse (a stream's context is its own cache)");
}

void CacheBits::add(const CacheBits& o) {
  fixed_bytes += o.fixed_bytes;
  estimated_bytes += o.estimated_bytes;
  coded_bytes += o.coded_bytes;
  resident_bytes += o.resident_bytes;
  elements += o.elements;
}

CacheBits cache_bits(const std::vector<std::shared_ptr<KVCache>>& caches) {
  CacheBits out;
  for (const auto& c : caches) {
    // From the layout, not state(): state() would make a resident cache materialise K and V.
    if (c->offset() > 0)
      out.elements += static_cast<double>(c->batch()) * static_cast<double>(c->kv_heads()) * static_cast<double>(c->offset()) *
                      static_cast<double>(c->key_dim() + c->value_dim());
    out.resident_bytes += static_cast<double>(c->nbytes());
    // Every cache bills itself (KVCache::stored_bytes): plain caches their dtype, Fp16KVCache the
    // float16 it represents, CacheGen its estimate, the peers their packed codes and metadata.
    const CacheBytes b = c->stored_bytes();
    out.fixed_bytes += b.fixed_bytes;
    out.estimated_bytes += b.estimated_bytes;
    const auto* cg = dynamic_cast<const CacheGenKVCache*>(c.get());
    out.coded_bytes += cg ? static_cast<double>(cg->encoded_key_bytes() + cg->encoded_value_bytes()) : b.estimated_bytes;
  }
  return out;
}

std::vector<std::string> split_method_list(const std::string& list) {
  std::vector<std::string> out;
  std::string item;
  auto flush = [&](bool separator_semicolon) {
    const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    const std::string t = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    item.clear();
    if (t.empty()) return;
    if (!separator_semicolon && !out.empty() && t.find('=') != std::string::npos && t.find(':') == std::string::npos &&
        out.back().find(':') != std::string::npos) {
      out.back() += "," + t;
      return;
    }
    out.push_back(t);
  };
  bool last_sep_semicolon = true;
  for (char ch : list) {
    if (ch == ',' || ch == ';') {
      flush(last_sep_semicolon);
      last_sep_semicolon = ch == ';';
    } else {
      item += ch;
    }
  }
  flush(last_sep_semicolon);
  require(!out.empty(), "the method list is empty");
  return out;
}

namespace {

// log-softmax of one row of logits, in double.
void log_softmax(std::span<const float> logits, std::vector<double>& out) {
  out.resize(logits.size());
  double mx = -INFINITY;
  for (float x : logits) mx = std::max(mx, static_cast<double>(x));
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - mx);
  const double lse = mx + std::log(sum);
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
}

// Logits of the scored positions of one window, [n_scored, vocab], and the caches' bits.
struct WindowRun {
  std::vector<float> logits;
  CacheBits bits;
};

WindowRun run_window(Transformer& model, const std::string& method, std::span<const int> seq, const EvalOptions& o) {
  const int n = static_cast<int>(seq.size());
  auto caches = make_caches(method, model);
  WindowRun out;
  auto prefill = [&](int begin, int end, std::vector<float>* keep_from, int keep_pos) {
    for (int s = begin; s < end; s += o.chunk) {
      const int e = std::min(end, s + o.chunk);
      // Only the logits kept are computed (all of them while streaming, the context's last in reuse).
      const int from = keep_from ? std::clamp(keep_pos - s, 0, e - s) : e - s;
      auto logits = model.forward(seq.subspan(static_cast<std::size_t>(s), static_cast<std::size_t>(e - s)), caches, from);
      if (keep_from) keep_from->insert(keep_from->end(), logits.begin(), logits.end());
    }
  };
  if (o.protocol == EvalProtocol::Stream) {
    const int pre = std::min(o.ctx, n - 1);
    prefill(0, pre, &out.logits, 0);
    for (int p = pre; p < n - 1; ++p) {
      auto logits = model.forward(seq.subspan(static_cast<std::size_t>(p), 1), caches);
      out.logits.insert(out.logits.end(), logits.begin(), logits.end());
    }
    out.bits = cache_bits(caches);
    return out;
  }
  if (o.exact_prefill) {
    // reuse, CacheGen's storage setting: the context prefilled exactly, its K/V then fed to the
    // method's caches in chunks (compressed after the fact); the context's last token recomputed
    // from the compressed ones before it (its logits: the first prediction), then the rest scored
    // after the whole compressed context. serve/llama_engine.hpp does the same in llama.cpp.
    auto exact_ctx = make_caches("fp32", model);
    (void)model.forward(seq.subspan(0, static_cast<std::size_t>(o.ctx)), exact_ctx, o.ctx);  // no logits kept
    for (std::size_t l = 0; l < caches.size(); ++l) {
      const KVState kv = exact_ctx[l]->state();
      feed_in_chunks(*caches[l], kv.keys, kv.values, o.chunk);
    }
    out.bits = cache_bits(caches);
    std::vector<KVState> compressed;
    for (const auto& c : caches) {
      const KVState kv = c->state();
      compressed.push_back({kv.keys.contiguous(true), kv.values.contiguous(true)});
    }
    auto first = make_caches("fp32", model);
    for (std::size_t l = 0; l < caches.size(); ++l)
      first[l]->from_state({compressed[l].keys.slice(2, 0, o.ctx - 1), compressed[l].values.slice(2, 0, o.ctx - 1)});
    out.logits = model.forward(seq.subspan(static_cast<std::size_t>(o.ctx - 1), 1), first);
    auto exact = make_caches("fp32", model);
    for (std::size_t l = 0; l < caches.size(); ++l) exact[l]->from_state(compressed[l]);
    auto logits = model.forward(seq.subspan(static_cast<std::size_t>(o.ctx), static_cast<std::size_t>(n - 1 - o.ctx)), exact);
    out.logits.insert(out.logits.end(), logits.begin(), logits.end());
    return out;
  }
  // reuse: compress the context, hand its dense contents to exact caches, score the rest.
  prefill(0, o.ctx, &out.logits, o.ctx - 1);
  out.bits = cache_bits(caches);
  auto exact = make_caches("fp32", model);
  for (std::size_t l = 0; l < caches.size(); ++l) exact[l]->from_state(caches[l]->state());
  auto logits = model.forward(seq.subspan(static_cast<std::size_t>(o.ctx), static_cast<std::size_t>(n - 1 - o.ctx)), exact);
  out.logits.insert(out.logits.end(), logits.begin(), logits.end());
  return out;
}

// Runs fn(task, worker) for task = 0 .. n - 1 on `workers` threads (worker 0 is the calling
// thread); which worker runs a task is not fixed, so fn must give the same result on any. The
// first exception thrown is rethrown once all have stopped.
void parallel_tasks(std::size_t n, std::size_t workers, const std::function<void(std::size_t, std::size_t)>& fn) {
  workers = std::max<std::size_t>(1, std::min(workers, n));
  std::atomic<std::size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto loop = [&](std::size_t w) {
    for (std::size_t t; (t = next.fetch_add(1)) < n;) {
      try {
        fn(t, w);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
        next = n;  // stop handing out tasks
      }
    }
  };
  std::vector<std::thread> pool;
  for (std::size_t w = 1; w < workers; ++w) pool.emplace_back(loop, w);
  loop(0);
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace

std::vector<MethodResult> evaluate(Transformer& model, const std::vector<int>& tokens, const std::vector<std::string>& methods,
                                   const EvalOptions& options) {
  options.validate(model.config().seq_len);
  require(!methods.empty(), "no methods to evaluate");
  for (const auto& m : methods) (void)MethodSpec::parse(m);  // fail early on a bad spec
  // A text shorter than one window is scored as one shorter window: BOS and the whole text.
  EvalOptions o = options;
  require(!tokens.empty(), "the text holds no tokens");
  if (static_cast<std::int64_t>(tokens.size()) < o.window - 1) o.window = static_cast<int>(tokens.size()) + 1;
  if (o.protocol == EvalProtocol::Reuse)
    require(o.ctx < o.window, "the text holds {} tokens: nothing is left to score after a --ctx of {}", tokens.size(), o.ctx);
  const int vocab = model.config().vocab_size;
  const std::size_t V = static_cast<std::size_t>(vocab);
  const int text_per_window = o.window - 1;  // window = BOS + text tokens
  const std::int64_t scored_per_window = o.protocol == EvalProtocol::Stream ? o.window - 1 : o.window - o.ctx;
  const std::size_t S = static_cast<std::size_t>(scored_per_window);
  const int first_target = o.protocol == EvalProtocol::Stream ? 1 : o.ctx;  // seq index of the first scored token
  std::int64_t n_windows = static_cast<std::int64_t>(tokens.size()) / text_per_window;
  // Windows needed for max_tokens, rounded up without forming max_tokens + scored_per_window - 1
  // (which overflows near INT64_MAX).
  if (o.max_tokens > 0)
    n_windows = std::min<std::int64_t>(n_windows, o.max_tokens / scored_per_window + (o.max_tokens % scored_per_window != 0));
  const std::size_t W = static_cast<std::size_t>(n_windows), M = methods.size();

  // Every (window, run) is one task, run 0 the fp32 reference and run 1 + m method m, handed out
  // window by window to the workers: no barrier between windows, so no core idles while another
  // finishes a window's last run. A method's task scores its own logits against its window's
  // reference (computed by the window's task 0, handed out before it) and keeps its per-position
  // terms; the sums are formed per method in window and position order, as a single-threaded run
  // forms them (a window's terms are folded in once every earlier window's are), so the results do
  // not depend on the threads.
  struct Window {
    std::vector<double> lp, p;       // the reference's log-probabilities [scored, vocab] and exp of them
    std::vector<std::ptrdiff_t> top; // the reference's top-1 per scored position
    std::vector<double> ref_lp;      // the reference's log-probability of each scored target
    bool ready = false;
    std::size_t pending = 0;         // method tasks still to read lp / p (they are freed after the last)
  };
  struct Terms {  // one method's terms of one window, per scored position
    std::vector<double> kl, lp;
    std::int64_t agree = 0;
    CacheBits bits;
    bool ready = false;
  };
  std::vector<Window> win(W);
  std::vector<Terms> terms(W * M);
  ScoreSums ref;
  std::vector<ScoreSums> acc(M);
  std::vector<std::size_t> folded(M, 0);  // per method: the windows summed so far
  std::vector<std::string> errors(M);       // per method: the first error it raised (then its row reports it)
  // Under mu: adds method m's terms of the windows now complete in order, and frees them.
  auto fold = [&](std::size_t m) {
    for (; folded[m] < W && terms[folded[m] * M + m].ready; ++folded[m]) {
      Terms& t = terms[folded[m] * M + m];
      if (t.kl.size() != S) continue;  // the method failed on this window (errors[m] says why)
      for (std::size_t i = 0; i < S; ++i) {
        acc[m].kl += t.kl[i];
        acc[m].nll -= t.lp[i];
        ++acc[m].tokens;
      }
      acc[m].agree += t.agree;
      acc[m].bits.add(t.bits);
      t = Terms{};
    }
  };
  std::mutex mu;
  std::condition_variable ready_cv;
  bool failed = false;  // a reference task threw: its window's method tasks stop waiting
  std::size_t done = 0;
  const std::size_t n_tasks = W * (M + 1);
  auto report = [&] {  // under mu
    ++done;
    if (o.progress) o.progress(static_cast<double>(done) / static_cast<double>(n_tasks));
  };
  // Worker w forwards models[w]: the caller's model, then copies (Transformer.hpp: one model per
  // thread).
  const std::size_t n_threads = o.threads > 0 ? static_cast<std::size_t>(o.threads)
                                              : std::max<std::size_t>(1, std::thread::hardware_concurrency());
  const std::size_t workers = std::min(n_threads, n_tasks);
  std::vector<std::unique_ptr<Transformer>> copies;
  std::vector<Transformer*> models{&model};
  for (std::size_t w = 1; w < workers; ++w) {
    copies.push_back(std::make_unique<Transformer>(model));
    models.push_back(copies.back().get());
  }
  auto window_seq = [&](std::size_t w) {
    std::vector<int> seq(static_cast<std::size_t>(o.window));
    seq[0] = 1;  // BOS
    std::copy_n(tokens.begin() + static_cast<std::ptrdiff_t>(w) * text_per_window, text_per_window, seq.begin() + 1);
    return seq;
  };
  // Task (w, 0): the reference's log-probabilities, their exp (once, not once per method), top-1s
  // and the targets' log-probabilities.
  auto reference = [&](std::size_t w, std::size_t wk) {
    const std::vector<int> seq = window_seq(w);
    const WindowRun base = run_window(*models[wk], "fp32", seq, o);
    std::vector<double> lp_all(S * V), p_all(S * V), ref_lp(S);
    std::vector<std::ptrdiff_t> top(S);
    std::vector<double> lp;
    for (std::size_t i = 0; i < S; ++i) {
      const int target = seq[static_cast<std::size_t>(first_target) + i];
      std::span<const float> rl(base.logits.data() + i * V, V);
      log_softmax(rl, lp);
      std::copy(lp.begin(), lp.end(), lp_all.begin() + static_cast<std::ptrdiff_t>(i * V));
      for (std::size_t v = 0; v < V; ++v) p_all[i * V + v] = std::exp(lp[v]);
      top[i] = std::max_element(rl.begin(), rl.end()) - rl.begin();
      ref_lp[i] = lp[static_cast<std::size_t>(target)];
    }
    const std::lock_guard<std::mutex> lock(mu);
    Window& ww = win[w];
    ww.lp = std::move(lp_all);
    ww.p = std::move(p_all);
    ww.top = std::move(top);
    ww.ref_lp = std::move(ref_lp);
    ww.pending = M;
    ww.ready = true;
    report();
    ready_cv.notify_all();
  };
  parallel_tasks(n_tasks, workers, [&](std::size_t task, std::size_t wk) {
    const std::size_t w = task / (M + 1), run = task % (M + 1);
    Window& ww = win[w];
    if (run == 0) {
      try {
        reference(w, wk);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(mu);
        failed = true;
        ready_cv.notify_all();
        throw;
      }
      return;
    }
    const std::size_t m = run - 1;
    const std::vector<int> seq = window_seq(w);
    // A method that fails (a spec this model cannot take, data it cannot represent) becomes a row
    // with its error; the other methods' rows go on.
    WindowRun r;
    std::string error;
    try {
      r = run_window(*models[wk], methods[m], seq, o);
    } catch (const Error& e) {
      error = e.what();
    }
    {
      // The reference task of this window was handed out before this one and waits on nothing.
      std::unique_lock<std::mutex> lock(mu);
      ready_cv.wait(lock, [&] { return ww.ready || failed; });
      if (!ww.ready) return;  // parallel_tasks rethrows the reference's error
    }
    Terms& t = terms[w * M + m];
    std::vector<double> lp;
    if (error.empty()) {
      t.kl.resize(S);
      t.lp.resize(S);
      t.bits = r.bits;
      for (std::size_t i = 0; i < S; ++i) {
        const int target = seq[static_cast<std::size_t>(first_target) + i];
        const double* lr = ww.lp.data() + i * V;
        const double* pr = ww.p.data() + i * V;
        std::span<const float> ml(r.logits.data() + i * V, V);
        log_softmax(ml, lp);
        t.kl[i] = next_token_kl({lr, V}, {pr, V}, lp);
        t.lp[i] = lp[static_cast<std::size_t>(target)];
        t.agree += (std::max_element(ml.begin(), ml.end()) - ml.begin()) == ww.top[i];
      }
    }
    const std::lock_guard<std::mutex> lock(mu);
    if (!error.empty() && errors[m].empty()) errors[m] = error;
    t.ready = true;
    fold(m);
    if (--ww.pending == 0) {  // the last reader: free the window's reference
      std::vector<double>().swap(ww.lp);
      std::vector<double>().swap(ww.p);
      std::vector<std::ptrdiff_t>().swap(ww.top);
    }
    report();
  });

  for (const Window& ww : win)  // the reference's sum, in window and position order
    for (double x : ww.ref_lp) {
      ref.nll -= x;
      ++ref.tokens;
    }
  const double ppl_ref = std::exp(ref.nll / static_cast<double>(ref.tokens));
  std::vector<MethodResult> out;
  for (std::size_t m = 0; m < methods.size(); ++m) {
    if (!errors[m].empty()) {
      out.push_back(MethodResult::failed(methods[m], errors[m]));
    } else {
      try {
        out.push_back(acc[m].result(methods[m], ppl_ref));
      } catch (const InvalidArgument& e) {  // scores that are not finite
        out.push_back(MethodResult::failed(methods[m], e.what()));
      }
    }
  }
  return out;
}

MethodResult MethodResult::failed(const std::string& method, const std::string& error) {
  MethodResult r;
  r.method = method;
  r.error = error;
  return r;
}

void feed_in_chunks(KVCache& cache, const Tensor& keys, const Tensor& values, int chunk) {
  const std::int64_t n = keys.dim(2);
  for (std::int64_t s = 0; s < n; s += chunk) {
    const std::int64_t e = std::min<std::int64_t>(n, s + chunk);
    cache.update(keys.slice(2, s, e).contiguous(), values.slice(2, s, e).contiguous());
  }
}

double next_token_kl(std::span<const double> ref_lp, std::span<const double> ref_p, std::span<const double> lp) {
  double kl = 0;
  for (std::size_t v = 0; v < lp.size(); ++v) kl += ref_p[v] * (ref_lp[v] - lp[v]);
  return std::max(0.0, kl);
}

MethodResult ScoreSums::result(const std::string& method, double reference_ppl) const {
  MethodResult r;
  r.method = method;
  r.tokens = tokens;
  r.ppl = std::exp(nll / static_cast<double>(tokens));
  r.delta_ppl_pct = 100.0 * (r.ppl / reference_ppl - 1.0);
  r.kl = kl / static_cast<double>(tokens);
  r.top1 = static_cast<double>(agree) / static_cast<double>(tokens);
  r.bits_per_element_fixed = bits.fixed_bits();
  r.bits_per_element_estimated = bits.estimated_bits();
  r.bits_per_element_coded = bits.coded_bits();
  r.resident_bits_per_element = bits.resident_bits();
  // A score that is not a number is a failed run, never a result.
  require(std::isfinite(r.ppl) && std::isfinite(r.kl) && std::isfinite(r.top1) && std::isfinite(reference_ppl),
          "{}: the scores are not finite (ppl {}, reference ppl {}, KL {}, top-1 {} over {} tokens)", r.method, r.ppl, reference_ppl, r.kl,
          r.top1, r.tokens);
  return r;
}

std::vector<SyntheticResult> evaluate_synthetic(const std::vector<std::string>& methods, std::int64_t tokens) {
  constexpr int kLayers = 4;
  std::vector<SyntheticKV> layers;
  for (int l = 0; l < kLayers; ++l) {
    SyntheticKVConfig c;
    c.tokens = tokens;
    c.seed = static_cast<std::uint64_t>(l);
    c.dtype = DType::F32;
    layers.push_back(make_synthetic_kv(c));
  }
  std::vector<SyntheticResult> out;
  for (const auto& m : methods) {
    auto caches = make_caches(MethodSpec::parse(m), ModelDescription::uniform(kLayers, static_cast<int>(layers[0].keys.dim(3))));
    double err = 0, norm = 0;
    for (int l = 0; l < kLayers; ++l) {
      auto [k, v] = caches[static_cast<std::size_t>(l)]->update_and_fetch(layers[static_cast<std::size_t>(l)].keys, layers[static_cast<std::size_t>(l)].values);
      for (const auto& [a, b] : {std::pair{&layers[static_cast<std::size_t>(l)].keys, &k}, std::pair{&layers[static_cast<std::size_t>(l)].values, &v}}) {
        const auto x = a->to_f32_vector(), y = b->to_f32_vector();
        for (std::size_t i = 0; i < x.size(); ++i) {
          err += (static_cast<double>(y[i]) - x[i]) * (static_cast<double>(y[i]) - x[i]);
          norm += static_cast<double>(x[i]) * x[i];
        }
      }
    }
    const CacheBits bits = cache_bits(caches);
    out.push_back({m, bits.fixed_bits(), bits.estimated_bits(), bits.resident_bits(), norm > 0 ? err / norm : 0.0});
  }
  return out;
}

}  // namespace vq
