// The prefix loader: CacheGen's adaptive streaming of a stored prefix into a host's live caches.
//
// What a reader must know first:
// - Given a prompt's tokens, the loader walks the directory chain (store/prefix_chunks.hpp; all
//   directory keys fetched in one pipelined get) to find the longest stored prefix of whole chunks,
//   leaving at least one prompt token for the host to prefill (its logits start the generation).
// - Per chunk it picks a level with store/load_plan.hpp's cost model, re-planning the chunks left
//   before every fetch: without a deadline the best quality stored (fp32 when stored); with one
//   (slo_ms), the best level that the predicted pipeline (fetch at the measured rate, decode on the
//   decoder threads, feed in order; the chunks already in flight included) still finishes within
//   the time left, less slo_margin of it, even if the link fell to slo_guard of its measured rate
//   now (a drop mid-load; when no plan survives that, what exposes the fewest bytes to it); when
//   nothing fits, what finishes soonest. A chunk is
//   recomputed from its tokens (model forward over the live caches) when that finishes sooner.
//   Quality order: fp32 (and recompute) first, then the other levels by size, largest first.
// - Costs: decode and feed ms per (level, chunk shape) from LoadCostTable (LoaderOptions::costs, or
//   the process's table), updated with every chunk; with a deadline, a level the table does not know
//   yet is measured before planning by fetching and decoding chunk 0 at that level once (the first
//   load of a process pays it, inside its load_ms); recompute: a 16-token forward, then measured.
// - Link: measured from its own transfers, emulated or not: the slower of the last fetch's rate and
//   a running average of ms per byte (a drop shows at once, a recovery over a few chunks; 1 Gbps
//   before any fetch, or the emulated rate); emulated with a client-side token bucket
//   (bandwidth_mbps, optionally dropping to bandwidth_after_mbps once drop_after_bytes have been
//   fetched, which the planner is not told): a fetch of b bytes ends no earlier than the bucket allows.
// - Fetching runs on its own thread, one chunk after another (the link is one pipe), and overlaps
//   decoding: each fetched chunk is decoded by one of `threads` decoder threads (all cores by
//   default), so up to `threads` chunks decode at once while the next one is fetched. Chunks are fed
//   to the caches in chunk order on the calling thread (caches[l]->update with the decoded K/V, or a
//   forward pass for a recomputed chunk), so the caches hold exactly what a one-thread load gives.
//   The fetcher runs at most `threads` chunks ahead of the last chunk fed (memory stays bounded).
// - LoaderOptions::level forces one level for every chunk (no choice, no recompute; the level must
//   be one of the scheme's).
// - Without a model (the C API's overload): chunks are never recomputed (loading stops at the first
//   chunk it cannot load), vq levels decode only when their transforms came from the data, and the
//   caller gives the chunk shape the caches take.
// - Faults never give a wrong cache: a store error or timeout, a missing blob, a corrupt blob or a
//   blob of another model, method or token sequence produces one warning (via `warn`) naming the
//   chunk and the cause, and loading stops there: the chunk and the rest are left to the host's
//   prefill (recomputed). A chunk is fed only after it decoded completely and passed every check.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/store/kv_store.hpp"
#include "veloxquant/store/load_plan.hpp"
#include "veloxquant/store/prefix_chunks.hpp"
#include "veloxquant/store/prefix_lookup.hpp"

