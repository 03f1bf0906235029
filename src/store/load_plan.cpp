// The loader's cost model and level choice (store/load_plan.hpp): a small simulation of the
// fetch / decode / feed pipeline over a plan, and the choice of the next chunk's level from it.
#include "veloxquant/store/load_plan.hpp"

#include <algorithm>
#include <limits>

#include <fmt/core.h>

namespace vq {

std::vector<int> quality_order(const ChunkDirectory& dir) {
  const auto& e = dir.entries;
  std::vector<int> order(e.size());
  for (std::size_t k = 0; k < e.size(); ++k) order[k] = static_cast<int>(k);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const auto& ea = e[static_cast<std::size_t>(a)];
    const auto& eb = e[static_cast<std::size_t>(b)];
    const bool fa = ea.level == "fp32", fb = eb.level == "fp32";
    if (fa != fb) return fa;
    return ea.bytes > eb.bytes;
  });
  return order;
}

double predict_ms(std::span<const ChunkDirectory> dirs, int first, std::span<const int> plan, const PlanCosts& c, const PlanStart& start) {
  const int threads = std::max(1, c.threads);
  std::vector<double> decoder(static_cast<std::size_t>(threads), 0.0);
  for (std::size_t t = 0; t < decoder.size() && t < start.decoder_free_ms.size(); ++t) decoder[t] = start.decoder_free_ms[t];
  std::vector<double> fed = start.fed_at_ms;  // fed time of every chunk before the next one (window)
  double feed = start.feed_free_ms, link_free = 0;
  std::uint64_t sent = 0;
  const auto cost_of = [](const std::map<std::string, double>& m, const std::string& level, double otherwise) {
    const auto it = m.find(level);
    return it != m.end() ? it->second : otherwise;
  };
  for (std::size_t j = 0; j < plan.size(); ++j) {
    const int k = plan[j];
    if (k == kRecompute) {
      feed += c.recompute_ms.value_or(std::numeric_limits<double>::infinity());
    } else {
      const auto& e = dirs[static_cast<std::size_t>(first) + j].entries[static_cast<std::size_t>(k)];
      // The fetcher may start chunk i once chunk i - threads - 1 is fed.
      const double window = fed.size() >= static_cast<std::size_t>(threads) + 1 ? fed[fed.size() - static_cast<std::size_t>(threads) - 1] : 0.0;
      const double rate = c.link_after_bytes_per_ms && sent >= c.drop_after_bytes ? *c.link_after_bytes_per_ms : c.link_bytes_per_ms;
      const double fetched = std::max(link_free, window) + static_cast<double>(e.bytes) / rate;
      sent += e.bytes;
      link_free = fetched;
      auto d = std::min_element(decoder.begin(), decoder.end());
      *d = std::max(*d, fetched) + cost_of(c.decode_ms, e.level, c.unknown_decode_ms);
      feed = std::max(feed, *d) + cost_of(c.feed_ms, e.level, 0.0);
    }
    fed.push_back(feed);
  }
  return feed;
}

