// veloxquant synth: write a synthetic, LLM-like K/V pair (see synth/synthetic_kv.hpp) as .npy.
#include <fmt/core.h>

#include "commands.hpp"
#include "output_paths.hpp"
#include "numeric_options.hpp"
#include "veloxquant/core/npy.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"

namespace vqcli {

Runner add_synth(CLI::App& app) {
  struct Options {
    vq::SyntheticKVConfig cfg;
    std::string keys, values, dtype = "float16";
  };
  auto o = std::make_shared<Options>();
  app.add_option("--keys-out", o->keys, "output keys .npy")->required();
  app.add_option("--values-out", o->values, "output values .npy")->required();
  app.add_option("--batch", o->cfg.batch, "batch size")->capture_default_str()->transform(integer_in(1, kMaxCount));
  app.add_option("--heads", o->cfg.heads, "KV heads")->capture_default_str()->transform(integer_in(1, kMaxCount));
  app.add_option("--tokens", o->cfg.tokens, "tokens")->capture_default_str()->transform(integer_in(0, kMaxCount));
  app.add_option("--head-dim", o->cfg.head_dim, "head dim (even)")->capture_default_str()->transform(integer_in(2, kMaxCount));
  app.add_option("--seed", o->cfg.seed, "random seed")->capture_default_str()->transform(any_uint64());
  app.add_option("--dtype", o->dtype, "float16 or float32")->capture_default_str();
  return [o] {
    require_distinct_outputs(o->keys, "--keys-out", o->values, "--values-out");
    o->cfg.dtype = vq::dtype_from_name(o->dtype);
    const auto kv = vq::make_synthetic_kv(o->cfg);
    vq::write_npy(o->keys, kv.keys);
    vq::write_npy(o->values, kv.values);
    fmt::print("wrote synthetic K/V {} {} to {} and {}\n", vq::shape_string(kv.keys.shape()), o->dtype, o->keys, o->values);
    return 0;
  };
}

}  // namespace vqcli
