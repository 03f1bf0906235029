// llama2.c forward pass over a chunk of tokens; see transformer.hpp for the architecture.
#include "veloxquant/model/transformer.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>

#include <fmt/core.h>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/vq_layer_models.hpp"
#include "matmul.hpp"
#include "swiglu.hpp"

namespace vq {

namespace {

using detail::matmul_t;

constexpr float kRmsEps = 1e-5f;
constexpr float kRopeTheta = 10000.0f;

std::size_t sz(long long v) { return static_cast<std::size_t>(v); }

int round_up8(int v) { return (v + 7) / 8 * 8; }

// Per layer, [rows, cols] -> [cols, rows_pad], zero-filled past rows.
std::vector<float> transpose_layers(const std::vector<float>& w, int layers, int rows, int cols, int rows_pad) {
  const std::size_t R = static_cast<std::size_t>(rows), C = static_cast<std::size_t>(cols), RP = static_cast<std::size_t>(rows_pad);
  std::vector<float> t(static_cast<std::size_t>(layers) * C * RP, 0.0f);
  for (std::size_t l = 0; l < static_cast<std::size_t>(layers); ++l)
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t c = 0; c < C; ++c) t[l * RP * C + c * RP + r] = w[l * R * C + r * C + c];
  return t;
}

// Per layer, matrices [in_dim, widths[m]] -> one [in_dim, sum of widths], side by side.
std::vector<float> side_by_side(const std::vector<std::vector<float>>& ms, const std::vector<int>& widths, int layers, int in_dim) {
  std::size_t total = 0;
  for (int w : widths) total += static_cast<std::size_t>(w);
  const std::size_t I = static_cast<std::size_t>(in_dim);
  std::vector<float> out(static_cast<std::size_t>(layers) * I * total);
  for (std::size_t l = 0; l < static_cast<std::size_t>(layers); ++l)
    for (std::size_t i = 0; i < I; ++i) {
      float* dst = out.data() + (l * I + i) * total;
      for (std::size_t m = 0; m < ms.size(); ++m) {
        const std::size_t w = static_cast<std::size_t>(widths[m]);
        std::copy_n(ms[m].data() + (l * I + i) * w, w, dst);
        dst += w;
      }
    }
  return out;
}

// run.c's rmsnorm: sequential sum of squares, o = w * (x / rms).
void rmsnorm(float* o, const float* x, const float* w, int size) {
  float ss = 0.0f;
  for (int j = 0; j < size; ++j) ss += x[j] * x[j];
  ss /= static_cast<float>(size);
  ss += kRmsEps;
  ss = 1.0f / std::sqrt(ss);
  for (int j = 0; j < size; ++j) o[j] = w[j] * (ss * x[j]);
}

}  // namespace

// The vq layer models built so far, per (layer, basis options), and the fingerprint they carry.
struct Transformer::VqLayerMemo {
  std::mutex mu;
  std::optional<std::uint64_t> fingerprint;
  std::vector<std::pair<std::pair<int, VqBasisOptions>, std::shared_ptr<const VqLayerModel>>> models;
};

std::shared_ptr<const VqLayerModel> Transformer::vq_layer_model(int layer, const VqBasisOptions& basis) const {
  require(layer >= 0 && layer < config().n_layers, "vq_layer_model: layer {} is outside the model's {} layers", layer, config().n_layers);
  // Built under the lock: concurrent first users of one layer wait for one build, not race to two.
  const std::lock_guard<std::mutex> lock(vq_memo_->mu);
  for (const auto& [key, m] : vq_memo_->models)
    if (key.first == layer && key.second == basis) return m;
  if (!vq_memo_->fingerprint) vq_memo_->fingerprint = vq_model_fingerprint(ck_);
  auto m = std::make_shared<const VqLayerModel>(detail::vq_checkpoint_layer(ck_, static_cast<std::size_t>(layer), basis, *vq_memo_->fingerprint));
  vq_memo_->models.emplace_back(std::pair{layer, basis}, m);
  return m;
}

