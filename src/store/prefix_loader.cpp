// The prefix loader (store/prefix_loader.hpp): directory walk, per-chunk level choice under a
// deadline, a fetch thread overlapping decoder threads (chunks fed in order), faults turned into warnings.
#include "veloxquant/store/prefix_loader.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/load_plan.hpp"
#include "veloxquant/store/prefix_lookup.hpp"
#include "veloxquant/vq/code_buffers.hpp"
#include "veloxquant/vq/packed_codes.hpp"
#include "veloxquant/vq/vq_cache.hpp"
#include "vq_intake.hpp"

namespace vq {

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// The link: an emulated token bucket (optional), and the throughput measured over the fetches:
// the slower of the last fetch's (CacheGen's estimate from the previous chunk, so a bandwidth drop
// shows at once) and a running average of ms per byte (a recovery shows over a few chunks), or over
// all of them while fetches are too short to time.
class Link {
 public:
  explicit Link(const LoaderOptions& o) : o_(o) {}
  // Bytes per millisecond expected for the next fetch.
  double bytes_per_ms() const {
    if (last_ms_ > 0.5 && last_bytes_ > 0) return 1.0 / std::max(last_ms_ / static_cast<double>(last_bytes_), avg_ms_per_byte_);
    if (ms_ > 0.5 && bytes_ > 0) return static_cast<double>(bytes_) / ms_;
    if (o_.bandwidth_mbps) return rate_now() / 1000.0;
    return 125e6 / 1000.0;  // prior: 1 Gbps
  }
  // Called by the fetch thread when a fetch of `bytes` that began at `start` finished: waits out
  // the emulated link, records the throughput, returns the fetch's duration in ms.
  double finish(std::uint64_t bytes, Clock::time_point start) {
    if (o_.bandwidth_mbps) {
      const double seconds = static_cast<double>(bytes) / rate_now();
      const auto begin = std::max(start, free_at_);
      const auto end = begin + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
      std::this_thread::sleep_until(end);
      free_at_ = std::max(Clock::now(), end);
    }
    sent_ += bytes;
    const double ms = ms_since(start);
    bytes_ += bytes;
    ms_ += ms;
    last_bytes_ = bytes;
    last_ms_ = ms;
    if (bytes > 0 && ms > 0.5) {
      const double per_byte = ms / static_cast<double>(bytes);
      avg_ms_per_byte_ = avg_ms_per_byte_ > 0 ? 0.5 * (avg_ms_per_byte_ + per_byte) : per_byte;
    }
    return ms;
  }