namespace vq {

class Transformer;

struct LoaderOptions {
  // The model's fingerprint, and what narrows the lookup: chunk_tokens 0 (the default here) takes
  // every chunk size stored, levels empty every level stored (store/prefix_lookup.hpp).
  ChunkScheme scheme = {.model_fingerprint = 0, .chunk_tokens = 0, .levels = {}};
  std::optional<double> slo_ms;             // deadline for the whole load (time to first token)
  std::optional<double> bandwidth_mbps;     // emulated link (megabits per second); unset: measured
  std::optional<double> bandwidth_after_mbps;  // the emulated link after drop_after_bytes
  std::uint64_t drop_after_bytes = 0;
  std::optional<std::string> level;         // load every chunk at this level (canonical spec); unset: choose
  int threads = 0;              // decoder threads; 0: std::thread::hardware_concurrency()
  bool allow_recompute = true;  // false: a stored chunk is always loaded, never recomputed by choice
                                // (benchmarks that time loading alone); faults still stop the load.
                                // No recompute probe then: prefill_ms_estimate stays 0
  // The layer models vq levels decode with (chunk_vq_models(model)); unset: built during the load,
  // on first use. A host that loads many prefixes of one model builds them once and passes them here.
  VqLayerModelSource vq_models = {};
  // Decode / feed / recompute costs per (level, chunk shape) (store/load_plan.hpp): read to plan,
  // updated with every chunk loaded; unset: the table shared by the loads of this process.
  LoadCostTable* costs = nullptr;
  // With slo_ms: the share of the time left the plan keeps free (noise of the link and the cores).
  double slo_margin = 0.15;
  // With slo_ms: the link the deadline is guarded against, as a fraction of the measured rate (0, 1]
  // (PlanCosts::guard_bytes_per_ms): the plan still meets the deadline if the link falls to this
  // fraction at any moment, whenever some plan can; 1: trust the measured link.
  double slo_guard = 0.1;
  // A blob refused for what it holds (it does not decode, fails its checks, or belongs to another
  // prefix) is removed from the store with its directory entry (forget_chunk), so the next put of
  // the prefix stores it again; said in the warning. false: the store is only read.
  bool repair = true;
};

struct LoadedChunk {
  int index = 0;
  std::string level;  // a level's spec, or "recompute"
  std::uint64_t bytes = 0;
  double fetch_ms = 0, decode_ms = 0;
  std::vector<std::string> levels;  // every level stored for this model at this chunk
  // Why `level`: "plan: the best level stored", "plan: ... within the deadline", "plan: a smaller
  // level, to meet the deadline (or come nearest it)", "plan: recomputing is predicted sooner than
  // fetching", or "forced level" (LoaderOptions::level).
  std::string reason;
};

struct LoadReport {
  int tokens_filled = 0;               // tokens now in the caches (whole chunks, loaded or recomputed)
  int tokens_reused = 0;               // of them, loaded from the store
  int chunks_stored = 0;               // length of the stored prefix found, in chunks
  double load_ms = 0;                  // wall time of the whole load
  double prefill_ms_estimate = 0;      // what recomputing the reused tokens would have cost (estimate)
  std::vector<LoadedChunk> chunks;     // the chunks filled, in order (each a hit of the lookup)
  std::vector<std::string> warnings;   // also passed to `warn` as they happen
  int chunk_tokens = 0;                // the chunk size found (0: nothing stored at any size)
  // Where reuse ended and why: the lookup's end of the prefix (a miss, or a fault in the index), or
  // the chunk whose blob faulted while loading; unset when the prompt had no chunk after the prefix.
  std::optional<PrefixEnd> end;
  // One line when a stored prefix exists but was not (all) used, saying why (chunks the plan
  // recomputed; a chunk stored for another model only, at levels not asked for, or holding the
  // prompt's last token); "" otherwise. Faults are warnings instead.
  std::string not_used;
};

// The report as JSON text: {"tokens_reused", "tokens_filled", "chunk_tokens", "load_ms",
// "prefill_ms_estimate", "chunks": [{"index", "status": "hit", "levels", "level", "reason",
// "bytes", "fetch_ms", "decode_ms"}], "miss": null or {"index", "status": "miss"|"fault",
// "levels", "reason"}, "not_used", "warnings"} (generate --json and vq_store_report print it).
std::string load_report_json(const LoadReport& report);

// Fill `caches` (empty, one per layer, the host's live caches) with the longest stored prefix of
// `tokens`. Never throws for store faults (see above); throws InvalidArgument on bad arguments.
LoadReport load_prefix(KVStore& store, Transformer& model, std::vector<std::shared_ptr<KVCache>>& caches, std::span<const int> tokens,
                       const LoaderOptions& options, const std::function<void(const std::string&)>& warn = {});

// The same without a model: each layer's chunk K/V must be [1, kv_heads, C, head_dim]; nothing is
// recomputed, so tokens_filled == tokens_reused.
struct ChunkShape {
  std::int64_t kv_heads = 0, head_dim = 0;
};
LoadReport load_prefix(KVStore& store, const ChunkShape& shape, std::vector<std::shared_ptr<KVCache>>& caches, std::span<const int> tokens,
                       const LoaderOptions& options, const std::function<void(const std::string&)>& warn = {});

}  // namespace vq
