// The `vq` part of the method specs (our method), kept apart from method_spec.cpp so the peers'
// rows and ours can change independently. Private to the model stage.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/method_spec.hpp"

namespace vq::detail {

// Calls set(key, value) for each `key=value` item of a spec's comma-separated options; throws
// InvalidArgument naming `keys` for an item without '='.
template <class Set>
inline void for_each_option(const std::string& spec, const std::string& args, bool has_colon, const char* keys, Set set) {
  std::size_t start = 0;
  while (has_colon && start <= args.size()) {
    const auto comma = args.find(',', start);
    const std::string item = args.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    start = comma == std::string::npos ? args.size() + 1 : comma + 1;
    const auto eq = item.find('=');
    if (eq == std::string::npos)
      throw InvalidArgument(fmt::format("method '{}': option '{}' needs the form key=value (keys: {})", spec, item, keys));
    set(item.substr(0, eq), item.substr(eq + 1));
  }
}

// Runs f (a config's validate(), a name lookup); an InvalidArgument it throws comes back prefixed
// with "method '<spec>': ", so the message names the spec the user wrote.
template <class F>
inline void naming_spec(const std::string& spec, F f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("method '{}': {}", spec, e.what()));
  }
}

// Parse the options of a `vq[:...]` spec into a MethodSpec of kind Vq; throws InvalidArgument.
MethodSpec parse_vq_spec(const std::string& spec, const std::string& args, bool has_colon);
// Canonical text, e.g. "vq:bits=2,calib=64,residual=0,alloc=flat,basis=weights,shape=on,rope=on" (",sinks=N" after
// residual only when N > 0).
std::string vq_spec_string(const MethodSpec& m);
// One VqKVCache per attention layer (plain KVCache elsewhere). With a checkpoint the transforms are
// derived from its weights (vq/basis.hpp); without one (synthetic K/V) they are the identity.
// Layer `l`'s model from a checkpoint's weights, with its source (fingerprint, l, basis) set.
VqLayerModel vq_checkpoint_layer(const Checkpoint& ck, std::size_t l, const VqBasisOptions& basis, std::uint64_t fingerprint);
// The same, shared process-wide while anyone holds it (built once per (fingerprint, l, basis)).
std::shared_ptr<const VqLayerModel> shared_checkpoint_layer(const Checkpoint& ck, std::size_t l, const VqBasisOptions& basis,
                                                            std::uint64_t fingerprint);
// `model_weights` (may be null): the model whose kept layer models (Transformer::vq_layer_model) the
// caches share.
std::vector<std::shared_ptr<KVCache>> make_vq_caches(const MethodSpec& m, const ModelDescription& model, const Transformer* model_weights);

}  // namespace vq::detail
