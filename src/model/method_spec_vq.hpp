// The `vq` part of the method specs (our method), kept apart from method_spec.cpp so the peers'
// rows and ours can change independently. Private to the model stage.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/method_spec.hpp"

namespace vq::detail {

// Parse the options of a `vq[:...]` spec into a MethodSpec of kind Vq; throws InvalidArgument.
MethodSpec parse_vq_spec(const std::string& spec, const std::string& args, bool has_colon);
// Canonical text, e.g. "vq:bits=2,calib=64,residual=0,alloc=flat,basis=weights,shape=on,rope=on".
std::string vq_spec_string(const MethodSpec& m);
// One VqKVCache per attention layer (plain KVCache elsewhere). With a checkpoint the transforms are
// derived from its weights (vq/basis.hpp); without one (synthetic K/V) they are the identity.
std::vector<std::shared_ptr<KVCache>> make_vq_caches(const MethodSpec& m, const ModelDescription& model, const Checkpoint* weights);

}  // namespace vq::detail
