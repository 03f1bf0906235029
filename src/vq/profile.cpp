// A calibrated vq basis from a model's own K/V (vq/profile.hpp).
#include "veloxquant/vq/profile.hpp"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <tuple>
#include <mutex>

#include <fmt/format.h>

#include "reconstruct_kernels.hpp"
#include "transform.hpp"
#include "veloxquant/core/atomic_file.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/input_file.hpp"

namespace vq {

namespace {

constexpr char kMagic[8] = {'V', 'Q', 'P', 'R', 'O', 'F', 0, 0};
constexpr std::size_t kHeaderBytes = 8 + 4 + 4 + 8 + 4 * 4 + 8 + 8;
// Bounds a header may claim (a profile of 1024 layers x 256 heads x 256 dims is 2 GiB: refused).
constexpr std::uint64_t kMaxLayers = 4096, kMaxHeads = 4096, kMaxHeadDim = 1024;
constexpr std::uint64_t kMaxProfileBytes = std::uint64_t{1} << 30;

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

std::uint64_t body_bytes(std::uint64_t layers, std::uint64_t heads, std::uint64_t dim, std::uint64_t block) {
  return kHeaderBytes + layers * 2 * (heads * dim / block) * block * block * 4;
}

void put32(std::vector<std::uint8_t>& b, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
void put64(std::vector<std::uint8_t>& b, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
std::uint32_t get32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(p[i]) << (8 * i);
  return v;
}
std::uint64_t get64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

// Rows of `axes` ([blocks][d][d]) orthonormal within `tol`.
bool orthonormal(const float* axes, int heads, int d, double tol) {
  for (int h = 0; h < heads; ++h) {
    const float* a = axes + sz(h) * sz(d) * sz(d);
    for (int i = 0; i < d; ++i)
      for (int j = i; j < d; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += static_cast<double>(a[sz(i) * sz(d) + sz(c)]) * a[sz(j) * sz(d) + sz(c)];
        if (std::fabs(dot - (i == j ? 1.0 : 0.0)) > tol) return false;
      }
  }
  return true;
}

}  // namespace

std::vector<std::uint8_t> write_vq_profile(VqProfile& p) {
  require(p.layers >= 1 && static_cast<std::uint64_t>(p.layers) <= kMaxLayers && p.kv_heads >= 1 &&
              static_cast<std::uint64_t>(p.kv_heads) <= kMaxHeads && p.head_dim >= 1 && static_cast<std::uint64_t>(p.head_dim) <= kMaxHeadDim,
          "vq profile: shape {} layers x {} heads x {} is out of range", p.layers, p.kv_heads, p.head_dim);
  require(p.rope_theta > 0 && std::isfinite(p.rope_theta), "vq profile: rope theta {} must be > 0", p.rope_theta);
  require(!p.rope || p.head_dim % 2 == 0, "vq profile: RoPE needs an even head dim, not {}", p.head_dim);
  require(p.block == p.head_dim || p.block == p.kv_heads * p.head_dim, "vq profile: block {} must be the head dim or the row", p.block);
  const std::size_t per = sz(p.kv_heads) * sz(p.head_dim) * sz(p.block);
  require(p.k_axes.size() == sz(p.layers) && p.v_axes.size() == sz(p.layers), "vq profile: axes of {} layers expected", p.layers);
  const std::uint64_t n = body_bytes(static_cast<std::uint64_t>(p.layers), static_cast<std::uint64_t>(p.kv_heads), static_cast<std::uint64_t>(p.head_dim),
                                     static_cast<std::uint64_t>(p.block));
  require(n + 8 <= kMaxProfileBytes, "vq profile: {} bytes is more than a profile may hold", n + 8);
  std::vector<std::uint8_t> b(kMagic, kMagic + 8);
  b.reserve(n + 8);
  put32(b, kVqProfileVersion);
  put32(b, p.rope ? 1u : 0u);
  put64(b, p.model_fingerprint);
  put32(b, static_cast<std::uint32_t>(p.layers));
  put32(b, static_cast<std::uint32_t>(p.kv_heads));
  put32(b, static_cast<std::uint32_t>(p.head_dim));
  put32(b, static_cast<std::uint32_t>(p.block));
  put64(b, std::bit_cast<std::uint64_t>(p.rope_theta));
  put64(b, p.tokens);
  for (int l = 0; l < p.layers; ++l)
    for (const auto* axes : {&p.k_axes[sz(l)], &p.v_axes[sz(l)]}) {
      require(axes->size() == per, "vq profile: layer {} holds {} values, expected {}", l, axes->size(), per);
      for (float x : *axes) put32(b, std::bit_cast<std::uint32_t>(x));
    }
  p.hash = XXH64(b.data(), b.size(), 0);
  put64(b, p.hash);
  return b;
}

VqProfile read_vq_profile(std::span<const std::uint8_t> bytes, const std::string& name) {
  const auto fail = [&](const std::string& why) -> FormatError { return FormatError(fmt::format("{}: vq profile: {}", name, why)); };
  if (bytes.size() < kHeaderBytes + 8) throw fail(fmt::format("{} bytes is too short for a profile (not a file `veloxquant calibrate` wrote?)", bytes.size()));
  if (std::memcmp(bytes.data(), kMagic, 8) != 0) throw fail("not a vq profile (no VQPROF magic; `veloxquant calibrate -o` writes one)");
  const std::uint8_t* p = bytes.data() + 8;
  const std::uint32_t version = get32(p), flags = get32(p + 4);
  if (version != kVqProfileVersion) throw fail(fmt::format("version {} is not supported (only {})", version, kVqProfileVersion));
  if (flags > 1) throw fail(fmt::format("unknown flags {:#x}", flags));
  VqProfile out;
  out.rope = flags & 1;
  out.model_fingerprint = get64(p + 8);
  const std::uint64_t layers = get32(p + 16), heads = get32(p + 20), dim = get32(p + 24), block = get32(p + 28);
  if (layers < 1 || layers > kMaxLayers || heads < 1 || heads > kMaxHeads || dim < 1 || dim > kMaxHeadDim)
    throw fail(fmt::format("shape {} layers x {} heads x {} is out of range", layers, heads, dim));
  if (block != dim && block != heads * dim) throw fail(fmt::format("block {} is neither the head dim {} nor the row {}", block, dim, heads * dim));
  if (out.rope && dim % 2 != 0) throw fail(fmt::format("RoPE needs an even head dim, not {}", dim));
  out.rope_theta = std::bit_cast<double>(get64(p + 32));
  if (!(out.rope_theta > 0) || !std::isfinite(out.rope_theta)) throw fail(fmt::format("rope theta {} must be > 0", out.rope_theta));
  out.tokens = get64(p + 40);
  const std::uint64_t n = body_bytes(layers, heads, dim, block);
  if (n + 8 > kMaxProfileBytes || bytes.size() != n + 8)
    throw fail(fmt::format("{} bytes, but its header ({} layers x {} heads x {}) makes it {} (truncated or trailing bytes)", bytes.size(), layers,
                           heads, dim, n + 8));
  out.hash = get64(bytes.data() + n);
  if (XXH64(bytes.data(), n, 0) != out.hash) throw fail("checksum mismatch (the file is corrupt)");
  out.layers = static_cast<int>(layers);
  out.kv_heads = static_cast<int>(heads);
  out.head_dim = static_cast<int>(dim);
  out.block = static_cast<int>(block);
  const std::size_t per = sz(out.kv_heads) * sz(out.head_dim) * sz(out.block);
  const std::uint8_t* q = bytes.data() + kHeaderBytes;
  for (int l = 0; l < out.layers; ++l)
    for (auto* axes : {&out.k_axes, &out.v_axes}) {
      std::vector<float> a(per);
      for (std::size_t i = 0; i < per; ++i, q += 4) {
        a[i] = std::bit_cast<float>(get32(q));
        if (!std::isfinite(a[i])) throw fail(fmt::format("layer {} holds a non-finite axis value", l));
      }
      if (!orthonormal(a.data(), out.kv_heads * out.head_dim / out.block, out.block, 1e-3))
        throw fail(fmt::format("layer {}'s {} axes are not orthonormal", l, axes == &out.k_axes ? "K" : "V"));
      axes->push_back(std::move(a));
    }
  return out;
}

namespace {

constexpr std::string_view kRefPrefix = "xxh64:";

struct NamedProfiles {
  std::mutex mu;
  std::map<std::uint64_t, std::shared_ptr<const VqProfile>> by_hash;
};
NamedProfiles& named_profiles() {
  static NamedProfiles n;
  return n;
}

}  // namespace

std::string vq_profile_ref(std::shared_ptr<const VqProfile> profile) {
  require(profile != nullptr, "vq_profile_ref: no profile");
  const std::string ref = fmt::format("{}{:016x}", kRefPrefix, profile->hash);
  NamedProfiles& n = named_profiles();
  const std::lock_guard<std::mutex> lock(n.mu);
  n.by_hash.emplace(profile->hash, std::move(profile));
  return ref;
}

std::shared_ptr<const VqProfile> load_vq_profile(const std::string& path) {
  if (path.rfind(kRefPrefix, 0) == 0) {
    const std::string hex = path.substr(kRefPrefix.size());
    if (hex.size() == 16 && hex.find_first_not_of("0123456789abcdef") == std::string::npos) {
      NamedProfiles& n = named_profiles();
      const std::lock_guard<std::mutex> lock(n.mu);
      if (auto it = n.by_hash.find(std::stoull(hex, nullptr, 16)); it != n.by_hash.end()) return it->second;
      throw InvalidArgument(fmt::format("vq profile {}: this process has read no profile of that hash (give profile=PATH, the file itself)", path));
    }
  }
  // Every cache a spec makes loads its profile (per window in eval, per put in the prompt cache):
  // a file unchanged since it was read (same size and modification time) is not read again.
  static std::mutex mu;
  using Key = std::tuple<std::string, std::uint64_t, std::filesystem::file_time_type>;
  static std::map<Key, std::weak_ptr<const VqProfile>> loaded;
  InputFile f(path, "vq profile");
  std::error_code ec;
  const Key key{path, f.size(), std::filesystem::last_write_time(path, ec)};
  if (!ec) {
    const std::lock_guard<std::mutex> lock(mu);
    if (auto it = loaded.find(key); it != loaded.end())
      if (auto p = it->second.lock()) return p;
  }
  if (f.size() > kMaxProfileBytes)
    throw FormatError(fmt::format("{}: vq profile: {} bytes is more than a profile may hold", path, f.size()));
  const std::vector<std::uint8_t> bytes = f.read_all();
  auto p = std::make_shared<const VqProfile>(read_vq_profile(bytes, path));
  if (ec) return p;
  const std::lock_guard<std::mutex> lock(mu);
  std::erase_if(loaded, [](const auto& e) { return e.second.expired(); });
  loaded[key] = p;
  return p;
}

void save_vq_profile(const std::string& path, VqProfile& profile) {
  const std::vector<std::uint8_t> bytes = write_vq_profile(profile);
  write_file_atomically(path, bytes);
}

void check_vq_profile_model(const VqProfile& profile, const std::string& profile_name, std::uint64_t model_fingerprint,
                            const std::string& model_name) {
  require(profile.model_fingerprint == model_fingerprint,
          "{} was calibrated on another model file (fingerprint {:016x}; {} has {:016x}): calibrate one on it (veloxquant calibrate "
          "--model MODEL -o PROFILE)",
          profile_name, profile.model_fingerprint, model_name, model_fingerprint);
}

void check_vq_profile_shape(const VqProfile& profile, const std::string& profile_name, int layers, int kv_heads, int head_dim) {
  require(profile.layers == layers && profile.kv_heads == kv_heads && profile.head_dim == head_dim,
          "{} is a profile of {} layers x {} KV heads x {}; this model has {} x {} x {}", profile_name, profile.layers, profile.kv_heads,
          profile.head_dim, layers, kv_heads, head_dim);
}

std::shared_ptr<const VqLayerModel> vq_profile_layer(const VqProfile& profile, int layer) {
  require(layer >= 0 && layer < profile.layers, "vq profile: layer {} of {}", layer, profile.layers);
  const int H = profile.kv_heads, D = profile.head_dim, n = H * D;
  require(profile.block > 0 && n % profile.block == 0, "vq profile: block {} does not divide the row {}", profile.block, n);
  auto m = std::make_shared<VqLayerModel>(make_vq_identity_layer(H, D));
  if (profile.rope)
    for (int p = 0; p < D / 2; ++p) m->rope_freq.push_back(std::pow(profile.rope_theta, -2.0 * p / D));
  for (int side = 0; side < 2; ++side) {
    const std::vector<float>& axes = side == 0 ? profile.k_axes[sz(layer)] : profile.v_axes[sz(layer)];
    VqSideTransform& t = side == 0 ? m->k : m->v;
    t.fwd.assign(sz(n) * sz(n), 0.0f);
    t.inv.assign(sz(n) * sz(n), 0.0f);
    const int B = profile.block;
    for (int blk = 0; blk < n / B; ++blk)
      for (int i = 0; i < B; ++i)
        for (int c = 0; c < B; ++c) {
          const float a = axes[(sz(blk) * sz(B) + sz(i)) * sz(B) + sz(c)];
          t.fwd[sz(blk * B + i) * sz(n) + sz(blk * B + c)] = a;  // coefficient i = axis i . x
          t.inv[sz(blk * B + c) * sz(n) + sz(blk * B + i)] = a;  // x = sum_i coefficient i * axis i
        }
    vq_index_inverse(t, H);
  }
  m->source = VqModelSource{profile.hash, layer, VqBasisOptions{.basis = VqBasis::Profile, .shape = false, .rope = profile.rope,
                                                                .rope_theta = profile.rope_theta}};
  return m;
}

VqLayerModelSource vq_profile_models(std::vector<std::shared_ptr<const VqProfile>> profiles, VqLayerModelSource fallback) {
  return [profiles = std::move(profiles), fallback = std::move(fallback)](const VqModelSource& wanted) -> std::shared_ptr<const VqLayerModel> {
    if (wanted.basis.basis != VqBasis::Profile) {
      if (fallback) return fallback(wanted);
      throw InvalidArgument(fmt::format("vq: codes of a model's weights basis (fingerprint {:016x}) need that model", wanted.fingerprint));
    }
    for (const auto& p : profiles)
      if (p && p->hash == wanted.fingerprint) return vq_profile_layer(*p, wanted.layer);
    throw InvalidArgument(fmt::format("vq: codes of profile {:016x} need that profile (vq:...,profile=PATH), which this host does not hold",
                                      wanted.fingerprint));
  };
}

VqProfileBuilder::VqProfileBuilder(int layers, int kv_heads, int head_dim, bool rope, double rope_theta)
    : layers_(layers), heads_(kv_heads), dim_(head_dim), rope_(rope), theta_(rope_theta) {
  require(layers >= 1 && kv_heads >= 1 && head_dim >= 1 && (!rope || head_dim % 2 == 0) && rope_theta > 0,
          "vq profile: bad shape {} layers x {} heads x {} (rope {})", layers, kv_heads, head_dim, rope);
  n_ = kv_heads * head_dim;
  block_ = n_ <= kVqMaxCrossHead ? n_ : head_dim;  // as the weights basis blocks a row
  const std::size_t per_layer = sz(n_ / block_) * sz(block_) * sz(block_);
  k_sum_.assign(sz(layers) * sz(n_), 0.0);
  v_sum_.assign(sz(layers) * sz(n_), 0.0);
  k_sq_.assign(sz(layers) * per_layer, 0.0);
  v_sq_.assign(sz(layers) * per_layer, 0.0);
  count_.assign(sz(layers), 0);
}

void VqProfileBuilder::add(int layer, const Tensor& keys, const Tensor& values, std::int64_t first_position) {
  require(layer >= 0 && layer < layers_, "vq profile: layer {} of {}", layer, layers_);
  for (const Tensor* t : {&keys, &values})
    require(t->dim(0) == 1 && t->dim(1) == heads_ && t->dim(3) == dim_ && t->dim(2) == keys.dim(2),
            "vq profile: layer {} K/V of shape [{}, {}, {}, {}], expected [1, {}, T, {}]", layer, t->dim(0), t->dim(1), t->dim(2), t->dim(3),
            heads_, dim_);
  require(first_position >= 0, "vq profile: negative position");
  const std::int64_t T = keys.dim(2);
  const std::vector<float> k = keys.contiguous().to_f32_vector(), v = values.contiguous().to_f32_vector();
  std::vector<double> freq;
  if (rope_)
    for (int p = 0; p < dim_ / 2; ++p) freq.push_back(std::pow(theta_, -2.0 * p / dim_));
  const auto table = rope_ ? vq_rope_table(freq, first_position + T) : nullptr;
  const std::size_t D = sz(dim_), n = sz(n_), B = sz(block_), per_layer = (n / B) * B * B;
  std::vector<double> x(n);
  for (int side = 0; side < 2; ++side) {
    const std::vector<float>& src = side == 0 ? k : v;
    double* sum = (side == 0 ? k_sum_ : v_sum_).data() + sz(layer) * n;
    double* sq = (side == 0 ? k_sq_ : v_sq_).data() + sz(layer) * per_layer;
    for (std::int64_t t = 0; t < T; ++t) {
      for (int h = 0; h < heads_; ++h)  // the row of token t: head-major, as the cache lays it out
        for (std::size_t c = 0; c < D; ++c) {
          x[sz(h) * D + c] = src[(sz(h) * sz(T) + sz(t)) * D + c];
          require(std::isfinite(x[sz(h) * D + c]), "vq profile: layer {} holds a non-finite {} value", layer, side == 0 ? "K" : "V");
        }
      if (side == 0 && table) vq_transform::vq_unrope(x.data(), heads_, dim_, table->at(first_position + t), freq.size());
      for (std::size_t a = 0; a < n; ++a) sum[a] += x[a];
      for (std::size_t blk = 0; blk < n / B; ++blk) {
        const double* xb = x.data() + blk * B;
        double* s = sq + blk * B * B;
        for (std::size_t a = 0; a < B; ++a)
          for (std::size_t b = a; b < B; ++b) s[a * B + b] += xb[a] * xb[b];
      }
    }
  }
  count_[sz(layer)] += static_cast<std::uint64_t>(T);
}

VqProfile VqProfileBuilder::finish(std::uint64_t model_fingerprint) const {
  VqProfile out;
  out.model_fingerprint = model_fingerprint;
  out.layers = layers_;
  out.kv_heads = heads_;
  out.head_dim = dim_;
  out.block = block_;
  out.rope = rope_;
  out.rope_theta = theta_;
  out.tokens = count_.empty() ? 0 : *std::min_element(count_.begin(), count_.end());
  require(out.tokens >= 2, "vq profile: every layer needs at least 2 calibration tokens (the fewest seen: {})", out.tokens);
  const std::size_t n = sz(n_), B = sz(block_), per_layer = (n / B) * B * B;
  for (int l = 0; l < layers_; ++l) {
    const double cnt = static_cast<double>(count_[sz(l)]);
    for (int side = 0; side < 2; ++side) {
      std::vector<float> axes(per_layer);
      const double* sum = (side == 0 ? k_sum_ : v_sum_).data() + sz(l) * n;
      for (std::size_t blk = 0; blk < n / B; ++blk) {
        const double* sq = (side == 0 ? k_sq_ : v_sq_).data() + sz(l) * per_layer + blk * B * B;
        const double* mean = sum + blk * B;
        std::vector<double> cov(B * B);
        for (std::size_t a = 0; a < B; ++a)
          for (std::size_t b = a; b < B; ++b) cov[a * B + b] = cov[b * B + a] = sq[a * B + b] / cnt - (mean[a] / cnt) * (mean[b] / cnt);
        std::vector<double> lambda;
        const std::vector<double> e = symmetric_eigen(cov, static_cast<int>(B), lambda);  // columns: axes by decreasing variance
        for (std::size_t i = 0; i < B; ++i)
          for (std::size_t c = 0; c < B; ++c) axes[(blk * B + i) * B + c] = static_cast<float>(e[c * B + i]);
      }
      (side == 0 ? out.k_axes : out.v_axes).push_back(std::move(axes));
    }
  }
  return out;
}

}  // namespace vq
