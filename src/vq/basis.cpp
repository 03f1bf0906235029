#include "veloxquant/vq/basis.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <cmath>
#include <numeric>
#include <random>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// fn(0) .. fn(count - 1) on up to hardware_concurrency() threads (each index exactly once; what an
// index computes does not depend on the thread). The first exception thrown is rethrown here.
void parallel_for(int count, const std::function<void(int)>& fn) {
  const int threads = std::min(count, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  if (threads <= 1) {
    for (int i = 0; i < count; ++i) fn(i);
    return;
  }
  std::atomic<int> next{0};
  std::exception_ptr error;
  std::mutex mu;
  const auto work = [&] {
    for (int i; (i = next.fetch_add(1)) < count;) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

// Symmetric square root and inverse square root of a PSD matrix; eigenvalues below 1e-6 of the
// largest are raised to it, so a rank-deficient output projection cannot make the inverse blow up.
void sym_sqrt(const std::vector<double>& m, int n, std::vector<double>& root, std::vector<double>& inv_root) {
  std::vector<double> lambda;
  const std::vector<double> u = symmetric_eigen(m, n, lambda);
  const double floor = std::max(lambda.front(), 1e-30) * 1e-6;
  root.assign(sz(n) * sz(n), 0.0);
  inv_root.assign(sz(n) * sz(n), 0.0);
  for (int k = 0; k < n; ++k) {
    const double l = std::max(lambda[sz(k)], floor), r = std::sqrt(l), ir = 1.0 / r;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        const double p = u[sz(i) * sz(n) + sz(k)] * u[sz(j) * sz(n) + sz(k)];
        root[sz(i) * sz(n) + sz(j)] += r * p;
        inv_root[sz(i) * sz(n) + sz(j)] += ir * p;
      }
  }
}

// Sylvester Hadamard of order n (a power of two) times random signs, scaled to be orthonormal:
// fwd = H D / sqrt(n), inv = fwd^T. The seed is fixed: the decoder must rebuild the same signs.
void hadamard_block(int n, std::uint64_t seed, std::vector<double>& fwd, std::vector<double>& inv) {
  require(n > 0 && (n & (n - 1)) == 0, "vq: basis=hadamard needs a power-of-two row or head size, got {}", n);
  std::mt19937_64 rng(seed);
  std::vector<double> sign(sz(n));
  for (auto& s : sign) s = (rng() & 1) ? -1.0 : 1.0;
  fwd.assign(sz(n) * sz(n), 0.0);
  inv.assign(sz(n) * sz(n), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(n));
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      const double h = (std::popcount(static_cast<unsigned>(i & j)) & 1) ? -scale : scale;
      fwd[sz(i) * sz(n) + sz(j)] = h * sign[sz(j)];
      inv[sz(j) * sz(n) + sz(i)] = h * sign[sz(j)];
    }
}

// Place block matrices on the diagonal of an n x n float matrix.
void put_block(std::vector<float>& out, int n, int at, const std::vector<double>& block, int bn) {
  for (int i = 0; i < bn; ++i)
    for (int j = 0; j < bn; ++j) out[sz(at + i) * sz(n) + sz(at + j)] = static_cast<float>(block[sz(i) * sz(bn) + sz(j)]);
}

// The Weights basis of one block of `bn` channels starting at row `r0` of W ([rows, dim]):
// fwd = B^T S, inv = S^-1 B, with B the eigenvectors of S W diag(g)^2 W^T S.
void weights_block(const VqLayerWeights& w, std::span<const float> wmat, int r0, int bn, const std::vector<double>& s,
                   const std::vector<double>& s_inv, std::vector<double>& fwd, std::vector<double>& inv) {
  const int dim = w.dim;
  std::vector<double> cov(sz(bn) * sz(bn), 0.0);
  for (int a = 0; a < bn; ++a)
    for (int b = a; b < bn; ++b) {
      double acc = 0;
      const float* ra = wmat.data() + sz(r0 + a) * sz(dim);
      const float* rb = wmat.data() + sz(r0 + b) * sz(dim);
      for (int i = 0; i < dim; ++i) acc += static_cast<double>(ra[i]) * rb[i] * w.rms_att[sz(i)] * w.rms_att[sz(i)];
      cov[sz(a) * sz(bn) + sz(b)] = cov[sz(b) * sz(bn) + sz(a)] = acc;
    }
  // shaped = S cov S
  std::vector<double> tmp(sz(bn) * sz(bn), 0.0), shaped(sz(bn) * sz(bn), 0.0);
  for (int i = 0; i < bn; ++i)
    for (int j = 0; j < bn; ++j)
      for (int k = 0; k < bn; ++k) tmp[sz(i) * sz(bn) + sz(j)] += s[sz(i) * sz(bn) + sz(k)] * cov[sz(k) * sz(bn) + sz(j)];
  for (int i = 0; i < bn; ++i)
    for (int j = 0; j < bn; ++j)
      for (int k = 0; k < bn; ++k) shaped[sz(i) * sz(bn) + sz(j)] += tmp[sz(i) * sz(bn) + sz(k)] * s[sz(k) * sz(bn) + sz(j)];
  std::vector<double> lambda;
  const std::vector<double> b = symmetric_eigen(shaped, bn, lambda);
  fwd.assign(sz(bn) * sz(bn), 0.0);
  inv.assign(sz(bn) * sz(bn), 0.0);
  for (int i = 0; i < bn; ++i)
    for (int j = 0; j < bn; ++j)
      for (int k = 0; k < bn; ++k) {
        fwd[sz(i) * sz(bn) + sz(j)] += b[sz(k) * sz(bn) + sz(i)] * s[sz(k) * sz(bn) + sz(j)];      // B^T S
        inv[sz(i) * sz(bn) + sz(j)] += s_inv[sz(i) * sz(bn) + sz(k)] * b[sz(k) * sz(bn) + sz(j)];  // S^-1 B
      }
}

}  // namespace

