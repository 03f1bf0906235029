// llama2.c forward pass over a chunk of tokens; see transformer.hpp for the architecture.
#include "veloxquant/model/transformer.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include <fmt/core.h>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

constexpr float kRmsEps = 1e-5f;
constexpr float kRopeTheta = 10000.0f;

// out[t, o] = sum_i in[t, i] * wt[i, o] for t < n, with wt the TRANSPOSED nn.Linear weight
// [in_dim, out_dim]. The inner loop is an axpy over contiguous outputs, which vectorises without
// reassociating anything: each output sums its products in order i = 0, 1, ..., exactly as run.c's
// matmul does.
// out[t, o] = sum_i in[t, i] * wt[i, o] for t < n, with wt the TRANSPOSED nn.Linear weight
// [in_dim, out_dim]. The inner loop is an axpy over contiguous outputs, which vectorises without
// reassociating anything: each output sums its products in order i = 0, 1, ..., exactly as run.c's
// matmul does. Compiled for AVX2 and baseline x86-64, chosen at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void matmul_t(float* __restrict out, const float* __restrict in, const float* __restrict wt, int n, int in_dim, int out_dim) {
  const std::size_t O = static_cast<std::size_t>(out_dim);
  for (int t = 0; t < n; ++t) {
    const float* x = in + static_cast<std::size_t>(t) * static_cast<std::size_t>(in_dim);
    float* __restrict y = out + static_cast<std::size_t>(t) * O;
    for (std::size_t o = 0; o < O; ++o) y[o] = 0.0f;
    for (int i = 0; i < in_dim; ++i) {
      const float xi = x[i];
      const float* __restrict w = wt + static_cast<std::size_t>(i) * O;
      for (std::size_t o = 0; o < O; ++o) y[o] += xi * w[o];
    }
  }
}

// Per layer, [rows, cols] -> [cols, rows].
std::vector<float> transpose_layers(const std::vector<float>& w, int layers, int rows, int cols) {
  std::vector<float> t(w.size());
  const std::size_t R = static_cast<std::size_t>(rows), C = static_cast<std::size_t>(cols);
  for (std::size_t l = 0; l < static_cast<std::size_t>(layers); ++l)
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t c = 0; c < C; ++c) t[l * R * C + c * R + r] = w[l * R * C + r * C + c];
  return t;
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