 private:
  double rate_now() const {  // bytes per second of the emulated link now
    const double mbps = o_.bandwidth_after_mbps && sent_ >= o_.drop_after_bytes ? *o_.bandwidth_after_mbps : *o_.bandwidth_mbps;
    return mbps * 1e6 / 8.0;
  }
  const LoaderOptions& o_;
  Clock::time_point free_at_{};
  std::uint64_t sent_ = 0, bytes_ = 0, last_bytes_ = 0;
  double ms_ = 0, last_ms_ = 0, avg_ms_per_byte_ = 0;
};

// One chunk between its level choice and its feeding: fetched, then decoded (or failed).
struct InFlight {
  int choice = -1;                // index of the level in the chunk's directory; -1: recompute
  std::optional<Blob> blob;       // fetched, waiting for a decoder
  std::optional<ChunkCodes> kv;   // decoded and checked (vq layers as codes for a code-domain host)
  std::vector<std::optional<VqPackedCodes>> packed;  // per layer: its vq codes packed at the host's layout (their arrays given back)
  std::string error;              // the fault that stops the load at this chunk
  bool rejected = false;          // the error is the blob's own (it does not decode, or is not this chunk's)
  std::uint64_t bytes = 0;
  double fetch_ms = 0, decode_ms = 0;
  bool ready = false;             // kv, error or a recompute choice is set
  std::string reason;             // why the choice (LoadedChunk::reason)
};
// Where the plan for chunk i starts: the chunks already chosen and not fed yet (fed .. i-1), decoded
// ones waiting to be fed, the others taking a decoder for their whole decode (conservative: it may
// have begun).
PlanStart plan_start(const std::vector<InFlight>& flight, const std::vector<ChunkDirectory>& dirs, int fed, int i, const PlanCosts& pc,
                     int threads) {
  PlanStart start;
  start.decoder_free_ms.assign(static_cast<std::size_t>(threads), 0.0);
  const auto cost = [](const std::map<std::string, double>& m, const std::string& l, double otherwise) {
    const auto it = m.find(l);
    return it != m.end() ? it->second : otherwise;
  };
  for (int j = fed; j < i; ++j) {
    const InFlight& f = flight[static_cast<std::size_t>(j)];
    if (f.choice < 0) {
      start.feed_free_ms += pc.recompute_ms.value_or(0.0);
    } else {
      const std::string& l = dirs[static_cast<std::size_t>(j)].entries[static_cast<std::size_t>(f.choice)].level;
      if (!f.ready) {
        auto d = std::min_element(start.decoder_free_ms.begin(), start.decoder_free_ms.end());
        *d += cost(pc.decode_ms, l, pc.unknown_decode_ms);
        start.feed_free_ms = std::max(start.feed_free_ms, *d);
      }
      start.feed_free_ms += cost(pc.feed_ms, l, 0.0);
    }
    start.fed_at_ms.push_back(start.feed_free_ms);
  }
  return start;
}

// Both overloads: `model` null means no recompute and no model layer transforms for vq levels.
LoadReport load(KVStore& store, Transformer* model, const ChunkShape& shape, std::vector<std::shared_ptr<KVCache>>& caches,
                std::span<const int> tokens, const LoaderOptions& o, const std::function<void(const std::string&)>& warn_fn) {
  const auto t0 = Clock::now();
  const ChunkScheme& scheme = o.scheme;
  require(scheme.chunk_tokens >= 0, "chunk tokens must be >= 0 (0: every size stored), got {}", scheme.chunk_tokens);
  require(o.slo_guard > 0.0 && o.slo_guard <= 1.0, "the deadline's guard must be a fraction of the link in (0, 1], got {}", o.slo_guard);
  for (const auto& c : caches) require(c && c->offset() == 0, "load_prefix needs empty caches");
  require(!o.level || scheme.levels.empty() || std::find(scheme.levels.begin(), scheme.levels.end(), *o.level) != scheme.levels.end(),
          "level '{}' is not one of the levels asked for", o.level.value_or(""));
  LoadReport rep;
  const char* const rest = model ? "recomputing" : "left to the caller";  // what happens to the chunk at fault
  const auto warn = [&](std::string msg) {
    if (warn_fn) warn_fn(msg);
    rep.warnings.push_back(std::move(msg));
  };

  // With a deadline, no store call waits past it (the lookup's directory fetches included): a
  // stalled store costs the deadline, then a recompute. Reset when the load ends, however it ends.
  struct Deadline {
    KVStore& store;
    bool set = false;
    ~Deadline() {
      if (set) store.set_deadline(std::nullopt);
    }
  } deadline{store};
  if (o.slo_ms) {
    store.set_deadline(t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(*o.slo_ms)));
    deadline.set = true;
  }

  // The stored prefix, its chunk size and levels found in the store (store/prefix_lookup.hpp); a
  // forced level narrows the levels to itself.
  PrefixLookup found = lookup_prefix(store, scheme.model_fingerprint, scheme.chunk_tokens,
                                     o.level ? std::vector<std::string>{*o.level} : scheme.levels, tokens);
  rep.chunk_tokens = found.chunk_tokens;
  rep.end = found.end;
  // A fault at chunk 0 is the load's first word; one after a usable prefix is said at the end,
  // unless loading that prefix faulted first (the chunk at fault is the one to name).
  std::string lookup_fault;
  if (!found.fault.empty()) lookup_fault = fmt::format("chunk {}: {}; {}", found.end->index, found.fault, rest);
  if (!lookup_fault.empty() && found.dirs.empty()) warn(std::exchange(lookup_fault, std::string()));
  const std::vector<ChunkDirectory>& dirs = found.dirs;
  const auto C = static_cast<std::size_t>(std::max(1, found.chunk_tokens));
  const auto chunk_tokens = [&](int i) { return tokens.subspan(static_cast<std::size_t>(i) * C, C); };
  rep.chunks_stored = static_cast<int>(dirs.size());
  const int n = rep.chunks_stored;
  // Host caches reserve the whole stored prefix at once: no row copied twice on the way (dense
  // hosts), the code-domain hosts' packed rows in huge pages.
  for (const auto& c : caches) c->expect_tokens(static_cast<std::int64_t>(n) * static_cast<std::int64_t>(C));

