// A calibrated `vq` basis that needs no weights (issue 30): per layer and KV head, the KLT (the
// principal axes) of the model's own keys (RoPE undone) and values over calibration text, saved
// once per model as a small file (`veloxquant calibrate -o X.vqprof`) and used as
// `vq:...,profile=X.vqprof`. It serves any model llama.cpp runs, where our reader cannot take the
// transforms from the weights (K-quants, other RoPE bases or architectures).
//
// What a reader needs first:
// - No noise shaping: the weights basis shapes K by the queries' energy and V by the output
//   projection, neither of which a K/V state holds. The profile's axes decorrelate K and V and
//   order them by variance, which is what the coder's water-filling needs; docs/quality.md has the
//   measured gap to the weights basis where both exist.
// - RoPE: keys are un-rotated (llama's adjacent pairs, freq theta^(-2i/D)) before their covariance
//   is taken, exactly as the cache un-rotates them, when the profile says so (llama architectures);
//   otherwise keys are taken as the cache holds them.
// - A profile names the model it was fitted on (`model_fingerprint`: xxHash64 of the model file,
//   model/gguf.hpp's load_gguf_shape for GGUF): a host checks it against its model before use and
//   refuses another's (check_vq_profile_model). Its own `hash` (the file's checksum) names it in
//   saved caches and store blobs, so a blob coded with one profile is never decoded with another.
//
// - Blocks: like the weights basis (vq/basis.hpp), a row of up to kVqMaxCrossHead values (KV heads
//   x head dim) is transformed as a whole, so the axes also catch what heads share; wider rows get
//   one block per head.
//
// File (little-endian): "VQPROF\0\0", u32 version (1), u32 flags (bit 0: RoPE undone), u64 model
// fingerprint, u32 layers, u32 KV heads, u32 head dim, u32 block (head dim, or KV heads x head dim),
// f64 rope theta, u64 calibration tokens, then per layer the K axes and the V axes, each (row /
// block) blocks of block x block float32 (row i = axis i of that block, by decreasing variance),
// then u64 xxHash64 of everything before.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/core/tensor.hpp"
#include "veloxquant/vq/basis.hpp"

namespace vq {

inline constexpr std::uint32_t kVqProfileVersion = 1;

struct VqProfile {
  std::uint64_t model_fingerprint = 0;
  int layers = 0, kv_heads = 0, head_dim = 0;
  int block = 0;  // values per transform block: head_dim, or kv_heads * head_dim (the whole row)
  bool rope = true;
  double rope_theta = 10000.0;
  std::uint64_t tokens = 0;  // calibration tokens per layer
  // [layer][block][axis][value], row-major, orthonormal rows.
  std::vector<std::vector<float>> k_axes, v_axes;
  std::uint64_t hash = 0;  // xxHash64 of the file's body (set by read and write)
};

// The file's bytes (sets profile.hash); InvalidArgument on a shape the file cannot hold.
std::vector<std::uint8_t> write_vq_profile(VqProfile& profile);
// Parses and checks a profile file: magic, version, sizes (before anything is allocated), the
// checksum, finite orthonormal axes. FormatError "<name>: vq profile: ..." otherwise.
VqProfile read_vq_profile(std::span<const std::uint8_t> bytes, const std::string& name = "profile");
// From a file (bounded by the size its header implies), shared process-wide while in use; or, for
// a name vq_profile_ref gave, the profile it named.
std::shared_ptr<const VqProfile> load_vq_profile(const std::string& path);
// A profile's name where it is written beside data (a store's level names, store/prefix_chunks.hpp's
// store_level): "xxh64:" and the 16 hex digits of its hash, not the path this host read it from
// (another host keeps it elsewhere, and a shared store should not learn local paths). Keeps the
// profile for the process's life so that load_vq_profile takes the name back; a name this process
// did not give is refused (InvalidArgument: give profile=PATH).
std::string vq_profile_ref(std::shared_ptr<const VqProfile> profile);
void save_vq_profile(const std::string& path, VqProfile& profile);  // atomically

// Refuses (InvalidArgument, one line naming both) a profile fitted on another model, or of
// another shape than (layers, kv_heads, head_dim).
void check_vq_profile_model(const VqProfile& profile, const std::string& profile_name, std::uint64_t model_fingerprint,
                            const std::string& model_name);
void check_vq_profile_shape(const VqProfile& profile, const std::string& profile_name, int layers, int kv_heads, int head_dim);

// Layer `layer`'s model: block-diagonal transforms from the axes (inverse: their transpose), the
// RoPE frequencies when the profile undoes RoPE, and source {profile.hash, layer, basis=profile}.
std::shared_ptr<const VqLayerModel> vq_profile_layer(const VqProfile& profile, int layer);
// The layer models of every profile given, for a loader of saved caches or store blobs
// (VqLayerModelSource): a source naming another profile is refused; `fallback`, when set, answers
// for every source that names no profile (a model's own weights).
VqLayerModelSource vq_profile_models(std::vector<std::shared_ptr<const VqProfile>> profiles, VqLayerModelSource fallback = {});

// Fits a profile from the exact K/V of calibration contexts.
class VqProfileBuilder {
 public:
  VqProfileBuilder(int layers, int kv_heads, int head_dim, bool rope, double rope_theta);
  // One context's layer: keys and values [1, kv_heads, T, head_dim] (any float type), the first at
  // position `first_position`. InvalidArgument on another shape or a non-finite value.
  void add(int layer, const Tensor& keys, const Tensor& values, std::int64_t first_position = 0);
  // The axes (InvalidArgument when a layer saw fewer than 2 tokens).
  VqProfile finish(std::uint64_t model_fingerprint) const;

 private:
  int layers_, heads_, dim_;
  bool rope_;
  double theta_;
  int n_, block_;                                    // row values (heads x dim), values per block
  std::vector<double> k_sum_, k_sq_, v_sum_, v_sq_;  // per layer: sums [n] and, per block, [block][block]
  std::vector<std::uint64_t> count_;                 // tokens per layer
};

}  // namespace vq
