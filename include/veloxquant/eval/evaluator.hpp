// The quality harness: score KV cache methods against the exact float32 cache on the same tokens.
//
// Protocols (see docs/quality.md):
//   stream: the text is cut into windows of `window` tokens, each starting with BOS. The first
//           `ctx` tokens of a window are prefilled in chunks of `chunk`, the rest is decoded one
//           token per call, all through the method's cache. Every next-token prediction of the
//           window is scored (window - 1 per window).
//   reuse:  CacheGen's setting. A context of `ctx` tokens (BOS first) is prefilled through the
//           method's cache in chunks of `chunk`, "compressed"; its dense contents are then handed
//           to exact caches, and the following `window - ctx` tokens are scored with that context
//           (predictions from position ctx - 1 on). Bits describe the compressed context.
//           With exact_prefill (below), the context is prefilled exactly and compressed afterwards.
// Per method: perplexity, its change vs fp32 in %, mean KL(fp32 || method) of the next-token
// distribution, top-1 agreement with fp32, and the cache's bits per element: fixed-width and
// entropy-estimated (every byte of metadata counted), and resident (the bytes the caches really
// hold, KVCache::nbytes, capacity and scratch included). All are measured where the bits are:
// stream at the end of each window, reuse at the end of each window's context; summed bytes over
// summed elements of all windows.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"

namespace vq {

class Transformer;

enum class EvalProtocol { Stream, Reuse };
EvalProtocol eval_protocol_from_name(const std::string& name);  // "stream" | "reuse"; throws InvalidArgument
const char* eval_protocol_name(EvalProtocol p);

struct EvalOptions {
  EvalProtocol protocol = EvalProtocol::Stream;
  int window = 256;
  int ctx = 128;
  int chunk = 64;
  // reuse only: the context prefilled with the exact cache and its K/V then fed to the method's
  // caches in chunks of `chunk` (CacheGen's storage setting: what a prompt cache stores and what
  // `--engine llama` measures), instead of prefilled through the method's cache (where each layer's
  // K/V already see the lower layers' compressed attention). The context's last token is then
  // recomputed from the compressed tokens before it (the first prediction), and the rest is
  // scored after the whole compressed context.
  bool exact_prefill = false;
  std::int64_t max_tokens = 4096;  // scored tokens per method (0 = the whole text)
  // Called after each run (one window of the reference or of one method) with the fraction done
  // (for progress display); one call at a time, from whichever thread finished the run.
  std::function<void(double)> progress;
  // Threads that run the (window, method) runs (and score them) side by side, each with its own
  // copy of the model (memory: threads x the model's weights), with no barrier between windows;
  // 0 = every hardware thread. The results do
  // not depend on it, bit for bit: every run is the same computation, and its sums are formed in
  // the same order whatever the threads.
  int threads = 1;
  void validate(int seq_len) const;  // throws InvalidArgument
};

struct MethodResult {
  std::string method;
  std::int64_t tokens = 0;
  double ppl = 0, delta_ppl_pct = 0, kl = 0, top1 = 0;
  double bits_per_element_fixed = 0, bits_per_element_estimated = 0;
  double bits_per_element_coded = 0;  // the actual coded size (see CacheBits::coded_bytes)
  double resident_bits_per_element = 0;  // memory the caches hold (see CacheBits::resident_bytes)
  // Set when the method failed (its first error; the numbers above are then 0): evaluate reports a
  // failing method as a row instead of failing every other row.
  std::string error;
  static MethodResult failed(const std::string& method, const std::string& error);
};

// One method's sums over its scored positions (against the reference's distributions): the
// negative log-likelihood of the targets, KL(reference || method), top-1 agreements, tokens and the
// caches' bits; result() turns them into a row (InvalidArgument when a score is not finite).
struct ScoreSums;

// Bits per element a set of per-layer caches costs now: fixed-width and entropy-estimated.
struct CacheBits {
  double fixed_bytes = 0, estimated_bytes = 0, elements = 0;
  // What the cache's real coder writes: CacheGenKVCache's encode_keys/encode_values sizes plus
  // its fp16 residual (its estimated_bytes is an entropy estimate); every other cache's
  // estimated_bytes, which is already its coded (or packed) size.
  double coded_bytes = 0;
  // What the caches hold in memory now: the sum of KVCache::nbytes() (every buffer they keep:
  // codes, parameters, exact windows, unused capacity, dense reconstructions where a method keeps
  // one). A plain float32 cache: 32 bits times capacity / offset. Taken before the other sizes:
  // computing a coded size may make a cache keep its encoding, which is measurement, not decoding.
  double resident_bytes = 0;
  void add(const CacheBits& o);
  double resident_bits() const { return elements > 0 ? 8.0 * resident_bytes / elements : 0.0; }
  double coded_bits() const { return elements > 0 ? 8.0 * coded_bytes / elements : 0.0; }
  double fixed_bits() const { return elements > 0 ? 8.0 * fixed_bytes / elements : 0.0; }
  double estimated_bits() const { return elements > 0 ? 8.0 * estimated_bytes / elements : 0.0; }
};
struct ScoreSums {
  double nll = 0, kl = 0;
  std::int64_t agree = 0, tokens = 0;
  CacheBits bits;
  MethodResult result(const std::string& method, double reference_ppl) const;
};

// What both engines (this one, serve/llama_engine.hpp) do the same way:
// one layer's K and V ([1, H, T, D]) fed to `cache` in chunks of `chunk` tokens, as a prefill feeds them;
void feed_in_chunks(KVCache& cache, const Tensor& keys, const Tensor& values, int chunk);
// KL(reference || method) of one next-token distribution, from log-probabilities over the
// vocabulary (ref_p = exp(ref_lp), computed once per reference), clipped at 0 (rounding).
double next_token_kl(std::span<const double> ref_lp, std::span<const double> ref_p, std::span<const double> lp);

// Elements are the K and V values held (B * H * offset * (D_k + D_v) per cache, from the cache's
// layout: nothing is materialised, so a resident cache is measured as it stands).
CacheBits cache_bits(const std::vector<std::shared_ptr<KVCache>>& caches);

// Split a --methods list. Specs contain commas themselves ("cachegen:bits=4,group=32"), so an item
// holding '=' but no ':' continues the previous spec; ';' always separates.
std::vector<std::string> split_method_list(const std::string& list);

// Score `methods` on `tokens` (the encoded text, without BOS). fp32 is always computed as the
// reference; a method list may name it too (its row then shows ΔPPL 0, KL 0, top-1 1).
std::vector<MethodResult> evaluate(Transformer& model, const std::vector<int>& tokens,
                                   const std::vector<std::string>& methods, const EvalOptions& options);

// Without a model: each method's cache on synthetic LLM-like K/V (see synth/), reporting bits per
// element; ppl, kl and top1 are not defined there and left at 0 with tokens = 0.
struct SyntheticResult {
  std::string method;
  double bits_per_element_fixed = 0, bits_per_element_estimated = 0;
  double resident_bits_per_element = 0;
  double relative_mse = 0;  // ||x_hat - x||^2 / ||x||^2 over K and V
};
std::vector<SyntheticResult> evaluate_synthetic(const std::vector<std::string>& methods, std::int64_t tokens);

}  // namespace vq