  // Costs per (level, chunk shape): the process's table unless the caller gives one.
  LoadCostTable& costs = o.costs ? *o.costs : process_load_costs();
  const std::string shape_key = cost_shape_key(caches.size(), shape.kv_heads, static_cast<std::int64_t>(C), shape.head_dim);
  // Recompute cost per token: measured recomputes of this shape, else a short forward on scratch caches.
  double recompute_ms_per_token = 0;
  // Without a model (or with a forced level, or recompute disallowed) recomputing is never chosen.
  const bool may_recompute = model != nullptr && !o.level && o.allow_recompute;
  if (n > 0 && model && o.allow_recompute) {
    if (const auto known = costs.get("recompute", shape_key)) {
      recompute_ms_per_token = known->decode_ms / static_cast<double>(C);
    } else {
      auto scratch = make_caches("fp32", *model);
      const std::size_t probe = std::min<std::size_t>(C, 16);
      const auto tp = Clock::now();
      model->forward(tokens.first(probe), scratch);
      recompute_ms_per_token = ms_since(tp) / static_cast<double>(probe);
      costs.record("recompute", shape_key, recompute_ms_per_token * static_cast<double>(C), 0.0);  // once per process
    }
  }
  rep.prefill_ms_estimate = recompute_ms_per_token * static_cast<double>(static_cast<std::size_t>(n) * C);

  const int threads = std::max(1, std::min(n, o.threads > 0 ? o.threads : static_cast<int>(std::thread::hardware_concurrency())));
  Link link(o);  // used by the fetch thread only (and by the probes below, before it starts)
  // vq levels' layer models, built once per load at most (none without a model: only data-derived
  // transforms decode)
  const VqLayerModelSource vq_models = o.vq_models ? o.vq_models : model ? chunk_vq_models(*model) : VqLayerModelSource{};
  // Code-domain host (with a model): every cache a VqKVCache with the model's layer. A vq chunk then
  // comes as codes and enters the host through the intake (vq_intake.hpp); every other chunk's
  // rows go through update().
  const std::unique_ptr<VqIntake> intake = model ? VqIntake::for_caches(caches) : nullptr;
  const bool code_host = intake != nullptr;
  // `key`: the blob's key, which the lookup checked is this prompt's chain key for the level (so
  // its hash is the chain hash the blob must carry).
  const auto decode = [&](const Blob& blob, const std::string& level, const std::string& key, int i) -> ChunkCodes {
    const auto chain = chunk_key_hash(key);
    if (!chain) throw FormatError(fmt::format("'{}' is not a chunk key", key));
    if (intake && VqIntake::decodes(level))
      return intake->decode(blob, scheme.model_fingerprint, level, i, *chain, chunk_tokens(i), vq_models);
    return ChunkCodes{decode_chunk(blob, scheme.model_fingerprint, level, i, *chain, chunk_tokens(i), vq_models), {}};
  };

