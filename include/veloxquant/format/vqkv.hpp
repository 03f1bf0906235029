// The .vqkv container: save a model's per-layer KV caches to a file and load them back exactly.
//
// What a reader must know first (the byte layout, field by field, is docs/format.md; the private
// src/format/vqkv_layout.hpp holds the constants and the block plan both sides share):
// - A file is a header (magic, version, the model shape, every layer's cache class and full
//   configuration, string metadata) with its own xxHash64, then blocks, each a fixed 32-byte block
//   header, a body and an xxHash64 of both. Integers are little-endian and fixed-width.
// - Blocks come in one fixed order, so a reader can stream them: the models of every CacheGen
//   (layer, side) first (version 2 writes the context coder's model up to 4 bits, per-channel
//   frequency tables above; version 1 files, tables only, still load); then token chunks (chunk k holds tokens [k*C, (k+1)*C) of every
//   layer, K then V: a CacheGen layer's closed groups starting there, coded with rANS, with their
//   float32 scales and minima; a plain layer's rows); then the CacheGen residuals (tokens not yet in
//   a closed group, stored exactly); then an END block that counts the blocks before it.
// - Loading rebuilds the same cache classes with the same configurations and offset: fetching from
//   a loaded cache returns bit for bit what the saved cache returned, and the loaded cache keeps
//   working as if it had never been saved (its codes, scales and counters are the saved ones).
// - Readers validate everything (lengths, enums, shapes, checksums, block order) and throw
//   vq::FormatError with one clear sentence; they never read out of bounds and allocate only as
//   the bytes present justify (the codes of a block at most group_size / 8 per byte of its
//   scales and minima; see docs/format.md).
// - Cache classes the format holds: KVCache (plain, exact rows), CacheGenKVCache and VqKVCache
//   (our `vq` method). Saving any other class throws InvalidArgument naming it.
// - A VqKVCache's transforms are not stored: they are rebuilt from the model's weights, so its
//   layer entry names the model by a fingerprint (model/vq_layer_models.hpp's vq_model_fingerprint),
//   the model layer and the basis options, and a loader needs VqkvLoadOptions::vq_models (e.g.
//   vq_layer_models(checkpoint)), which refuses another model's fingerprint. A vq cache built
//   without a model (identity transforms, synthetic K/V) needs none.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/cache/config.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/cache/stream_codec.hpp"
#include "veloxquant/core/dtype.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "veloxquant/vq/basis.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace vq {

class VqCodeBuffers;  // vq/code_buffers.hpp

// Free-form string pairs saved with the caches (mlx_lm's prompt-cache metadata), e.g. the model
// and the text a context came from.
using PromptMetadata = std::map<std::string, std::string>;

struct VqkvSaveOptions {
  // Tokens per chunk block (>= 1). Smaller chunks stream at a finer grain but pay ~180 bytes each
  // per layer and side (block header, checksum, group range, up to 128 bytes of rANS lane states):
  // about 0.4 % of a 2048-token chunk at stories260K's 32 channels per side, far less on larger
  // heads (docs/format.md).
  std::int64_t chunk_tokens = 2048;
  RansKernel kernel = RansKernel::Auto;
  // How CacheGen sides are coded: unset, as the caches' encoded_*_bytes count them (the stream
  // codec's default: the context coder up to 4 bits, per-channel tables of the codes above);
  // SymbolTransform::Codes forces per-channel tables. TokenDelta is refused.
  std::optional<SymbolTransform> transform = std::nullopt;
};

struct VqkvLoadOptions {
  RansKernel kernel = RansKernel::Auto;
  // Load only the first max_tokens tokens (a prefix): the reader decodes the chunks that cover them
  // and stops reading after the last block it needs, so a partly received file (a stream cut at a
  // block boundary) loads too. The caches are then what trim() would leave of the saved ones: a
  // group the prefix cuts is reopened, its kept rows (reconstructions) in the residual. Not set, or
  // >= the file's tokens: the whole file, END block and all, must be present.
  std::optional<std::int64_t> max_tokens = std::nullopt;
  // Rebuilds the layer models of VqKVCache layers saved from a model (vq_layer_models(checkpoint) in
  // model/vq_layer_models.hpp). Unset: such a file is refused with a FormatError naming the model's
  // fingerprint; what the source throws (another model's fingerprint) comes back as a FormatError.
  VqLayerModelSource vq_models = {};
  // Fill PromptCache::states (each layer's state(), bit for bit what the loaded cache's state()
  // gives) instead of PromptCache::caches. vq layers are then reconstructed straight from their
  // codes (vq_restored_state: no resident cache is packed and unpacked again); for a reader that
  // wants the K/V only, e.g. the store's decode_chunk.
  bool dense_states = false;
  // With dense_states: a vq layer of a model that holds codes only (every token quantized, no exact rows) comes
  // as its codes (PromptCache::vq_layers[l]; states[l] left empty) instead of rows, for a host that
  // takes codes as they are (VqKVCache::append_codes, the store's code-domain loads). Other layers
  // come as states.
  bool vq_codes = false;
  // Where vq layers' code arrays come from (vq_decode's buffers; null: fresh ones). A loader that
  // gives the arrays back after use (VqCodeBuffers::give) decodes chunk after chunk without
  // allocating them again. Must outlive the call.
  VqCodeBuffers* vq_code_buffers = nullptr;
};