VqBasis vq_basis_from_name(const std::string& name) {
  if (name == "identity") return VqBasis::Identity;
  if (name == "hadamard") return VqBasis::Hadamard;
  if (name == "weights") return VqBasis::Weights;
  if (name == "profile") return VqBasis::Profile;  // with profile=PATH only (the method row checks)
  throw InvalidArgument(fmt::format("vq: basis={} is not valid; use basis=weights, basis=hadamard or basis=identity", name));
}

const char* vq_basis_name(VqBasis b) {
  switch (b) {
    case VqBasis::Identity: return "identity";
    case VqBasis::Hadamard: return "hadamard";
    case VqBasis::Profile: return "profile";
    case VqBasis::Weights: break;
  }
  return "weights";
}

std::vector<double> symmetric_eigen(std::vector<double> a, int n, std::vector<double>& values) {
  // The eigenvectors are kept transposed (vt[p][k] = v[k][p]): a rotation then updates two
  // contiguous rows instead of two strided columns, with the same operations on the same values.
  std::vector<double> vt(sz(n) * sz(n), 0.0);
  for (int i = 0; i < n; ++i) vt[sz(i) * sz(n) + sz(i)] = 1.0;
  auto A = [&](int i, int j) -> double& { return a[sz(i) * sz(n) + sz(j)]; };
  double norm = 0;
  for (double x : a) norm += x * x;
  for (int sweep = 0; sweep < 64; ++sweep) {
    double off = 0;
    for (int i = 0; i < n; ++i)
      for (int j = i + 1; j < n; ++j) off += A(i, j) * A(i, j);
    if (off <= 1e-28 * norm) break;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) {
        const double apq = A(p, q);
        if (apq == 0.0) continue;
        const double theta = (A(q, q) - A(p, p)) / (2.0 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
        const double c = 1.0 / std::sqrt(t * t + 1.0), s = t * c;
        for (int k = 0; k < n; ++k) {
          const double akp = A(k, p), akq = A(k, q);
          A(k, p) = c * akp - s * akq;
          A(k, q) = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {
          const double apk = A(p, k), aqk = A(q, k);
          A(p, k) = c * apk - s * aqk;
          A(q, k) = s * apk + c * aqk;
        }
        double* __restrict vp = vt.data() + sz(p) * sz(n);
        double* __restrict vq = vt.data() + sz(q) * sz(n);
        for (int k = 0; k < n; ++k) {
          const double vkp = vp[k], vkq = vq[k];
          vp[k] = c * vkp - s * vkq;
          vq[k] = s * vkp + c * vkq;
        }
      }
  }
  std::vector<int> order(sz(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return A(x, x) > A(y, y); });
  values.resize(sz(n));
  std::vector<double> sorted(sz(n) * sz(n));
  for (int k = 0; k < n; ++k) {
    values[sz(k)] = A(order[sz(k)], order[sz(k)]);
    for (int i = 0; i < n; ++i) sorted[sz(i) * sz(n) + sz(k)] = vt[sz(order[sz(k)]) * sz(n) + sz(i)];
  }
  return sorted;
}

VqLayerModel make_vq_identity_layer(int kv_heads, int head_dim) {
  require(kv_heads > 0 && head_dim > 0, "vq: bad layer shape {} heads x {}", kv_heads, head_dim);
  VqLayerModel m;
  m.kv_heads = kv_heads;
  m.head_dim = head_dim;
  m.k.n = m.v.n = kv_heads * head_dim;
  return m;
}

VqLayerModel make_vq_layer_model(const VqLayerWeights& w, const VqBasisOptions& o) {
  const int H = w.n_kv_heads, D = w.head_dim, n = H * D;
  require(H > 0 && D > 0 && w.n_heads > 0 && w.n_heads % H == 0 && w.dim > 0 && D % 2 == 0,
          "vq: bad layer shape (dim {}, {} query heads, {} KV heads, head dim {})", w.dim, w.n_heads, H, D);
  require(w.wq.size() == sz(w.n_heads) * sz(D) * sz(w.dim) && w.wk.size() == sz(n) * sz(w.dim) && w.wv.size() == sz(n) * sz(w.dim) &&
              w.wo.size() == sz(w.dim) * sz(w.n_heads) * sz(D) && w.rms_att.size() == sz(w.dim),
          "vq: layer weights do not match the layer shape");
  VqLayerModel m = make_vq_identity_layer(H, D);
  if (o.rope)
    for (int p = 0; p < D / 2; ++p) m.rope_freq.push_back(std::pow(o.rope_theta, -2.0 * p / D));
  if (o.basis == VqBasis::Identity) return m;

  const int bn = n <= kVqMaxCrossHead && !o.per_head ? n : D;  // block size
  const int group = w.n_heads / H;              // query heads per KV head
  for (VqSideTransform* side : {&m.k, &m.v}) {
    side->fwd.assign(sz(n) * sz(n), 0.0f);
    side->inv.assign(sz(n) * sz(n), 0.0f);
  }
  // Shaping matrices over the whole row (block-diagonal per head), then cut into blocks.
  std::vector<double> sk(sz(n) * sz(n), 0.0), sk_inv(sz(n) * sz(n), 0.0), sv(sz(n) * sz(n), 0.0), sv_inv(sz(n) * sz(n), 0.0);
  // Heads are independent (each writes its own diagonal block): built on all cores, the same values.
  parallel_for(H, [&](int h) {
    // Keys: E|q_c|^2 ~ sum_i (W_q[c, i] g_i)^2, summed over the group's query heads, averaged over
    // each RoPE pair (the relative rotation mixes a pair's two channels).
    std::vector<double> qe(sz(D), 0.0);
    std::vector<double> m_o(sz(D) * sz(D), 0.0);
    for (int hq = h * group; hq < (h + 1) * group; ++hq) {
      for (int d = 0; d < D; ++d) {
        const float* row = w.wq.data() + sz(hq * D + d) * sz(w.dim);
        for (int i = 0; i < w.dim; ++i) qe[sz(d)] += static_cast<double>(row[i]) * row[i] * w.rms_att[sz(i)] * w.rms_att[sz(i)];
      }
      for (int out = 0; out < w.dim; ++out) {
        const float* row = w.wo.data() + sz(out) * sz(w.n_heads * D) + sz(hq * D);
        for (int a = 0; a < D; ++a)
          for (int b = 0; b < D; ++b) m_o[sz(a) * sz(D) + sz(b)] += static_cast<double>(row[a]) * row[b];
      }
    }
    std::vector<double> root, inv_root;
    sym_sqrt(m_o, D, root, inv_root);
    // Floored relative to the head's largest, as sym_sqrt floors V's: channels no query reads (a
    // --pad-head GGUF's zero channels) would otherwise get a shaping of ~1e-15 and an inverse of
    // ~1e15 that turns rounding noise into coefficients far outside any calibrated range.
    const double qe_floor = std::max(*std::max_element(qe.begin(), qe.end()), 1e-30) * 1e-6;
    for (int d = 0; d < D; ++d) {
      const double pair = 0.5 * (qe[sz(d & ~1)] + qe[sz(d | 1)]);
      const double s = o.shape ? std::sqrt(std::max(pair, qe_floor)) : 1.0;
      sk[sz(h * D + d) * sz(n) + sz(h * D + d)] = s;
      sk_inv[sz(h * D + d) * sz(n) + sz(h * D + d)] = 1.0 / s;
      for (int e = 0; e < D; ++e) {
        sv[sz(h * D + d) * sz(n) + sz(h * D + e)] = o.shape ? root[sz(d) * sz(D) + sz(e)] : (d == e);
        sv_inv[sz(h * D + d) * sz(n) + sz(h * D + e)] = o.shape ? inv_root[sz(d) * sz(D) + sz(e)] : (d == e);
      }
    }
  });
  auto sub = [&](const std::vector<double>& full, int at) {
    std::vector<double> b(sz(bn) * sz(bn));
    for (int i = 0; i < bn; ++i)
      for (int j = 0; j < bn; ++j) b[sz(i) * sz(bn) + sz(j)] = full[sz(at + i) * sz(n) + sz(at + j)];
    return b;
  };
  parallel_for(n / bn, [&](int block) {  // blocks write disjoint diagonal blocks
    const int at = block * bn;
    std::vector<double> fwd, inv;
    if (o.basis == VqBasis::Hadamard) {
      hadamard_block(bn, 0x5eed0000u + static_cast<std::uint64_t>(at), fwd, inv);
      put_block(m.k.fwd, n, at, fwd, bn);
      put_block(m.k.inv, n, at, inv, bn);
      put_block(m.v.fwd, n, at, fwd, bn);
      put_block(m.v.inv, n, at, inv, bn);
      return;
    }
    weights_block(w, w.wk, at, bn, sub(sk, at), sub(sk_inv, at), fwd, inv);
    put_block(m.k.fwd, n, at, fwd, bn);
    put_block(m.k.inv, n, at, inv, bn);
    weights_block(w, w.wv, at, bn, sub(sv, at), sub(sv_inv, at), fwd, inv);
    put_block(m.v.fwd, n, at, fwd, bn);
    put_block(m.v.inv, n, at, inv, bn);
  });
  vq_index_inverse(m.k, H);
  vq_index_inverse(m.v, H);
  return m;
}

void vq_index_inverse(VqSideTransform& side, int kv_heads) {
  side.inv_cols.clear();
  side.fwd_t.clear();
  side.inv_t.clear();
  side.col_span = 0;
  if (side.identity() || kv_heads <= 0 || side.n % kv_heads != 0) return;
  const int n = side.n, d = n / kv_heads;
  // Per-head blocks when every entry outside the head's own d columns is zero.
  bool per_head = kv_heads > 1;
  for (int r = 0; r < n && per_head; ++r)
    for (int j = 0; j < n && per_head; ++j)
      if (j / d != r / d && (side.inv[sz(r) * sz(n) + sz(j)] != 0.0f || side.fwd[sz(r) * sz(n) + sz(j)] != 0.0f)) per_head = false;
  const int span = per_head ? d : n;
  side.col_span = span;
  if (!per_head) {
    side.fwd_t.resize(sz(n) * sz(n));
    side.inv_t.resize(sz(n) * sz(n));
    for (int c = 0; c < n; ++c)
      for (int j = 0; j < n; ++j) {
        side.fwd_t[sz(j) * sz(n) + sz(c)] = side.fwd[sz(c) * sz(n) + sz(j)];
        side.inv_t[sz(j) * sz(n) + sz(c)] = side.inv[sz(c) * sz(n) + sz(j)];
      }
  }
  side.inv_cols.assign(sz(kv_heads) * sz(span) * sz(d), 0.0f);
  for (int h = 0; h < kv_heads; ++h) {
    const int j0 = per_head ? h * d : 0;
    for (int j = 0; j < span; ++j)
      for (int i = 0; i < d; ++i)
        side.inv_cols[(sz(h) * sz(span) + sz(j)) * sz(d) + sz(i)] = side.inv[sz(h * d + i) * sz(n) + sz(j0 + j)];
  }
}

}  // namespace vq