  // Probes: with a deadline, a level whose decode cost this process has not measured for this shape
  // is measured now, by fetching and decoding chunk 0 at that level (over the link, in load_ms).
  // A probe that fails records nothing: the fault, if real, shows when the chunk is loaded.
  if (n > 0 && o.slo_ms && !o.level) {
    const auto& entries = dirs[0].entries;
    for (const auto& e : entries) {
      if (costs.get(e.level, shape_key)) continue;
      try {
        const auto t = Clock::now();
        const auto blob = store.get_immutable_at_most(e.key, e.bytes);  // the size its directory records
        link.finish(blob ? blob->size() : 0, t);
        if (!blob) continue;
        const auto td = Clock::now();
        const ChunkCodes kv = decode(*blob, e.level, e.key, 0);
        costs.record(e.level, shape_key, ms_since(td), 0.0);
      } catch (const std::exception&) {
      }
    }
  }
  // Shared between the calling thread (feeds chunks in order, measures decode and recompute), the
  // fetch thread (chooses levels, fetches) and the decoder threads; all of it under `mu`.
  std::mutex mu;
  std::condition_variable cv;
  // Decode cost of a chunk at a level the cost table does not know (no deadline, or a failed probe):
  // the slowest level it knows, or 1 GB/s of fp16 output. (Per chunk, not per blob byte: decode
  // time follows the K/V it outputs, and a 2-bit blob outputs 8x more per byte.)
  const double default_decode_ms = 2.0 * 2.0 * static_cast<double>(caches.size()) * static_cast<double>(shape.kv_heads * shape.head_dim) *
                                   static_cast<double>(C) / 1e6;
  int fed = 0;                       // chunks fed to the caches so far
  bool stop = false;                 // the calling thread is done (fault or end): threads leave
  std::vector<InFlight> flight(static_cast<std::size_t>(n));
  std::deque<int> decode_queue;      // fetched chunks waiting for a decoder, in chunk order

  const auto choose = [&](int i) -> int {  // index into the directory's entries, or -1: recompute. Holds mu.
    const auto& e = dirs[static_cast<std::size_t>(i)].entries;
    if (o.level)
      for (std::size_t k = 0; k < e.size(); ++k)
        if (e[k].level == *o.level) return static_cast<int>(k);
    PlanCosts pc;
    pc.link_bytes_per_ms = link.bytes_per_ms();
    if (o.slo_guard < 1.0) pc.guard_bytes_per_ms = pc.link_bytes_per_ms * o.slo_guard;
    pc.threads = threads;
    pc.unknown_decode_ms = 0;
    for (const auto& entry : e)
      if (const auto c = costs.get(entry.level, shape_key)) {
        pc.decode_ms[entry.level] = c->decode_ms;
        pc.feed_ms[entry.level] = c->feed_ms;
        pc.unknown_decode_ms = std::max(pc.unknown_decode_ms, c->decode_ms);
      }
    if (pc.decode_ms.empty()) pc.unknown_decode_ms = default_decode_ms;
    if (may_recompute) pc.recompute_ms = recompute_ms_per_token * static_cast<double>(C);
    const PlanStart start = plan_start(flight, dirs, fed, i, pc, threads);
    std::optional<double> time_left;
    if (o.slo_ms) time_left = (*o.slo_ms - ms_since(t0)) * (1.0 - o.slo_margin);
    return choose_level(std::span<const ChunkDirectory>(dirs).subspan(static_cast<std::size_t>(i)), 0, time_left, pc, start);
  };