Transformer::Transformer(Checkpoint checkpoint) : ck_(std::move(checkpoint)), vq_memo_(std::make_shared<VqLayerMemo>()) {
  const ModelConfig& c = ck_.config;
  validate_model_config(c, "model");
  const int half = c.head_size() / 2;
  rope_cos_.resize(sz(c.seq_len) * sz(half));
  rope_sin_.resize(rope_cos_.size());
  for (int pos = 0; pos < c.seq_len; ++pos)
    for (int j = 0; j < half; ++j) {
      // Exactly run.c's float arithmetic: freq = 1 / theta^(head_dim / head_size), head_dim = 2j.
      const float freq = 1.0f / std::pow(kRopeTheta, static_cast<float>(2 * j) / static_cast<float>(c.head_size()));
      const float val = static_cast<float>(pos) * freq;
      rope_cos_[sz(pos) * sz(half) + sz(j)] = std::cos(val);
      rope_sin_[sz(pos) * sz(half) + sz(j)] = std::sin(val);
    }
  const int L = c.n_layers;
  dim_pad_ = round_up8(c.dim);
  q_pad_ = round_up8(c.q_dim());
  kv_pad_ = round_up8(c.kv_dim());
  hidden_pad_ = round_up8(c.hidden_dim);
  vocab_pad_ = round_up8(c.vocab_size);
  wqkv_t_ = side_by_side({transpose_layers(ck_.wq, L, c.q_dim(), c.dim, q_pad_), transpose_layers(ck_.wk, L, c.kv_dim(), c.dim, kv_pad_),
                          transpose_layers(ck_.wv, L, c.kv_dim(), c.dim, kv_pad_)},
                         {q_pad_, kv_pad_, kv_pad_}, L, c.dim);
  wo_t_ = transpose_layers(ck_.wo, L, c.dim, c.q_dim(), dim_pad_);
  w13_t_ = side_by_side({transpose_layers(ck_.w1, L, c.hidden_dim, c.dim, hidden_pad_), transpose_layers(ck_.w3, L, c.hidden_dim, c.dim, hidden_pad_)},
                        {hidden_pad_, hidden_pad_}, L, c.dim);
  w2_t_ = transpose_layers(ck_.w2, L, c.dim, c.hidden_dim, dim_pad_);
  const std::vector<float> cls(ck_.classifier(), ck_.classifier() + sz(c.vocab_size) * sz(c.dim));
  wcls_t_ = transpose_layers(cls, 1, c.vocab_size, c.dim, vocab_pad_);
}

ModelDescription Transformer::description() const { return ModelDescription::uniform(config().n_layers, config().head_size()); }

void Transformer::ensure_capacity(int n) {
  if (n <= capacity_) return;
  const ModelConfig& c = config();
  const std::size_t N = sz(n);
  x_.resize(N * sz(c.dim));
  xb_.resize(N * sz(c.dim));
  att_out_.resize(N * sz(c.q_dim()));
  qkv_.resize(N * sz(q_pad_ + 2 * kv_pad_));
  qbuf_.resize(N * sz(c.q_dim()));
  kbuf_.resize(N * sz(c.kv_dim()));
  vbuf_.resize(N * sz(c.kv_dim()));
  hb_.resize(N * 2 * sz(hidden_pad_));
  capacity_ = n;
  wrapped_n_ = 0;  // kbuf_/vbuf_ may have moved
}

std::vector<float> Transformer::forward(std::span<const int> tokens, std::vector<std::shared_ptr<KVCache>>& caches) {
  return forward(tokens, caches, 0);
}

