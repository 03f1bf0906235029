// Prefix lookup: what a store holds of a prompt's prefix, found from the store itself.
//
// What a reader must know first:
// - The reader names neither the chunk size nor the levels of the put: the chunk sizes come from
//   the store's chunk-sizes blob, and each chunk position's directory (store/prefix_chunks.hpp)
//   lists every (model, level) stored there. `chunk_tokens` and `levels` given by the caller only
//   narrow that (one size; the levels in the list).
// - All directory keys of all sizes come in one pipelined get (get_many); when that batch fails (a
//   cluster node down), the keys are got one by one, per size, up to the first that fails.
// - A chunk is usable when its directory lists, for this model, an allowed level whose key is the
//   one the key chain gives for this prefix and level. The usable prefix of a size is the longest
//   run of chunks from 0 that share at least one usable level (the loader's plan prices "the rest
//   at one level", so every chunk of the prefix must hold the levels it keeps: the common ones),
//   and it leaves at least one prompt token to the host. Among sizes, the one reusing the most
//   tokens wins (ties: the larger size, fewer fetches).
// - Where the chosen size's prefix ends, the lookup says why (PrefixLookup::end): not stored, a
//   fault (a store error, a corrupt directory), stored for another model only (named by its
//   fingerprint), stored at levels the caller's list leaves out, stored at levels the chunks before
//   it lack, or stored but holding the prompt's last token (which the host must compute itself).
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/store/kv_store.hpp"
#include "veloxquant/store/prefix_chunks.hpp"

namespace vq {

// Where a prefix ends and why.
struct PrefixEnd {
  int index = 0;                      // the chunk position
  std::string status;                 // "miss" (nothing usable stored there) or "fault" (a store or blob fault)
  std::vector<std::string> levels;    // levels stored there for this model (empty: none)
  std::string reason;                 // one sentence, e.g. "not stored", "stored for another model (fingerprint ...)"
  bool stored = false;                // a miss where something is stored (another model's, other levels, the last token)
};

struct PrefixLookup {
  int chunk_tokens = 0;                        // the size chosen (0: nothing stored at any size)
  std::vector<ChunkDirectory> dirs;            // the usable prefix: per chunk, this model's entries of the common levels
  std::vector<std::vector<std::string>> stored_levels;  // per chunk of the prefix: every level stored for this model
  std::optional<PrefixEnd> end;                // where the prefix ends, when a chunk position after it was looked at
  std::string fault;                           // a fault that ended the chosen size's prefix (also in end), else ""
};

// Look up the longest usable prefix of `tokens` (see above). `chunk_tokens` 0: every size stored;
// `levels` empty: every level stored. Never throws for store faults (they end the prefix, with the
// fault in `end` and `fault`); throws InvalidArgument on bad arguments.
PrefixLookup lookup_prefix(KVStore& store, std::uint64_t model_fingerprint, int chunk_tokens, const std::vector<std::string>& levels,
                           std::span<const int> tokens);

}  // namespace vq