  // The fetch thread: chunk after chunk, at most `ahead` ahead of the chunks fed; a fetched blob
  // goes to the decoders, a failed fetch ends fetching (the load stops at that chunk). `threads`
  // ahead, except into code-domain hosts without a deadline or recompute: there the level does not
  // depend on when it is chosen (the best one), a decoded chunk is small (packed codes), and the
  // decoders keep going while the calling thread feeds a chunk (4 x threads: feeding is ~30 % of a
  // chunk's work there, and the cores it shares with the decoders sat idle whenever it fell behind).
  const int ahead = code_host && !o.slo_ms && !may_recompute ? 4 * threads : threads;
  const auto fetch_loop = [&] {
    for (int i = 0; i < n; ++i) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stop || i <= fed + ahead; });
      if (stop) return;
      const int choice = choose(i);
      InFlight& f = flight[static_cast<std::size_t>(i)];
      f.choice = choice;
      f.reason = o.level ? "forced level"
                 : choice < 0 ? "plan: recomputing is predicted sooner than fetching"
                 : choice == quality_order(dirs[static_cast<std::size_t>(i)]).front()
                     ? (o.slo_ms ? "plan: the best level stored, within the deadline" : "plan: the best level stored")
                     : "plan: a smaller level, to meet the deadline (or come nearest it)";
      if (choice < 0) {  // recomputed by the calling thread
        f.ready = true;
        cv.notify_all();
        continue;
      }
      const std::string key = dirs[static_cast<std::size_t>(i)].entries[static_cast<std::size_t>(choice)].key;
      const std::uint64_t recorded = dirs[static_cast<std::size_t>(i)].entries[static_cast<std::size_t>(choice)].bytes;
      lock.unlock();
      std::optional<Blob> blob;
      std::string error;
      bool rejected = false;
      const auto t = Clock::now();
      try {
        blob = store.get_immutable_at_most(key, recorded);  // never more than its directory says it holds (a tier may serve it)
        if (!blob) error = fmt::format("blob '{}' missing", key), rejected = true;  // evicted or removed: its entry goes too
      } catch (const FormatError& e) {  // the blob's own fault: too large, fails its MAC, not ours
        error = fmt::format("blob rejected ({})", e.what());
        rejected = true;
      } catch (const std::exception& e) {  // IoError, or a forged size's bad_alloc
        error = fmt::format("store {} failed ({})", store.describe(), e.what());
      }
      const double fetch_ms = link.finish(blob ? blob->size() : 0, t);
      lock.lock();
      f.fetch_ms = fetch_ms;
      if (!blob) {
        f.error = std::move(error);
        f.rejected = rejected;
        f.ready = true;
        cv.notify_all();
        return;
      }
      f.blob = std::move(blob);
      decode_queue.push_back(i);
      cv.notify_all();
    }
  };

  // A decoder thread: decode and check fetched chunks (any order of completion; fed in order later).
  const Shape4 want{1, shape.kv_heads, static_cast<std::int64_t>(C), shape.head_dim};
  const auto decode_loop = [&] {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || !decode_queue.empty(); });
      if (stop) return;
      const int i = decode_queue.front();
      decode_queue.pop_front();
      InFlight& f = flight[static_cast<std::size_t>(i)];
      const auto& entry = dirs[static_cast<std::size_t>(i)].entries[static_cast<std::size_t>(f.choice)];
      const std::string level = entry.level, key = entry.key;
      const Blob blob = std::move(*f.blob);
      const int f_choice = f.choice;
      f.bytes = blob.size();
      f.blob.reset();
      lock.unlock();
      const auto td = Clock::now();
      ChunkCodes kv;
      std::vector<std::optional<VqPackedCodes>> packed;
      std::string error;
      bool rejected = false;
      try {
        kv = decode(blob, level, key, i);
        if (kv.kv.size() != caches.size()) throw FormatError(fmt::format("{} layers, the model has {}", kv.kv.size(), caches.size()));
        for (std::size_t l = 0; l < kv.kv.size(); ++l) {
          if (l < kv.vq.size() && kv.vq[l]) {
            const VqLayerCodes& c = kv.vq[l]->codes;
            if (c.batch != 1 || c.k.n != shape.kv_heads * shape.head_dim || c.v.n != shape.kv_heads * shape.head_dim)
              throw FormatError(fmt::format("vq codes of batch {} and widths {}/{}, the model's chunk is {}", c.batch, c.k.n, c.v.n,
                                            shape_string(want)));
            continue;
          }
          if (kv.kv[l].keys.shape() != want || kv.kv[l].values.shape() != want)
            throw FormatError(
                fmt::format("K/V of shape {}, the model's chunk is {}", shape_string(kv.kv[l].keys.shape()), shape_string(want)));
        }
        // A code host's layers packed here, while their codes are in this thread's cache.
        if (intake) packed = intake->pack(kv, f_choice, dirs.back().entries[static_cast<std::size_t>(f_choice)].widths);
      } catch (const std::exception& e) {
        error = fmt::format("level {} blob rejected ({})", level, e.what());
        rejected = true;
        kv = {};
        packed.clear();
      }
      const double decode_ms = ms_since(td);
      lock.lock();
      f.decode_ms = decode_ms;
      if (error.empty()) f.kv = std::move(kv), f.packed = std::move(packed);
      else f.error = std::move(error), f.rejected = rejected;
      f.ready = true;
      cv.notify_all();
    }
  };

  std::vector<std::thread> workers;
  // Whatever happens on this thread (a fault, or an exception from the model or a cache), the
  // threads are told to stop and joined before the locals they use go away.
  struct Joiner {
    std::mutex& mu;
    std::condition_variable& cv;
    bool& stop;
    std::vector<std::thread>& workers;
    ~Joiner() {
      {
        std::lock_guard<std::mutex> lock(mu);
        stop = true;
      }
      cv.notify_all();
      for (auto& t : workers) t.join();
    }
  } joiner{mu, cv, stop, workers};
  if (n > 0) {
    workers.emplace_back(fetch_loop);
    for (int t = 0; t < threads; ++t) workers.emplace_back(decode_loop);
  }

  // Feed the chunks in order.
  for (int i = 0; i < n; ++i) {
    InFlight f;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return flight[static_cast<std::size_t>(i)].ready; });
      f = std::move(flight[static_cast<std::size_t>(i)]);
    }
    if (!f.error.empty()) {
      std::string repair;
      if (f.rejected && o.repair) {
        // A blob that is not this chunk's leaves the store with its directory entry, so the next put
        // of this prefix stores it again (without this, a put finds it listed and skips it forever).
        const auto& key = dirs[static_cast<std::size_t>(i)].entries[static_cast<std::size_t>(f.choice)].key;
        std::uint64_t dh = 0;
        for (int k = 0; k <= i; ++k) dh = directory_hash(dh, found.chunk_tokens, chunk_tokens(k));
        try {
          forget_chunk(store, directory_key(dh), key);
          repair = " (removed from the store: the next put stores it again)";
        } catch (const std::exception& e) {
          repair = fmt::format(" (could not remove it: {})", e.what());
        }
      }
      warn(fmt::format("chunk {}: {}{}; {}", i, f.error, repair, rest));
      rep.end = PrefixEnd{i, "fault", found.stored_levels[static_cast<std::size_t>(i)], f.error, true};
      break;  // nothing of this chunk was fed; the joiner stops the threads
    }
    LoadedChunk rc;
    rc.index = i;
    const auto tf = Clock::now();
    if (f.choice >= 0) {
      ChunkCodes& got = *f.kv;
      for (std::size_t l = 0; l < caches.size(); ++l) {
        if (l < got.vq.size() && got.vq[l]) {
          VqStoredLayer& v = *got.vq[l];
          std::optional<VqPackedCodes>* p = l < f.packed.size() && f.packed[l] ? &f.packed[l] : nullptr;
          if (intake && intake->feed(l, v, p)) continue;
          // Not this host's calibration or level: the rows, re-quantized by the host's update().
          const ChunkLayer rows = vq_chunk_rows(v, got.first_position);
          caches[l]->update(rows.keys, rows.values);
          continue;
        }
        caches[l]->update(got.kv[l].keys, got.kv[l].values);
      }
      rc.level = dirs[static_cast<std::size_t>(i)].entries[static_cast<std::size_t>(f.choice)].level;
      rc.bytes = f.bytes;
      rc.fetch_ms = f.fetch_ms;
      const double feed_ms = ms_since(tf);
      rc.decode_ms = f.decode_ms + feed_ms;  // decode on its thread, then the update
      costs.record(rc.level, shape_key, f.decode_ms, feed_ms);
    } else {
      model->forward(chunk_tokens(i), caches);  // choose() returns -1 only with a model
      rc.level = "recompute";
      rc.decode_ms = ms_since(tf);
      costs.record("recompute", shape_key, rc.decode_ms, 0.0);
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      if (f.choice < 0) recompute_ms_per_token = rc.decode_ms / static_cast<double>(C);
      fed = i + 1;
    }
    cv.notify_all();
    rc.reason = f.reason;
    rc.levels = found.stored_levels[static_cast<std::size_t>(i)];
    rep.chunks.push_back(rc);
    rep.tokens_filled += static_cast<int>(C);
    if (f.choice >= 0) rep.tokens_reused += static_cast<int>(C);
  }
  // Recency for stores that evict: the chunks used, first chunk newest (KVStore::mark_used).
  if (!rep.chunks.empty()) {
    std::vector<std::string> used;
    std::uint64_t dh = 0;
    for (const LoadedChunk& lc : rep.chunks) {
      dh = directory_hash(dh, found.chunk_tokens, chunk_tokens(lc.index));
      for (const auto& e : dirs[static_cast<std::size_t>(lc.index)].entries)
        if (e.level == lc.level) used.push_back(e.key);
      used.push_back(directory_key(dh));
    }
    try {
      store.mark_used(used);
    } catch (const std::exception&) {  // a hint only
    }
  }
  if (!lookup_fault.empty() && rep.warnings.empty()) warn(lookup_fault);
  // A stored prefix that was not (all) used says why, in one line.
  const auto recomputed = std::count_if(rep.chunks.begin(), rep.chunks.end(), [](const LoadedChunk& c) { return c.level == "recompute"; });
  std::vector<std::string> unused;
  if (recomputed > 0)
    unused.push_back(fmt::format("{} of the {} stored chunks recomputed: the plan predicted recomputing them sooner than fetching them "
                                 "(a load without recompute takes them all)", recomputed, n));
  if (rep.end && rep.end->status == "miss" && rep.end->stored)
    unused.push_back(fmt::format("chunk {} {}", rep.end->index, rep.end->reason));
  for (const auto& u : unused) rep.not_used += (rep.not_used.empty() ? "" : "; ") + u;
  rep.load_ms = ms_since(t0);
  return rep;
}
}  // namespace