// exp(x) for x <= 0 (softmax inputs after subtracting the max), written so the compiler vectorises
// a loop over it: Cody-Waite range reduction x = n ln2 + r and Cephes' degree-6 expf polynomial,
// within 2 ulp of std::exp on [-87, 0]; below -87 it returns 2^-126-ish instead of a denormal,
// which is invisible next to the softmax maximum's exp(0) = 1.
inline float exp_nonpositive(float x) {
  // Clamp at -87 on the bits: for x <= 0 a larger magnitude has larger unsigned bits. (A float
  // compare would keep the loop scalar: GCC will not if-convert it under -ftrapping-math.)
  const std::uint32_t lim = std::bit_cast<std::uint32_t>(-87.0f);
  const std::uint32_t b = std::bit_cast<std::uint32_t>(x);
  x = std::bit_cast<float>(b > lim ? lim : b);
  const float rounder = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, half to even
  const float n = (x * 1.44269504088896341f + rounder) - rounder;
  float r = x - n * 0.693359375f;  // ln2 split in a part exact in float and the rest
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n from the rounder trick's bits: n + 127 is in [0, 127] here, so it fits the exponent field.
  const std::int32_t e = (static_cast<std::int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

// x[i] = exp(x[i] - m). Kept out of line so the compiler does not fuse it with the (sequential,
// unvectorisable) sum that follows, which would block vectorising the exps.
__attribute__((noinline)) void exp_shifted(float* __restrict x, int size, float m) {
  for (int i = 0; i < size; ++i) x[i] = exp_nonpositive(x[i] - m);
}

void softmax(float* x, int size) {
  float max_val = x[0];
  for (int i = 1; i < size; ++i) max_val = std::max(max_val, x[i]);
  exp_shifted(x, size, max_val);
  float sum = 0.0f;
  for (int i = 0; i < size; ++i) sum += x[i];
  for (int i = 0; i < size; ++i) x[i] /= sum;
}

// Attention scores q . k_t / sqrt(head_size) for t < len, keys contiguous [len, HS]; the sum runs in order
// d = 0..HS-1 as run.c's, and the loop over t vectorises for a compile-time head size.
template <int HS>
void scores_fixed(const float* __restrict q, const float* __restrict k, int len, float sqrt_hs, float* __restrict out) {
  for (int t = 0; t < len; ++t) {
    float s = 0.0f;
    for (int d = 0; d < HS; ++d) s += q[d] * k[t * HS + d];
    out[t] = s / sqrt_hs;
  }
}

void scores_any(const float* q, const float* k, std::int64_t stride, int hs, int len, float sqrt_hs, float* out) {
  for (int t = 0; t < len; ++t) {
    const float* kt = k + static_cast<std::size_t>(t) * static_cast<std::size_t>(stride);
    float s = 0.0f;
    for (int d = 0; d < hs; ++d) s += q[d] * kt[d];
    out[t] = s / sqrt_hs;
  }
}

std::size_t sz(long long v) { return static_cast<std::size_t>(v); }

}  // namespace

Transformer::Transformer(Checkpoint checkpoint) : ck_(std::move(checkpoint)) {
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
  scores_.resize(sz(c.seq_len));
  const int L = c.n_layers;
  wq_t_ = transpose_layers(ck_.wq, L, c.dim, c.dim);
  wk_t_ = transpose_layers(ck_.wk, L, c.kv_dim(), c.dim);
  wv_t_ = transpose_layers(ck_.wv, L, c.kv_dim(), c.dim);
  wo_t_ = transpose_layers(ck_.wo, L, c.dim, c.dim);
  w1_t_ = transpose_layers(ck_.w1, L, c.hidden_dim, c.dim);
  w2_t_ = transpose_layers(ck_.w2, L, c.dim, c.hidden_dim);
  w3_t_ = transpose_layers(ck_.w3, L, c.hidden_dim, c.dim);
  wcls_t_.assign(ck_.classifier(), ck_.classifier() + sz(c.vocab_size) * sz(c.dim));
  wcls_t_ = transpose_layers(wcls_t_, 1, c.vocab_size, c.dim);
}

ModelDescription Transformer::description() const { return ModelDescription::uniform(config().n_layers, config().head_size()); }

void Transformer::ensure_capacity(int n) {
  if (n <= capacity_) return;
  const ModelConfig& c = config();
  const std::size_t N = sz(n);
  x_.resize(N * sz(c.dim));
  xb_.resize(N * sz(c.dim));
  q_.resize(N * sz(c.dim));
  att_out_.resize(N * sz(c.dim));
  k_.resize(N * sz(c.kv_dim()));
  v_.resize(N * sz(c.kv_dim()));
  kbuf_.resize(N * sz(c.kv_dim()));
  vbuf_.resize(N * sz(c.kv_dim()));
  hb_.resize(N * sz(c.hidden_dim));
  hb2_.resize(N * sz(c.hidden_dim));
  capacity_ = n;
}

std::vector<float> Transformer::forward(std::span<const int> tokens, std::vector<std::shared_ptr<KVCache>>& caches) {
  const ModelConfig& c = config();
  const int n = static_cast<int>(tokens.size());
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

  const int dim = c.dim, kv_dim = c.kv_dim(), hs = c.head_size(), hidden = c.hidden_dim, half = hs / 2;
  const int n_kv = c.n_kv_heads, group = c.n_heads / c.n_kv_heads;
  const std::size_t D = sz(dim), KV = sz(kv_dim), H = sz(hidden);
  const float sqrt_hs = std::sqrt(static_cast<float>(hs));

  for (int i = 0; i < n; ++i)
    std::copy_n(ck_.token_embedding.data() + sz(tokens[sz(i)]) * D, D, x_.data() + sz(i) * D);

  for (int l = 0; l < c.n_layers; ++l) {
    const std::size_t L = sz(l);
    for (int i = 0; i < n; ++i) rmsnorm(xb_.data() + sz(i) * D, x_.data() + sz(i) * D, ck_.rms_att.data() + L * D, dim);
    matmul_t(q_.data(), xb_.data(), wq_t_.data() + L * D * D, n, dim, dim);
    matmul_t(k_.data(), xb_.data(), wk_t_.data() + L * KV * D, n, dim, kv_dim);
    matmul_t(v_.data(), xb_.data(), wv_t_.data() + L * KV * D, n, dim, kv_dim);

    // RoPE on q and k (interleaved pairs), then K/V into [n_kv, n, hs] for the cache.
    for (int i = 0; i < n; ++i) {
      const float* cs = rope_cos_.data() + sz(pos0 + i) * sz(half);
      const float* sn = rope_sin_.data() + sz(pos0 + i) * sz(half);
      auto rotate = [&](float* vec, int width) {
        for (int j = 0; j < width; j += 2) {
          const int p = (j % hs) / 2;
          const float v0 = vec[j], v1 = vec[j + 1];
          vec[j] = v0 * cs[p] - v1 * sn[p];
          vec[j + 1] = v0 * sn[p] + v1 * cs[p];
        }
      };
      rotate(q_.data() + sz(i) * D, dim);
      rotate(k_.data() + sz(i) * KV, kv_dim);
      for (int h = 0; h < n_kv; ++h) {
        std::copy_n(k_.data() + sz(i) * KV + sz(h * hs), hs, kbuf_.data() + (sz(h) * sz(n) + sz(i)) * sz(hs));
        std::copy_n(v_.data() + sz(i) * KV + sz(h * hs), hs, vbuf_.data() + (sz(h) * sz(n) + sz(i)) * sz(hs));
      }
    }
    const Shape4 shape{1, n_kv, n, hs};
    const Tensor kin = Tensor::wrap(kbuf_.data(), shape, DType::F32);
    const Tensor vin = Tensor::wrap(vbuf_.data(), shape, DType::F32);
    auto [kc, vc] = caches[L]->update_and_fetch(kin, vin);
    const std::int64_t T = pos0 + n;
    for (const Tensor* t : {&kc, &vc})
      if (t->dim(0) != 1 || t->dim(1) != n_kv || t->dim(2) != T || t->dim(3) != hs)
        throw InvalidArgument(fmt::format("layer {} cache returned {}, expected [1, {}, {}, {}]", l, shape_string(t->shape()), n_kv, T, hs));

    // Row pointers into what the cache returned, converted to float32 when it is not already.
    auto rows = [&](const Tensor& t, std::vector<float>& scratch, int h, std::int64_t& stride) -> const float* {
      if (t.dtype() == DType::F32) {
        stride = t.strides()[2];
        return reinterpret_cast<const float*>(t.row(0, h, 0));
      }
      scratch.resize(sz(T) * sz(hs));
      for (std::int64_t s = 0; s < T; ++s) to_f32(t.row(0, h, s), t.dtype(), scratch.data() + sz(s) * sz(hs), sz(hs));
      stride = hs;
      return scratch.data();
    };

    for (int kh = 0; kh < n_kv; ++kh) {
      std::int64_t ks = 0, vs = 0;
      const float* kp = rows(kc, kscratch_, kh, ks);
      const float* vp = rows(vc, vscratch_, kh, vs);
      for (int i = 0; i < n; ++i) {
        const int len = static_cast<int>(pos0) + i + 1;  // causal: cache positions 0 .. pos0 + i
        for (int h = kh * group; h < (kh + 1) * group; ++h) {
          const float* q = q_.data() + sz(i) * D + sz(h * hs);
          float* att = scores_.data();
          if (hs == 8 && ks == 8)
            scores_fixed<8>(q, kp, len, sqrt_hs, att);
          else if (hs == 16 && ks == 16)
            scores_fixed<16>(q, kp, len, sqrt_hs, att);
          else
            scores_any(q, kp, ks, hs, len, sqrt_hs, att);
          softmax(att, len);
          float* out = att_out_.data() + sz(i) * D + sz(h * hs);
          std::fill_n(out, hs, 0.0f);
          for (int t = 0; t < len; ++t) {
            const float* v = vp + sz(t) * sz(vs);
            const float a = att[t];
            for (int d = 0; d < hs; ++d) out[d] += a * v[d];
          }
        }
      }
    }

    matmul_t(xb_.data(), att_out_.data(), wo_t_.data() + L * D * D, n, dim, dim);
    for (std::size_t j = 0; j < sz(n) * D; ++j) x_[j] += xb_[j];

    for (int i = 0; i < n; ++i) rmsnorm(xb_.data() + sz(i) * D, x_.data() + sz(i) * D, ck_.rms_ffn.data() + L * D, dim);
    matmul_t(hb_.data(), xb_.data(), w1_t_.data() + L * H * D, n, dim, hidden);
    matmul_t(hb2_.data(), xb_.data(), w3_t_.data() + L * H * D, n, dim, hidden);
    for (std::size_t j = 0; j < sz(n) * H; ++j) {
      float val = hb_[j];
      val *= 1.0f / (1.0f + std::exp(-val));  // silu
      hb_[j] = val * hb2_[j];
    }
    matmul_t(xb_.data(), hb_.data(), w2_t_.data() + L * D * H, n, hidden, dim);
    for (std::size_t j = 0; j < sz(n) * D; ++j) x_[j] += xb_[j];
  }

  for (int i = 0; i < n; ++i) rmsnorm(x_.data() + sz(i) * D, x_.data() + sz(i) * D, ck_.rms_final.data(), dim);
  std::vector<float> logits(sz(n) * sz(c.vocab_size));
  matmul_t(logits.data(), x_.data(), wcls_t_.data(), n, dim, c.vocab_size);
  return logits;
}

std::vector<std::shared_ptr<KVCache>> make_fp32_caches(const Transformer& model) {
  std::vector<std::shared_ptr<KVCache>> caches;
  for (int l = 0; l < model.config().n_layers; ++l) caches.push_back(std::make_shared<KVCache>());
  return caches;
}

}  // namespace vq