std::vector<float> Transformer::forward(std::span<const int> tokens, std::vector<std::shared_ptr<KVCache>>& caches, int logits_from) {
  const ModelConfig& c = config();
  const int n = static_cast<int>(tokens.size());
  if (logits_from < 0 || logits_from > n)
    throw InvalidArgument(fmt::format("forward: logits_from {} is outside 0..{} (the chunk's {} tokens)", logits_from, n, n));
  // Checks format their message only on failure: this runs once per decoded token.
  if (caches.size() != sz(c.n_layers))
    throw InvalidArgument(fmt::format("forward needs one cache per layer: the model has {} layers, got {} caches", c.n_layers, caches.size()));
  for (const auto& cache : caches)
    if (!cache) throw InvalidArgument("forward got a null cache");
  const std::int64_t pos0 = caches[0]->offset();
  for (std::size_t l = 1; l < caches.size(); ++l)
    if (caches[l]->offset() != pos0)
      throw InvalidArgument(fmt::format("caches disagree on the position: layer 0 holds {} tokens, layer {} holds {}", pos0, l,
                                        caches[l]->offset()));
  if (pos0 + n > c.seq_len)
    throw InvalidArgument(fmt::format("positions {}..{} exceed the model's context of {} tokens (seq_len)", pos0, pos0 + n - 1, c.seq_len));
  for (int t : tokens)
    if (t < 0 || t >= c.vocab_size) throw InvalidArgument(fmt::format("token id {} is outside the vocabulary 0..{}", t, c.vocab_size - 1));
  if (n == 0) return {};
  ensure_capacity(n);

  const int dim = c.dim, hs = c.head_size(), hidden = c.hidden_dim, half = hs / 2;
  const int n_kv = c.n_kv_heads;
  const std::size_t D = sz(dim), H = sz(hidden), HS = sz(hs);
  // QP: the q block's width in a qkv row (q_dim rounded up to 8); QD: the attention output's width.
  const std::size_t DP = sz(dim_pad_), QP = sz(q_pad_), QD = sz(c.q_dim()), KVP = sz(kv_pad_), HP = sz(hidden_pad_), QKV = QP + 2 * KVP;
  float* const qkv = qkv_.data();
  const float inv_sqrt_hs = 1.0f / std::sqrt(static_cast<float>(hs));
  const std::int64_t T = pos0 + n;

  // The cache input: wrapped once per chunk length (Tensor::wrap validates and allocates).
  // Also when kbuf_ is not the buffer wrapped: a copy of a Transformer has its own buffers, but
  // its Tensors still wrap the original's.
  if (wrapped_n_ != n || wrapped_base_ != kbuf_.data()) {
    const Shape4 shape{1, n_kv, n, hs};
    kin_ = Tensor::wrap(kbuf_.data(), shape, DType::F32);
    vin_ = Tensor::wrap(vbuf_.data(), shape, DType::F32);
    qin_ = Tensor::wrap(qbuf_.data(), Shape4{1, c.n_heads, n, hs}, DType::F32);
    wrapped_n_ = n;
    wrapped_base_ = kbuf_.data();
  }

  for (int i = 0; i < n; ++i)
    std::copy_n(ck_.token_embedding.data() + sz(tokens[sz(i)]) * D, D, x_.data() + sz(i) * D);

  for (int l = 0; l < c.n_layers; ++l) {
    const std::size_t L = sz(l);
    for (int i = 0; i < n; ++i) rmsnorm(xb_.data() + sz(i) * D, x_.data() + sz(i) * D, ck_.rms_att.data() + L * D, dim);
    // q, k, v of token i at qkv + i QKV + {0, QP, QP + KVP}.
    matmul_t(qkv, QKV, xb_.data(), D, wqkv_t_.data() + L * QKV * D, QKV, n, dim, static_cast<int>(QKV));

    // RoPE on q and k (interleaved pairs), then Q into [n_heads, n, hs] for attend and K/V into
    // [n_kv, n, hs] for the cache.
    for (int i = 0; i < n; ++i) {
      const float* cs = rope_cos_.data() + sz(pos0 + i) * sz(half);
      const float* sn = rope_sin_.data() + sz(pos0 + i) * sz(half);
      auto rotate = [&](float* vec, int heads) {
        for (int h = 0; h < heads; ++h, vec += hs)
          for (int p = 0; p < half; ++p) {
            const float v0 = vec[2 * p], v1 = vec[2 * p + 1];
            vec[2 * p] = v0 * cs[p] - v1 * sn[p];
            vec[2 * p + 1] = v0 * sn[p] + v1 * cs[p];
          }
      };
      float* row = qkv + sz(i) * QKV;
      rotate(row, c.n_heads);
      rotate(row + QP, n_kv);
      for (int h = 0; h < c.n_heads; ++h) std::copy_n(row + sz(h * hs), hs, qbuf_.data() + (sz(h) * sz(n) + sz(i)) * HS);
      for (int h = 0; h < n_kv; ++h) {
        std::copy_n(row + QP + sz(h * hs), hs, kbuf_.data() + (sz(h) * sz(n) + sz(i)) * HS);
        std::copy_n(row + QP + KVP + sz(h * hs), hs, vbuf_.data() + (sz(h) * sz(n) + sz(i)) * HS);
      }
    }
    // Append, then attend through the cache's own loop: a resident cache reads its codes tile by
    // tile and never materialises a dense K/V (update, not update_and_fetch).
    caches[L]->update(kin_, vin_);
    if (caches[L]->offset() != T)
      throw InvalidArgument(fmt::format("layer {} cache holds {} tokens after appending {}, expected {}", l, caches[L]->offset(), n, T));
    const Tensor att = caches[L]->attend(qin_, inv_sqrt_hs);
    for (int h = 0; h < c.n_heads; ++h) {
      const float* head = reinterpret_cast<const float*>(att.row(0, h, 0));  // attend's output is contiguous
      for (int i = 0; i < n; ++i) std::copy_n(head + sz(i) * HS, HS, att_out_.data() + sz(i) * QD + sz(h) * HS);
    }

    matmul_t(xb_.data(), D, att_out_.data(), QD, wo_t_.data() + L * DP * QD, DP, n, c.q_dim(), dim);
    for (std::size_t j = 0; j < sz(n) * D; ++j) x_[j] += xb_[j];

    for (int i = 0; i < n; ++i) rmsnorm(xb_.data() + sz(i) * D, x_.data() + sz(i) * D, ck_.rms_ffn.data() + L * D, dim);
    // w1 x and w3 x of token i at hb_ + i 2HP + {0, HP}; the SwiGLU product replaces w1 x.
    matmul_t(hb_.data(), 2 * HP, xb_.data(), D, w13_t_.data() + L * 2 * HP * D, 2 * HP, n, dim, static_cast<int>(2 * HP));
    // silu(x) = x * (1 / (1 + exp(-x))), times w3 x: run.c's operations per element (swiglu.hpp).
    for (int i = 0; i < n; ++i) {
      float* h1 = hb_.data() + sz(i) * 2 * HP;
      detail::swiglu(h1, h1 + HP, H);
    }
    matmul_t(xb_.data(), D, hb_.data(), 2 * HP, w2_t_.data() + L * DP * H, DP, n, hidden, dim);
    for (std::size_t j = 0; j < sz(n) * D; ++j) x_[j] += xb_[j];
  }

  // Rows are independent from here on: the final norm and the classifier only for the rows wanted.
  const int kept = n - logits_from;
  float* const xk = x_.data() + sz(logits_from) * D;
  for (int i = 0; i < kept; ++i) rmsnorm(xk + sz(i) * D, xk + sz(i) * D, ck_.rms_final.data(), dim);
  std::vector<float> logits(sz(kept) * sz(c.vocab_size));
  if (kept > 0) matmul_t(logits.data(), sz(c.vocab_size), xk, D, wcls_t_.data(), sz(vocab_pad_), kept, dim, c.vocab_size);
  return logits;
}

std::vector<std::shared_ptr<KVCache>> make_fp32_caches(const Transformer& model) {
  std::vector<std::shared_ptr<KVCache>> caches;
  for (int l = 0; l < model.config().n_layers; ++l) caches.push_back(std::make_shared<KVCache>());
  return caches;
}

}  // namespace vq