LoadReport load_prefix(KVStore& store, Transformer& model, std::vector<std::shared_ptr<KVCache>>& caches, std::span<const int> tokens,
                       const LoaderOptions& options, const std::function<void(const std::string&)>& warn) {
  const auto& mc = model.config();
  return load(store, &model, ChunkShape{mc.n_kv_heads, mc.head_size()}, caches, tokens, options, warn);
}

LoadReport load_prefix(KVStore& store, const ChunkShape& shape, std::vector<std::shared_ptr<KVCache>>& caches, std::span<const int> tokens,
                       const LoaderOptions& options, const std::function<void(const std::string&)>& warn) {
  require(shape.kv_heads >= 1 && shape.head_dim >= 1, "load_prefix: chunk shape needs kv_heads and head_dim >= 1, got {} and {}",
          shape.kv_heads, shape.head_dim);
  return load(store, nullptr, shape, caches, tokens, options, warn);
}

std::string load_report_json(const LoadReport& r) {
  nlohmann::json chunks = nlohmann::json::array();
  for (const auto& c : r.chunks)
    chunks.push_back({{"index", c.index}, {"status", "hit"}, {"levels", c.levels}, {"level", c.level}, {"reason", c.reason},
                      {"bytes", c.bytes}, {"fetch_ms", c.fetch_ms}, {"decode_ms", c.decode_ms}});
  nlohmann::json miss = nullptr;
  if (r.end) miss = {{"index", r.end->index}, {"status", r.end->status}, {"levels", r.end->levels}, {"reason", r.end->reason}};
  return nlohmann::json{{"tokens_reused", r.tokens_reused}, {"tokens_filled", r.tokens_filled}, {"chunk_tokens", r.chunk_tokens},
                        {"load_ms", r.load_ms}, {"prefill_ms_estimate", r.prefill_ms_estimate}, {"chunks", chunks}, {"miss", miss},
                        {"not_used", r.not_used}, {"warnings", r.warnings}}
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace vq
