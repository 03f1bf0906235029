// Method specs: the text that names a KV cache method on the command line and in evaluations.
//
//   fp32                     plain KVCache (exact)
//   fp16                     Fp16KVCache: K/V rounded to float16 (half to even) and back, stored as float32
//   cachegen[:k=v,...]       CacheGen quantization; keys (defaults in brackets):
//       bits=1..8 [4]        base bit width
//       group=N [32]         tokens per quantization group
//       flush=per_call|group_aligned [group_aligned]
//       delta=0|1 [1]        entropy of token deltas (1) or raw codes (0)
//       schedule=on|off [on] on: KVCacheBuilder::for_model (CacheGen's layer-wise bits, base = bits);
//                            off: every layer a CacheGenKVCache at exactly `bits`
//   kivi[:k=v,...]           KiviKVCache (peers/kivi_cache.hpp); keys [defaults]:
//       bits=2|4 [2]         code width of keys and values
//       group=N [32]         tokens per key group, channels per value group
//       residual=N [128]     full-precision window, a multiple of group
//   q8_0, q4_0, q4_1[:rotate=0|1]  llama.cpp's KV cache block formats (peers/ggml_block_cache.hpp);
//       rotate=0|1 [0]       1: each head's K/V row rotated by a fixed signed Hadamard transform
//                            before block quantization (peers/head_rotation.hpp, llama.cpp PR #21038)
//   fp8                      e4m3 with a per-head scale per call (peers/fp8_cache.hpp)
//   lmcache[:k=v,...]        LmcacheKVCache, LMCache's CacheGen codec (peers/lmcache_cache.hpp); keys [defaults]:
//       chunk=N [256]        tokens per chunk (per-chunk tables shipped with it)
//       schedule=scaled|native [scaled]  bins boundaries scaled to depth, or LMCache's own rule
//   cachegen_paper[:k=v,...] CachegenPaperKVCache, the SIGCOMM'24 paper's codec (peers/cachegen_paper_cache.hpp):
//       bin1=B, bin2=B, bin3=B [0.5, 1, 1.5]  delta bin size per depth third (units of the delta's absmax)
//       group=N [10]         tokens per group (one 8-bit anchor)
//       chunk=N [1500]       tokens per independently coded chunk, a multiple of group
//       profile=PATH         tables from `veloxquant profile`; without it, profiled on the fly from
//                            profile_tokens=N [4096] tokens sampled from the model (model/cachegen_profile.hpp)
//   vq[:k=v,...]             VqKVCache, our method (vq/vq_cache.hpp, docs/methods.md); keys [defaults]:
//       bits=B [2]           nominal code bits per element (real number; actual size is measured)
//       calib=N [64]         tokens that calibrate the quantizer (kept exact until then)
//       residual=N [0]       most recent tokens kept exact (for hosts decoding against the cache)
//       alloc=flat|K0/V0/K1/V1/... [flat]  bits added per attention layer to K and V
//                            ('/'-separated, two per layer; flat = all 0, the measured best)
//       basis=weights|hadamard|identity [weights], shape=on|off [on], rope=on|off [on]: the
//                            transform (vq/basis.hpp); without a model (synthetic eval) identity
//
// Unknown methods, keys or values throw InvalidArgument naming the bad part and the valid choices.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/cache/builder.hpp"
#include "veloxquant/cache/config.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/peers/cachegen_paper_profile.hpp"
#include "veloxquant/peers/kivi_cache.hpp"
#include "veloxquant/peers/lmcache_cache.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace vq {

class Transformer;

struct MethodSpec {
  enum class Kind { Fp32, Fp16, CacheGen, Kivi, Q8_0, Q4_0, Q4_1, Fp8, Lmcache, CachegenPaper, Vq };
  Kind kind = Kind::Fp32;
  KVCacheConfig cachegen;   // used when kind == CacheGen (cachegen_bits = the base bits)
  bool schedule = true;     // CacheGen: layer-wise schedule via KVCacheBuilder
  bool rotate = false;      // Q8_0/Q4_0/Q4_1: signed Hadamard rotation of each head's rows
  KiviConfig kivi;          // used when kind == Kivi
  LmcacheConfig lmcache;    // used when kind == Lmcache
  CachegenPaperConfig cachegen_paper;  // used when kind == CachegenPaper
  VqConfig vq;              // used when kind == Vq (k_offset/v_offset set per layer from vq_alloc)
  VqBasisOptions vq_basis;  // used when kind == Vq and a model is known
  std::string vq_alloc = "flat";  // "flat" or the '/'-separated K/V offsets per attention layer

  // Parse a spec string (see above); throws InvalidArgument.
  static MethodSpec parse(const std::string& spec);
  // Canonical text, e.g. "cachegen:bits=4,group=32,flush=group_aligned,delta=1,schedule=on".
  std::string to_string() const;
};

// A KVCache that rounds incoming float32 K/V to float16 and back before storing them, so it keeps
// float32 storage and dtype but holds exactly float16's precision.
class Fp16KVCache : public KVCache {
 public:
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  std::string kind() const override { return "Fp16KVCache"; }
  // Billed as the float16 it represents: 2 bytes per element.
  CacheBytes stored_bytes() const override;
};

// The fingerprint a saved `vq` cache names its model by (docs/format.md): xxHash64 (seed 0) of
// the little-endian int32 shape (dim, n_layers, n_heads, n_kv_heads), then the float32 bytes of
// every layer's rms_att, wq, wk, wv and wo, in that order: the weights vq/basis.hpp derives the
// transforms from, so two checkpoints with the same fingerprint rebuild the same layer models.
std::uint64_t vq_model_fingerprint(const Checkpoint& ck);
// The layer models of `ck` for a .vqkv loader (VqkvLoadOptions::vq_models): refuses a fingerprint
// other than ck's with an InvalidArgument that names both, and a layer index outside the model.
VqLayerModelSource vq_layer_models(std::shared_ptr<const Checkpoint> ck);

// One cache per layer of `model` for `spec` (layers without attention get a plain KVCache).
std::vector<std::shared_ptr<KVCache>> make_caches(const MethodSpec& spec, const ModelDescription& model);
std::vector<std::shared_ptr<KVCache>> make_caches(const MethodSpec& spec, const Transformer& model);
std::vector<std::shared_ptr<KVCache>> make_caches(const std::string& spec, const Transformer& model);

}  // namespace vq
