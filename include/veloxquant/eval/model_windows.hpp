// Windows of a text through the model: each window is BOS and the next seq_len - 1 tokens (the
// model's whole context), run through fresh caches of one method. What `bench codec --model`
// compresses: the caches of real K/V, window after window.
#pragma once
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/transformer.hpp"

namespace vq {

using WindowCaches = std::vector<std::shared_ptr<KVCache>>;

// Runs up to `windows` consecutive windows of `tokens` (no BOS among them; each window adds its
// own), each through fresh caches of `spec`, and hands every window's caches to `take` after its
// forward pass. Returns the number of windows run (0: too few tokens for one).
int run_model_windows(Transformer& model, std::span<const int> tokens, int windows, const MethodSpec& spec,
                      const std::function<void(const WindowCaches&)>& take);

}  // namespace vq