// A vq layer as saved: what VqKVCache::restore / append_codes take (VqkvLoadOptions::vq_codes).
struct VqStoredLayer {
  VqConfig config;
  std::shared_ptr<const VqLayerModel> layer;  // the model's layer (never null)
  VqLayerCodes codes;
  DType dtype = DType::F32;  // the cache's input dtype
};

struct PromptCache {
  std::vector<std::shared_ptr<KVCache>> caches;  // empty with VqkvLoadOptions::dense_states
  PromptMetadata metadata;
  std::vector<KVState> states;  // VqkvLoadOptions::dense_states only: one per layer
  std::vector<std::optional<VqStoredLayer>> vq_layers;  // VqkvLoadOptions::vq_codes only: one per layer
};

// Serialise `caches` (one per layer; all non-empty ones hold the same tokens, shape and dtype).
// Throws InvalidArgument for a class the format cannot hold or caches that disagree.
std::vector<std::uint8_t> serialize_prompt_cache(const std::vector<std::shared_ptr<KVCache>>& caches,
                                                 const PromptMetadata& metadata = {}, const VqkvSaveOptions& options = {});
// Same, written atomically: a temporary file beside `path`, flushed, then renamed over it, so an
// interrupted save never leaves a partial file under the final name. Throws IoError.
void save_prompt_cache(const std::string& path, const std::vector<std::shared_ptr<KVCache>>& caches,
                       const PromptMetadata& metadata = {}, const VqkvSaveOptions& options = {});

// Throws FormatError on any malformed input (IoError when the file cannot be read).
PromptCache deserialize_prompt_cache(std::span<const std::uint8_t> bytes, const VqkvLoadOptions& options = {});
PromptCache load_prompt_cache(const std::string& path, const VqkvLoadOptions& options = {});

// Where a file's bytes go, per layer and side. The categories of every layer and side plus the
// file's own header and END block sum exactly to the file size.
struct VqkvBytes {
  std::uint64_t payload = 0;       // rANS streams (CacheGen) or the rows of a plain KVCache
  std::uint64_t tables = 0;        // serialised frequency tables
  std::uint64_t scales_zeros = 0;  // float32 scales and minima
  std::uint64_t residual = 0;      // CacheGen tokens not yet in a closed group, exact
  std::uint64_t headers = 0;       // block headers and the counts inside block bodies
  std::uint64_t checksums = 0;     // xxHash64 values
  std::uint64_t total() const { return payload + tables + scales_zeros + residual + headers + checksums; }
  void add(const VqkvBytes& o);
};

struct VqkvLayerInfo {
  std::string kind;                     // "KVCache", "CacheGenKVCache", "VqKVCache"
  std::optional<KVCacheConfig> config;  // CacheGen only
  std::optional<VqConfig> vq;           // VqKVCache only
  std::optional<VqModelSource> vq_model;  // VqKVCache built from a model: what rebuilds its transforms
  std::int64_t offset = 0;
  std::int64_t quantized_keys = 0, quantized_values = 0;  // CacheGen: tokens in closed groups; vq: tokens held as codes
  VqkvBytes keys, values;
};

struct VqkvInfo {
  int version = 0;
  DType dtype = DType::F32;
  std::int64_t batch = 0, heads = 0, key_dim = 0, value_dim = 0, tokens = 0, chunk_tokens = 0;
  PromptMetadata metadata;
  VqkvBytes file;  // the file header, its checksum and the END block
  std::vector<VqkvLayerInfo> layers;
  std::uint64_t file_bytes = 0;
};

// Parse and verify a whole file (structure, every checksum, every table) without decoding the
// rANS payloads. Throws FormatError.
VqkvInfo inspect_prompt_cache(std::span<const std::uint8_t> bytes);

// The whole file, read with a clear IoError when it is missing or unreadable.
std::vector<std::uint8_t> read_file_bytes(const std::string& path);

}  // namespace vq
