// A method spec: the text that names a KV cache method on the command line, in evaluations, in a
// store's levels and in .vqkv files, parsed into the settings the method's cache is built from.
//
// The methods, their keys, defaults and ranges are one table (methods/method_table.hpp); `veloxquant
// methods` prints it and docs/methods.md tells each method's story. A spec is `name[:key=value,...]`,
// e.g. `vq:bits=2`, `cachegen:bits=4,schedule=off`, `q4_0:rotate=1`. Unknown methods, keys or values
// throw InvalidArgument naming the bad part and the valid choices.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/cache/builder.hpp"
#include "veloxquant/cache/config.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/peers/cachegen_paper_profile.hpp"
#include "veloxquant/peers/kivi_cache.hpp"
#include "veloxquant/peers/lmcache_cache.hpp"
#include "veloxquant/vq/profile.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace vq {

class Transformer;

// The longest method spec parse() takes (the longest canonical spec is far shorter).
inline constexpr std::size_t kMaxMethodSpecBytes = 512;

struct MethodSpec {
  // One per row of the method table, in its order.
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
  std::string vq_profile;         // used when kind == Vq: a profile file (vq/profile.hpp) whose axes replace the basis
  bool vq_predict = false;        // used when kind == Vq: predict=on, the chained caches of vq/vq_chain.hpp

  // Parse a spec string (see above); throws InvalidArgument.
  static MethodSpec parse(const std::string& spec);
  // Canonical text, e.g. "cachegen:bits=4,group=32,flush=group_aligned,delta=1,schedule=on".
  std::string to_string() const;
};

// One cache per layer of `model` for `spec` (layers without attention get a plain KVCache), built
// by the spec's row of the method table. With a Transformer, a method that derives something from
// the weights (vq's transforms, cachegen_paper's profile) does so; without one it uses its
// model-free default (identity transforms; a profile= file is then required for cachegen_paper).
std::vector<std::shared_ptr<KVCache>> make_caches(const MethodSpec& spec, const ModelDescription& model);
std::vector<std::shared_ptr<KVCache>> make_caches(const MethodSpec& spec, const Transformer& model);
std::vector<std::shared_ptr<KVCache>> make_caches(const std::string& spec, const Transformer& model);

// The vq profiles the specs name (profile=PATH), each loaded and checked against the model they
// will run on (its file's fingerprint: xxHash64 of the GGUF or llama2.c file). Throws
// InvalidArgument (a bad spec, a profile of another model), FormatError / IoError (the file).
std::vector<std::shared_ptr<const VqProfile>> check_method_profiles(const std::vector<std::string>& specs, std::uint64_t model_fingerprint,
                                                                    const std::string& model_name);

}  // namespace vq
