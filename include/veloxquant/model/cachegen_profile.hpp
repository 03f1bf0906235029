// Profiling the CacheGen paper codec's tables through a model (the paper profiles them offline,
// once per model). `veloxquant profile` runs text; a cachegen_paper spec without profile=PATH
// profiles the model's own samples instead, so that no evaluated text leaks into its tables.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "veloxquant/peers/cachegen_paper_profile.hpp"

namespace vq {

class Transformer;

// Run each sequence (token ids, BOS first) through exact float32 caches in one forward pass and
// count its K/V symbols. Throws InvalidArgument on an empty list or a sequence longer than seq_len.
CachegenPaperProfile profile_cachegen_paper(Transformer& model, const std::vector<std::vector<int>>& sequences,
                                            const CachegenPaperConfig& config);

// `tokens` (text without BOS) cut into sequences of BOS + (window - 1) tokens, as the evaluation's
// windows are, after skipping `skip` tokens, until `max_tokens` text tokens are used (a last
// partial window is kept when it holds at least one token).
std::vector<std::vector<int>> profile_windows(const std::vector<int>& tokens, int window, std::int64_t skip, std::int64_t max_tokens);

// `n_tokens` positions sampled from the model itself in sequences of up to `window` (BOS, then
// run.c's sampler at temperature 1, top-p 0.9, seed `seed`; a sampled BOS/EOS simply continues).
std::vector<std::vector<int>> sample_sequences(Transformer& model, std::int64_t n_tokens, int window, std::uint64_t seed);

// The profile a cachegen_paper cache of `model` uses: config.profile loaded when set (cached per
// path, size and modification time), else profile_cachegen_paper over sample_sequences(model,
// config.profile_tokens, min(256, seq_len), 1) on a copy of the model (cached per model weights
// and settings), so building caches per evaluation window costs one profile per process.
// `model` may be null only when config.profile is set. Throws InvalidArgument (no model and no
// profile, or a profile for other settings), IoError, FormatError.
std::shared_ptr<const CachegenPaperProfile> cachegen_paper_profile_for(const CachegenPaperConfig& config, const Transformer* model,
                                                                       int n_layers);

}  // namespace vq
