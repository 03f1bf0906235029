// The prefix loader's cost model and level choice (store/prefix_loader.hpp uses it): given what is
// left to load, what each option costs and the time left before the deadline, which level to fetch
// for the next chunk. Pure and deterministic: the loader feeds it measurements; tests feed it costs.
//
// What a reader must know first:
// - The pipeline it predicts is the loader's: one fetch thread fetches chunk after chunk over one
//   link (a chunk of b bytes takes b / rate, where the rate may drop after a number of bytes when the
//   caller knows it, as a clairvoyant plan does; the loader itself never knows a drop ahead); at most
//   `threads` decoder threads decode fetched chunks at once (a chunk of level L takes decode_ms[L] on
//   its thread); the calling thread feeds the chunks in order (feed_ms[L] each) or recomputes a chunk
//   on its own (recompute_ms, no fetch); the fetcher runs at most `threads` chunks ahead of the last
//   chunk fed. predict_ms() runs that pipeline over a plan and returns when its last chunk is fed.
// - Costs: per level, decode and feed ms per chunk, as measured in this process (LoadCostTable:
//   shared by the loads of a process, per level and chunk shape, an average that follows recent
//   measurements); a level without a measurement is priced at `unknown_decode_ms` (the loader
//   measures every level once before it plans, so this is the fallback of a failed probe).
// - The choice (choose_level): quality order is fp32 first, then the other levels by size, largest
//   first (recompute is exact, so it ranks with fp32). It finds the best level u such that loading
//   every chunk left at u is predicted to finish within the time left, then lets the next chunk take
//   a better level when the plan "next at the better level, the rest at u" still fits (slack is spent
//   one chunk at a time; the loader re-plans after every chunk with what it measured meanwhile). The
//   next chunk is recomputed instead when that plan is predicted to finish sooner (recompute is exact
//   and not slower). When no level fits, it takes whatever finishes soonest (a level or recompute).
//   Without a deadline: the best quality, or recompute when that finishes sooner.
// - The guard (PlanCosts::guard_bytes_per_ms, the loader sets it): a link may drop at any moment,
//   and a plan that fits only at the rate just measured loses the deadline when it does (a chunk
//   fetched at 10x its share of the time left, when the link falls to a tenth, leaves nothing for the
//   rest). With a guard, every prediction above prices all the fetches left, the next chunk's
//   included, at the guard rate: the chosen level still meets the deadline if the link falls to the
//   guard now. When no plan fits at the guard rate, it takes what finishes soonest at the guard rate
//   (the fewest bytes exposed to a drop; recompute only when it is also sooner at the measured rate,
//   so a guard never makes a fast link's chunk recomputed). Quality is what the guard costs: the slack
//   spent on better levels is what would survive the drop.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/store/prefix_chunks.hpp"

namespace vq {

// What the planner knows about the costs of the options left.
struct PlanCosts {
  double link_bytes_per_ms = 125e3;  // expected rate of the link for the fetches left (1 Gbps)
  // A known drop (clairvoyant plans, benchmarks): after `drop_after_bytes` more bytes, the rate is this.
  std::optional<double> link_after_bytes_per_ms;
  std::uint64_t drop_after_bytes = 0;
  std::map<std::string, double> decode_ms;  // per level: one chunk's decode on one decoder thread
  std::map<std::string, double> feed_ms;    // per level: feeding one decoded chunk to the caches
  double unknown_decode_ms = 0;             // a level missing from decode_ms
  std::optional<double> recompute_ms;       // one chunk recomputed on the calling thread; unset: never
  int threads = 1;                          // decoder threads
  // The rate the deadline is guarded against (see above); unset, or not below link_bytes_per_ms:
  // the plan trusts link_bytes_per_ms (and a known drop).
  std::optional<double> guard_bytes_per_ms;
};

// Where the pipeline is when the plan starts, in ms from now.
struct PlanStart {
  double feed_free_ms = 0;            // when the chunks already chosen are all fed
  std::vector<double> decoder_free_ms;  // when each decoder thread is free (missing: now)
  std::vector<double> fed_at_ms;      // when each of the last chunks already chosen is fed (oldest first)
};

inline constexpr int kRecompute = -1;  // a plan's entry for a recomputed chunk

// The directory entries of a chunk in quality order (fp32 first, then by size, largest first).
std::vector<int> quality_order(const ChunkDirectory& dir);

// When the last chunk of `plan` is fed, in ms from now: plan[j] is the entry (index into
// dirs[first + j].entries) or kRecompute for chunk first + j.
double predict_ms(std::span<const ChunkDirectory> dirs, int first, std::span<const int> plan, const PlanCosts& costs,
                  const PlanStart& start = {});

// The level of chunk `first` (an entry index, or kRecompute when costs.recompute_ms is set), see above.
// `time_left_ms` unset: no deadline.
int choose_level(std::span<const ChunkDirectory> dirs, int first, std::optional<double> time_left_ms, const PlanCosts& costs,
                 const PlanStart& start = {});

// Decode and feed costs per (level, chunk shape) measured by the loads of a process: each new
// measurement moves the average halfway (recent load on the cores counts most). Thread-safe.
class LoadCostTable {
 public:
  struct Cost {
    double decode_ms = 0, feed_ms = 0;
    int samples = 0;
  };
  std::optional<Cost> get(const std::string& level, const std::string& shape) const;
  void record(const std::string& level, const std::string& shape, double decode_ms, double feed_ms);
  void clear();

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, Cost> costs_;
};
// The table the loads of this process share (LoaderOptions::costs unset).
LoadCostTable& process_load_costs();
// The table's name of a chunk shape: "LAYERSxKV_HEADSxCHUNK_TOKENSxHEAD_DIM".
std::string cost_shape_key(std::size_t layers, std::int64_t kv_heads, std::int64_t chunk_tokens, std::int64_t head_dim);

}  // namespace vq
