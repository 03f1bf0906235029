// The per-layer linear transforms of our method (`vq`), derived from the model's own weights.
//
// What a reader must know first:
// - The method quantizes one token's K (or V) row of all KV heads, n = H * D values, after a fixed
//   invertible transform y = F x; the cache keeps y's codes and reconstructs x = G y_hat (G = F^-1).
//   The transform is a function of the model only (nothing per cache, nothing shipped with a cache:
//   a reader of the cache has the model anyway), so it costs no stored bytes.
// - Keys are un-rotated first (RoPE undone at the token's position, pairs (2i, 2i+1) as llama2.c):
//   RoPE turns each channel's steady mean into a rotating one, which a per-coefficient mean cannot
//   remove (measured on stories260K: 0.75 bits per key element of avoidable spread).
// - Basis::Weights: F = B^T S. S shapes the quantization noise by what the error costs downstream
//   (keys: the query energy of each RoPE pair, E|q_pair|^2 from W_q and the RMSNorm gain, summed
//   over the query heads sharing the KV head; values: (sum of W_o^T W_o over those query heads)^1/2,
//   the output projection's gain), and B holds the eigenvectors of the covariance the weights imply
//   for S x when the normalised hidden state is white: S W diag(g)^2 W^T S. A KLT computed per
//   cache would cost 32x32 coefficients per layer and side; this one is free and measured within
//   ~0.15 bits of it (docs/methods.md). Basis::Hadamard (random signs, fixed seed) and
//   Basis::Identity are kept for the measured comparison.
// - Rows wider than kMaxCrossHead are transformed per head (block-diagonal), bounding the O(n^3)
//   set-up; stories260K (4 x 8 = 32) is transformed across heads, where most of the gain is.
//   VqBasisOptions::per_head (block=head) asks for per-head blocks at any width.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace vq {

// Profile: axes fitted on the model's own K/V (vq/profile.hpp; set by `profile=PATH`, not by `basis=`).
enum class VqBasis { Identity, Hadamard, Weights, Profile };
VqBasis vq_basis_from_name(const std::string& name);  // "identity" | "hadamard" | "weights"; throws InvalidArgument
const char* vq_basis_name(VqBasis b);

// Widest row transformed as a whole; wider rows use one block per head.
inline constexpr int kVqMaxCrossHead = 256;

// One side's transform: y = fwd x, x = inv y, both [n, n] row-major. Empty = identity.
struct VqSideTransform {
  int n = 0;
  std::vector<float> fwd, inv;
  bool identity() const { return fwd.empty(); }
  // The decoder's copy of inv (vq_index_inverse): for each KV head h, the columns j0 .. j1 of its d
  // rows that can be nonzero (the whole row when one block mixes every head, the head's own d
  // coefficients when inv is block-diagonal per head), column-major: inv_cols[(h * (j1 - j0) + j - j0)
  // * d + i] = inv[(h * d + i) * n + j]. Reconstruction then reads it contiguously and skips the
  // block's zeros, with the same sums in the same order (bit for bit the full product). Empty: not
  // built (the decoder walks inv itself).
  int col_span = 0;  // j1 - j0 (d: fwd and inv are both block-diagonal per head; n: not)
  std::vector<float> inv_cols;
  // fwd and inv transposed (fwd_t[j * n + c] = fwd[c * n + j], the same for inv_t) when one block
  // mixes every head (col_span == n): the encoder's F x eight rows at a time, and the attention
  // over such a cache (src/vq/mixed_attention.cpp: exact tokens into coefficient space, keys
  // rebuilt from codes) read them contiguously. Else empty.
  std::vector<float> fwd_t, inv_t;
};

// Builds side.inv_cols / col_span (and fwd_t / inv_t) from side.fwd / inv for `kv_heads` heads (no-op for the identity).
void vq_index_inverse(VqSideTransform& side, int kv_heads);

struct VqBasisOptions {
  VqBasis basis = VqBasis::Weights;
  bool shape = true;         // Weights only: the downstream noise shaping S (false: S = I)
  bool rope = true;          // un-rotate keys
  double rope_theta = 10000.0;
  // Weights / Hadamard: one block per KV head even where the row (KV heads x head dim) is narrow
  // enough to be transformed whole (block=head). A whole-row block also catches what heads share,
  // but decoding it costs KV-heads times the multiply-adds: 4x at 4 heads (docs/methods.md, "vq").
  bool per_head = false;
  bool operator==(const VqBasisOptions&) const = default;
};

// Where a layer model came from, so that a saved cache can name what rebuilds it (format/vqkv.hpp):
// the model's fingerprint (model/vq_layer_models.hpp's vq_model_fingerprint: xxHash64 of its shape and
// the weights the transforms read), the model layer, and the basis options. A layer model without
// one (identity sized from the data, or built by hand) cannot be saved unless it is the identity.
struct VqModelSource {
  std::uint64_t fingerprint = 0;
  int layer = 0;
  VqBasisOptions basis;
  bool operator==(const VqModelSource&) const = default;
};

// Everything our cache needs to know about its layer.
struct VqLayerModel {
  int kv_heads = 0, head_dim = 0;
  VqSideTransform k, v;
  // RoPE frequency of each pair (head_dim / 2 values, theta^(-2i/head_dim)); empty: keys are
  // quantized as given (no model, or rope=off).
  std::vector<double> rope_freq;
  std::optional<VqModelSource> source;  // set by whoever derives the model from a checkpoint
};

// Rebuilds the layer model a saved vq cache names (format/vqkv.hpp, VqkvLoadOptions::vq_models;
// model/vq_layer_models.hpp's vq_layer_models makes one from a checkpoint). Returns a model whose
// `source` equals `wanted`; throws (InvalidArgument or FormatError, with a sentence a user can act
// on) when it holds no model with that fingerprint.
using VqLayerModelSource = std::function<std::shared_ptr<const VqLayerModel>(const VqModelSource& wanted)>;

// Views of one layer's weights in llama2.c's row-major [out, in] layout.
struct VqLayerWeights {
  int dim = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  std::span<const float> wq;       // [n_heads * head_dim, dim]
  std::span<const float> wk, wv;   // [n_kv_heads * head_dim, dim]
  std::span<const float> wo;       // [dim, n_heads * head_dim]
  std::span<const float> rms_att;  // [dim]
};

// The transforms of one layer. Throws InvalidArgument on inconsistent shapes.
VqLayerModel make_vq_layer_model(const VqLayerWeights& w, const VqBasisOptions& options);
// A layer with no model: identity transforms, keys quantized as given.
VqLayerModel make_vq_identity_layer(int kv_heads, int head_dim);

// Eigen-decomposition of a symmetric n x n matrix (cyclic Jacobi, double): eigenvalues descending
// in `values`, the matching unit eigenvectors as the columns of the returned row-major matrix.
std::vector<double> symmetric_eigen(std::vector<double> a, int n, std::vector<double>& values);

}  // namespace vq
