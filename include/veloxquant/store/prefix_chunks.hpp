// Prefix chunks: a context's KV cache (all layers) stored in chunks of C tokens, each chunk at
// several quality levels, under keys chained over the prefix (vLLM's block hashes, LMCache's chunks).
//
// What a reader must know first:
// - Chunk i holds tokens [i*C, (i+1)*C) of the context (BOS is token 0). Only whole chunks are
//   stored: a context of n tokens yields floor(n / C) chunks.
// - Keys: key_i = xxHash64(key_{i-1} || model fingerprint || level's canonical method spec ||
//   the chunk's token ids), key_{-1} = 0, written "vq-<level hash>-<16 hex>" ("<level hash>": 8 hex
//   digits of the spec's hash, so `store ls` groups a level's chunks). Two prompts sharing a prefix
//   share its keys, so the longest stored prefix is found by walking the chain until a key is missing.
// - A level is a method spec (methods/method_spec.hpp), named as store_level names it (a vq profile
//   by its hash, not its path). What a chunk holds at level L, exactly:
//   a fresh cache of method L (make_caches, one per layer), fed the chunk's exact float32 K/V (what
//   the model computes for those tokens with the exact prefix before them) in one update call;
//   the chunk's K/V at level L is that cache's state(). decode_chunk returns it bit for bit.
//   So every chunk is coded independently (CacheGen's chunks): no chunk needs another to decode.
//   Except (put_context) `vq` levels whose caches have a model layer, residual=0, sinks=0 and
//   calib <= C ("live-coded" vq levels): there chunk i holds the codes that ONE live cache of L per
//   layer, fed the context chunk by chunk, holds for the chunk's tokens, with that cache's
//   calibration (made from the context's first calib tokens; chunk 0 is the same either way). Each
//   blob still decodes alone (it carries the calibration and, in metadata, its first position: the
//   keys' RoPE positions), to the live cache's rows for its tokens,
//   and a host whose caches are that level's VqKVCache takes the codes as they are
//   (VqKVCache::append_codes): the host ends bit for bit where the live cache was.
// - Blob: a whole .vqkv file (format/vqkv.hpp: self-describing, every block checksummed) whose
//   metadata names the model fingerprint, the level, the chunk index and the chunk's token ids;
//   decode_chunk checks all four and throws FormatError naming what differs. Caches the .vqkv
//   format holds are written as they are; an Fp16KVCache (float32 rows holding float16 values) is
//   written as a plain float16 KVCache (exact, 2 bytes per element); any other class is refused
//   with InvalidArgument naming the level, until the format learns it.
// - The index, what a lookup discovers (store/prefix_lookup.hpp): a directory blob per chunk
//   position, keyed by a chain over the chunk size and the token ids alone (no model, no level:
//   dir_i = chain_hash(dir_{i-1}, 0, "dir:" + C, the chunk's token ids), written "vq-dir-<16 hex>"),
//   lists every (model fingerprint, level) stored there with its blob's key and size. put_context
//   writes a chunk's level blobs first, then merges their entries into the directory
//   (read-modify-replace, KVStore::replace; read back and merged again when a concurrent writer's
//   replace won, up to 3 tries: an entry lost to a race is a miss until the next put, never a wrong
//   blob). And the chunk sizes stored at all are listed in one blob, "vq-dir-chunk-sizes", merged
//   the same way. So a reader needs neither the level list nor the chunk size of the put: it finds
//   them, and a prefix stored for another model is found and named as such (a miss with its reason).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/tensor.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/store/kv_store.hpp"
#include "veloxquant/vq/basis.hpp"

