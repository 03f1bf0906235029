// Transformer: the llama2.c forward pass (Llama 2 architecture), driving one KVCache per layer.
//
// Per layer: RMSNorm (eps 1e-5) -> q, k, v projections -> RoPE on interleaved pairs (theta 10000;
// pair i of a head rotates by pos / 10000^(2i/head_size)) applied to q and k BEFORE the cache, so
// keys are cached post-RoPE -> cache.update(K, V) once per layer for the whole chunk ->
// cache.attend(Q, 1/sqrt(head_size)): causal grouped-query attention computed by the cache over
// what it holds (n_heads / n_kv_heads query heads share a KV head) -> wo -> residual; RMSNorm ->
// SwiGLU FFN w2(silu(w1 x) * w3 x) -> residual. Final RMSNorm and the classifier give the logits.
// Arithmetic outside attention follows run.c (float32 throughout, same operation order per
// element, including each matmul output's sum in input order). Attention is the cache's
// online-softmax loop (cache/attention.hpp: float32, tiled, a vectorisable exp within 2 ulp of
// expf), so logits agree with run.c within float32 rounding rather than bit for bit; the greedy
// sample of stories260K is unchanged (tested).
//
// Attention reads keys and values only through the cache (a resident cache reads its codes and
// never materialises a dense K/V): a lossy cache changes the logits, which is what the evaluation
// measures.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "veloxquant/cache/builder.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/vq/basis.hpp"

namespace vq {

// forward() uses the object's scratch buffers: one Transformer must not forward on two threads at
// once. A copy shares nothing (weights and scratch are copied), so threads may each forward their
// own copy (eval's `threads`).
class Transformer {
 public:
  explicit Transformer(Checkpoint checkpoint);

  const ModelConfig& config() const { return ck_.config; }
  const Checkpoint& checkpoint() const { return ck_; }
  // One attention layer per model layer, each with head dim head_size.
  ModelDescription description() const;

  // Run `tokens` at positions pos0 .. pos0 + n - 1, where pos0 = caches[0]->offset() (all caches
  // must agree), calling caches[l]->update once per layer with [1, n_kv_heads, n, head_size]
  // float32 K and V, then caches[l]->attend with [1, n_heads, n, head_size] float32 queries.
  // Returns the logits of every position, row-major [n, vocab_size]. Query i of the chunk attends
  // to cache positions 0 .. pos0 + i. Throws InvalidArgument on a bad token id, a wrong number of
  // caches, disagreeing offsets, pos0 + n > seq_len, or a cache that does not hold pos0 + n tokens
  // of the model's layout after the update.
  std::vector<float> forward(std::span<const int> tokens, std::vector<std::shared_ptr<KVCache>>& caches);
  // The same, returning only the logits of chunk positions logits_from .. n - 1 ([n - logits_from,
  // vocab_size]; 0 <= logits_from <= n, else InvalidArgument), and skipping the final norm and the
  // classifier (an eighth of stories260K's matmul work per token) for the rows before: a prefill
  // that needs none of its logits, or only its last, does not pay for them. The rows returned are
  // bit for bit forward()'s.
  std::vector<float> forward(std::span<const int> tokens, std::vector<std::shared_ptr<KVCache>>& caches, int logits_from);

  // Layer l's vq transforms for these basis options (vq/basis.hpp; what make_caches gives a `vq`
  // cache), derived from the weights on first use and kept for the model's lifetime: an
  // evaluation builds a set of vq caches per window and setting, and the model (an eigen-
  // decomposition per layer and side) is the same every time. Copies share what is kept (their
  // weights are the same); safe to call from several threads.
  std::shared_ptr<const VqLayerModel> vq_layer_model(int layer, const VqBasisOptions& basis) const;

 private:
  void ensure_capacity(int n);
  Checkpoint ck_;
  struct VqLayerMemo;
  std::shared_ptr<VqLayerMemo> vq_memo_;
  // Weights transposed to [in, out_pad] per layer (out_pad: out rounded up to a multiple of 8,
  // zero-filled), for matmuls vectorised over outputs. wqkv_t_ holds wq, wk, wv side by side
  // ([dim, q_pad + 2 kv_pad]; q_pad: q_dim = n_heads * head_size rounded up), w13_t_ w1 and w3 ([dim, 2 hidden_pad]): one matmul each.
  std::vector<float> wqkv_t_, wo_t_, w13_t_, w2_t_, wcls_t_;
  int dim_pad_ = 0, q_pad_ = 0, kv_pad_ = 0, hidden_pad_ = 0, vocab_pad_ = 0;
  std::vector<float> rope_cos_, rope_sin_;  // [seq_len, head_size / 2]
  int capacity_ = 0;                        // tokens the scratch buffers hold
  std::vector<float> x_, xb_, att_out_;
  std::vector<float> qkv_;  // [n, q_pad + 2 kv_pad]: q, k, v of each token
  std::vector<float> hb_;   // [n, 2 hidden_pad]: w1 x (then the SwiGLU product), w3 x
  std::vector<float> qbuf_;         // Q in [n_heads, n, head_size] for attend
  std::vector<float> kbuf_, vbuf_;  // K/V in [n_kv_heads, n, head_size] for the caches
  Tensor qin_, kin_, vin_;          // qbuf_/kbuf_/vbuf_ wrapped for a chunk of wrapped_n_ tokens
  int wrapped_n_ = 0;
  const float* wrapped_base_ = nullptr;  // kbuf_.data() when kin_ was wrapped
};

// One plain float32 KVCache per layer.
std::vector<std::shared_ptr<KVCache>> make_fp32_caches(const Transformer& model);

}  // namespace vq