namespace {

// predict_ms of the plan "chunk `first` at `next`, every chunk after it at `rest`".
double next_then_rest_ms(std::span<const ChunkDirectory> dirs, int first, int next, int rest, const PlanCosts& c, const PlanStart& start) {
  std::vector<int> plan(dirs.size() - static_cast<std::size_t>(first), rest);
  plan[0] = next;
  return predict_ms(dirs, first, plan, c, start);
}

// The choice of choose_level under one set of costs: the level (or kRecompute) and whether some
// plan was predicted to fit the time left.
struct Choice {
  int pick = kRecompute;
  bool fits = false;
};

Choice choose_under(std::span<const ChunkDirectory> dirs, int first, double time_left_ms, const PlanCosts& c, const PlanStart& start) {
  const std::vector<int> order = quality_order(dirs[static_cast<std::size_t>(first)]);
  const auto plan_ms = [&](int next, int rest) { return next_then_rest_ms(dirs, first, next, rest, c, start); };
  const bool may_recompute = c.recompute_ms.has_value();
  int uniform = kRecompute - 1;  // none yet
  for (const int k : order)
    if (plan_ms(k, k) <= time_left_ms) {
      uniform = k;
      break;
    }
  if (uniform != kRecompute - 1) {
    int pick = uniform;
    for (const int k : order) {  // better levels first; stops at `uniform`, which fits
      if (k == uniform) break;
      if (plan_ms(k, uniform) <= time_left_ms) {
        pick = k;
        break;
      }
    }
    // Recompute is exact: it replaces the level chosen whenever it finishes sooner.
    if (may_recompute && plan_ms(kRecompute, uniform) < plan_ms(pick, uniform)) pick = kRecompute;
    return {pick, true};
  }
  // Nothing fits: whatever finishes soonest, for this chunk and (as planned now) the rest.
  std::vector<int> options = order;
  if (may_recompute) options.push_back(kRecompute);
  int rest = options.front();
  for (const int k : options)
    if (plan_ms(k, k) < plan_ms(rest, rest)) rest = k;
  int pick = options.front();
  for (const int k : options)
    if (plan_ms(k, rest) < plan_ms(pick, rest)) pick = k;
  return {pick, false};
}

}  // namespace

int choose_level(std::span<const ChunkDirectory> dirs, int first, std::optional<double> time_left_ms, const PlanCosts& c,
                 const PlanStart& start) {
  if (!time_left_ms) {  // the best quality, or recompute when that finishes sooner
    const int best = quality_order(dirs[static_cast<std::size_t>(first)]).front();
    if (!c.recompute_ms) return best;
    return next_then_rest_ms(dirs, first, kRecompute, best, c, start) < next_then_rest_ms(dirs, first, best, best, c, start) ? kRecompute
                                                                                                                             : best;
  }
  if (!c.guard_bytes_per_ms || !(*c.guard_bytes_per_ms < c.link_bytes_per_ms)) return choose_under(dirs, first, *time_left_ms, c, start).pick;
  // Every fetch left at the guard rate (a known drop below it still counts).
  PlanCosts guarded = c;
  guarded.link_bytes_per_ms = *c.guard_bytes_per_ms;
  if (guarded.link_after_bytes_per_ms)
    guarded.link_after_bytes_per_ms = std::min(*guarded.link_after_bytes_per_ms, *c.guard_bytes_per_ms);
  const Choice g = choose_under(dirs, first, *time_left_ms, guarded, start);
  if (g.fits || g.pick != kRecompute) return g.pick;
  // Nothing fits at the guard rate and recompute finishes soonest there: only if it also does at the
  // measured rate (else the fetch that finishes soonest at the guard rate).
  PlanCosts fetch_only = guarded;
  fetch_only.recompute_ms.reset();
  const int fetch = choose_under(dirs, first, *time_left_ms, fetch_only, start).pick;
  const Choice m = choose_under(dirs, first, *time_left_ms, c, start);
  return m.pick == kRecompute ? kRecompute : fetch;
}

std::optional<LoadCostTable::Cost> LoadCostTable::get(const std::string& level, const std::string& shape) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = costs_.find({level, shape});
  if (it == costs_.end()) return std::nullopt;
  return it->second;
}

void LoadCostTable::record(const std::string& level, const std::string& shape, double decode_ms, double feed_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  Cost& c = costs_[{level, shape}];
  if (c.samples == 0) {
    c.decode_ms = decode_ms;
    c.feed_ms = feed_ms;
  } else {
    c.decode_ms = 0.5 * (c.decode_ms + decode_ms);
    c.feed_ms = 0.5 * (c.feed_ms + feed_ms);
  }
  ++c.samples;
}

void LoadCostTable::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  costs_.clear();
}

std::string cost_shape_key(std::size_t layers, std::int64_t kv_heads, std::int64_t chunk_tokens, std::int64_t head_dim) {
  return fmt::format("{}x{}x{}x{}", layers, kv_heads, chunk_tokens, head_dim);
}

LoadCostTable& process_load_costs() {
  static LoadCostTable table;
  return table;
}

}  // namespace vq