namespace vq {

class Transformer;

inline constexpr int kDefaultChunkTokens = 256;
// The default levels, as the method table lists them (vq::default_store_levels(),
// methods/method_table.hpp, is what the CLI and the C API use); kept for code written against it.
inline constexpr const char* kDefaultLevels = "vq:bits=1;vq:bits=2;vq:bits=4";

// One layer's K/V of one chunk: [1, n_kv_heads, C, head_size] float32 each.
struct ChunkLayer {
  Tensor keys, values;
};
using ChunkKV = std::vector<ChunkLayer>;

// What identifies a stored context: the model and how it is chunked. put_context stores at exactly
// these levels and chunk size. A reader (LoaderOptions::scheme) only narrows what it finds: levels
// empty takes every level stored for the model, chunk_tokens 0 every chunk size stored.
struct ChunkScheme {
  std::uint64_t model_fingerprint = 0;
  int chunk_tokens = kDefaultChunkTokens;
  std::vector<std::string> levels;  // canonical method specs; "fp32" is the raw exact level
};
// The most chunk sizes a lookup tries (the chunk-sizes blob lists at most this many: a put of one
// more size replaces the oldest), and the most entries a directory holds (a put that would add
// more replaces the directory with its own entries).
inline constexpr std::size_t kMaxChunkSizes = 16;
inline constexpr std::size_t kMaxDirectoryEntries = 1024;
// Index blobs (directories, the chunk-sizes list) are small JSON; a larger one is refused unread.
inline constexpr std::uint64_t kMaxIndexBlobBytes = std::uint64_t{4} << 20;

// A hash of everything that decides a model's K/V: its configuration and every weight.
std::uint64_t model_fingerprint(const Transformer& model);
// The fingerprint of a model known only by a caller-given identity (the C API: an engine names its
// model, e.g. by a hash of its weights file): xxHash64 of the identity's bytes. The caller must
// make it differ whenever the K/V differ; chunks stored under one identity never match another.
std::uint64_t named_model_fingerprint(std::string_view identity);

// Fresh caches of a level's method, one per layer. With a model: make_caches(level, model) (vq
// levels get the model's layer transforms); without one: make_caches(level, ModelDescription)
// (vq levels derive their transforms from the data, which needs no model to decode).
using LevelCaches = std::function<std::vector<std::shared_ptr<KVCache>>(const std::string& level)>;
LevelCaches model_level_caches(const Transformer& model);  // `model` must outlive the result

// A level as a store names it: the canonical spec, a vq profile named by its hash
// (vq/profile.hpp's vq_profile_ref) instead of the path this host read it from, so that hosts
// keeping one profile at different paths share its chunks and a shared store learns no local path.
// Throws as MethodSpec::parse and load_vq_profile do.
std::string store_level(const std::string& spec);
// Parse a ';'-separated level list into store levels (store_level), appending "fp32" when absent;
// duplicates removed, order kept. Throws InvalidArgument on a bad spec.
std::vector<std::string> parse_levels(const std::string& list);

// The chain: key_i from key_{i-1} (0 for the first chunk).
std::uint64_t chain_hash(std::uint64_t prev, std::uint64_t model_fingerprint, const std::string& level, std::span<const int> tokens);
std::string chunk_key(const std::string& level, std::uint64_t hash);
// The hash a chunk key was made from (chunk_key's inverse), or nullopt for a key chunk_key does not make.
std::optional<std::uint64_t> chunk_key_hash(std::string_view key);
// The directory chain of a chunk size (no model, no level: see above).
std::uint64_t directory_hash(std::uint64_t prev, int chunk_tokens, std::span<const int> tokens);
std::string directory_key(std::uint64_t hash);
// The blob listing the chunk sizes stored, and its coding (decode throws FormatError).
inline constexpr const char* kChunkSizesKey = "vq-dir-chunk-sizes";
Blob encode_chunk_sizes(const std::vector<int>& sizes);
std::vector<int> decode_chunk_sizes(std::span<const std::uint8_t> blob);

// The chunk's K/V at `level` (see the definition above): a fresh cache of that method per layer fed
// `exact` (the chunk's exact float32 K/V, one entry per layer).
ChunkKV level_chunk_kv(const Transformer& model, const std::string& level, const ChunkKV& exact);

// Encode chunk `index` (its token ids `tokens`) at `level` from the exact K/V: the blob. `chain` is
// the chunk's key hash (chain_hash over every chunk up to and including this one, at this level and
// model): the blob carries it, so it is bound to its whole prefix, not only to its own tokens.
Blob encode_chunk(const Transformer& model, std::uint64_t model_fingerprint, const std::string& level, int index, std::uint64_t chain,
                  std::span<const int> tokens, const ChunkKV& exact);
Blob encode_chunk(const LevelCaches& fresh, std::uint64_t model_fingerprint, const std::string& level, int index, std::uint64_t chain,
                  std::span<const int> tokens, const ChunkKV& exact);
// Decode a blob and check that it is chunk `index` of these tokens, after this prefix (`chain`, as
// encode_chunk), at this level for this model. Throws FormatError (corrupt blob, or one of another
// model/level/index/prefix/tokens; a blob written before blobs carried their prefix hash is refused
// too). `vq_models` rebuilds the layer models of vq levels (chunk_vq_models(model)); without it a
// vq chunk is refused.
ChunkKV decode_chunk(std::span<const std::uint8_t> blob, std::uint64_t model_fingerprint, const std::string& level, int index,
                     std::uint64_t chain, std::span<const int> tokens, const VqLayerModelSource& vq_models = {});
// The same for a host that takes vq codes as they are: layer l comes as codes (vq[l], kv[l] empty)
// where the blob holds codes only (a vq level, every token quantized), as rows (kv[l]) otherwise.
struct ChunkCodes {
  ChunkKV kv;
  std::vector<std::optional<VqStoredLayer>> vq;
  std::int64_t first_position = 0;  // of the chunk's first token in its context, for a live-coded chunk; else 0
};
// A vq layer of a chunk as float32 rows ([1, H, C, D] each): what decode_chunk gives for it (keys
// re-rotated at first_position + t). Throws InvalidArgument / FormatError on codes that do not fit.
ChunkLayer vq_chunk_rows(const VqStoredLayer& layer, std::int64_t first_position);
// `buffers`: where the vq layers' code arrays come from (VqkvLoadOptions::vq_code_buffers), e.g.
// those of chunks already fed, given back by the loader.
ChunkCodes decode_chunk_codes(std::span<const std::uint8_t> blob, std::uint64_t model_fingerprint, const std::string& level, int index,
                              std::uint64_t chain, std::span<const int> tokens, const VqLayerModelSource& vq_models = {}, VqCodeBuffers* buffers = nullptr);
// Whether caches of a level are live-coded by put_context (see above).
bool live_coded_level(const std::vector<std::shared_ptr<KVCache>>& fresh_caches, int chunk_tokens);
// The layer models of `model` for decode_chunk, built once per (layer, basis) and shared by every
// chunk a loader decodes (thread-safe). `model` must outlive the returned function.
VqLayerModelSource chunk_vq_models(const Transformer& model);

// One chunk position's directory: each (model, level) stored there, its key and blob size.
struct ChunkDirectory {
  struct Entry {
    std::string level, key;
    std::uint64_t bytes = 0;
    // A live-coded vq level: the packed field widths its live caches held after this chunk, layer
    // by layer, K then V (VqKVCache::key_widths / value_widths). A code-domain load of chunks
    // 0..i packs at directory i's widths from its first chunk on, so the host neither chooses
    // widths from chunk 0 nor widens while it loads. A hint only: widths change memory, never
    // values (a wrong one is widened as any cache widens). Empty otherwise, and in directories
    // written before it.
    std::vector<std::uint8_t> widths = {};
    std::uint64_t model = 0;  // the model fingerprint the blob was stored for
  };
  std::vector<Entry> entries;
  int chunk_tokens = 0;  // the chunk size of the chain it sits on (a lookup checks it)
};
Blob encode_directory(const ChunkDirectory& dir);
ChunkDirectory decode_directory(std::span<const std::uint8_t> blob);  // throws FormatError

// Store the first floor(tokens.size() / C) chunks of a context at every level of `scheme`, from the
// exact per-layer K/V of all its tokens ([1, H, n, D] each; e.g. the state of plain caches after a
// prefill). A level a chunk's directory already lists for the model is skipped (put is idempotent;
// a put at new levels adds them beside the old). Returns per chunk the entries of the scheme's
// levels, in its order.
struct PutReport {
  int chunks = 0, chunks_written = 0;
  std::uint64_t bytes_written = 0;  // level blobs written, and index blobs (each replace counted whole)
  std::vector<ChunkDirectory> directories;
};
// Drop a refused blob (corrupt, forged, of another prefix): its entry leaves chunk position's
// directory `directory` (read-modify-replace) and the blob is removed, so the next put of the same
// prefix stores it again. Throws IoError.
void forget_chunk(KVStore& store, const std::string& directory, const std::string& key);

PutReport put_context(KVStore& store, const Transformer& model, const ChunkScheme& scheme, std::span<const int> tokens,
                      const std::vector<KVState>& exact);
// The same without a model (the C API): `fresh` makes each level's caches.
PutReport put_context(KVStore& store, const LevelCaches& fresh, const ChunkScheme& scheme, std::span<const int> tokens,
                      const std::vector<KVState>& exact);

}  // namespace vq
