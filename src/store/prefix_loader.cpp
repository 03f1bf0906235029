// The prefix loader (store/prefix_loader.hpp): directory walk, per-chunk level choice under a
// deadline, fetch of chunk i+1 overlapping decode of chunk i, faults turned into warnings.
#include "veloxquant/store/prefix_loader.hpp"

#include <algorithm>
#include <chrono>
#include <future>
#include <thread>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/model/method_spec.hpp"
#include "veloxquant/model/transformer.hpp"

namespace vq {

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// The link: an emulated token bucket (optional), and the throughput measured over every fetch.
class Link {
 public:
  explicit Link(const LoaderOptions& o) : o_(o) {}
  // Bytes per millisecond expected for the next fetch.
  double bytes_per_ms() const {
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
    return ms;
  }

 private:
  double rate_now() const {  // bytes per second of the emulated link now
    const double mbps = o_.bandwidth_after_mbps && sent_ >= o_.drop_after_bytes ? *o_.bandwidth_after_mbps : *o_.bandwidth_mbps;
    return mbps * 1e6 / 8.0;
  }
  const LoaderOptions& o_;
  Clock::time_point free_at_{};
  std::uint64_t sent_ = 0, bytes_ = 0;
  double ms_ = 0;
};

struct Fetched {
  std::optional<Blob> blob;
  std::string error;
  double fetch_ms = 0;
};

// Both overloads: `model` null means no recompute and no model layer transforms for vq levels.
LoadReport load(KVStore& store, Transformer* model, const ChunkShape& shape, std::vector<std::shared_ptr<KVCache>>& caches,
                std::span<const int> tokens, const LoaderOptions& o, const std::function<void(const std::string&)>& warn_fn) {
  const auto t0 = Clock::now();
  const ChunkScheme& scheme = o.scheme;
  require(scheme.chunk_tokens >= 1, "chunk tokens must be >= 1, got {}", scheme.chunk_tokens);
  for (const auto& c : caches) require(c && c->offset() == 0, "load_prefix needs empty caches");
  require(!o.level || std::find(scheme.levels.begin(), scheme.levels.end(), *o.level) != scheme.levels.end(),
          "level '{}' is not one of the stored levels", o.level.value_or(""));
  const auto C = static_cast<std::size_t>(scheme.chunk_tokens);
  LoadReport rep;
  const char* const rest = model ? "recomputing" : "left to the caller";  // what happens to the chunk at fault
  const auto warn = [&](std::string msg) {
    if (warn_fn) warn_fn(msg);
    rep.warnings.push_back(std::move(msg));
  };
  const int max_chunks = tokens.empty() ? 0 : static_cast<int>((tokens.size() - 1) / C);
  const auto chunk_tokens = [&](int i) { return tokens.subspan(static_cast<std::size_t>(i) * C, C); };

  // The stored prefix: every directory key in one pipelined get.
  std::vector<std::string> dkeys;
  std::vector<std::vector<std::string>> level_keys;  // expected key of each level per chunk
  std::uint64_t dprev = 0;
  std::vector<std::uint64_t> lprev(scheme.levels.size(), 0);
  for (int i = 0; i < max_chunks; ++i) {
    dprev = directory_hash(dprev, scheme, chunk_tokens(i));
    dkeys.push_back(directory_key(dprev));
    std::vector<std::string> ks;
    for (std::size_t l = 0; l < scheme.levels.size(); ++l) {
      lprev[l] = chain_hash(lprev[l], scheme.model_fingerprint, scheme.levels[l], chunk_tokens(i));
      ks.push_back(chunk_key(scheme.levels[l], lprev[l]));
    }
    level_keys.push_back(std::move(ks));
  }
  std::vector<ChunkDirectory> dirs;
  if (max_chunks > 0) {
    std::vector<std::optional<Blob>> got;
    try {
      got = store.get_many(dkeys);
    } catch (const std::exception& e) {
      warn(fmt::format("chunk 0: store {} failed ({}); {}", store.describe(), e.what(), rest));
    }
    for (int i = 0; i < static_cast<int>(got.size()) && got[static_cast<std::size_t>(i)]; ++i) {
      try {
        ChunkDirectory d = decode_directory(*got[static_cast<std::size_t>(i)]);
        bool ok = d.entries.size() == scheme.levels.size();
        for (std::size_t l = 0; ok && l < d.entries.size(); ++l)
          ok = d.entries[l].level == scheme.levels[l] && d.entries[l].key == level_keys[static_cast<std::size_t>(i)][l];
        if (!ok) throw FormatError("its levels or keys are not those of this model, method list and token sequence");
        dirs.push_back(std::move(d));
      } catch (const FormatError& e) {
        warn(fmt::format("chunk {}: corrupt directory blob ({}); {}", i, e.what(), rest));
        break;
      }
    }
  }
  rep.chunks_stored = static_cast<int>(dirs.size());
  const int n = rep.chunks_stored;

  // Recompute cost per token: a short forward on scratch caches, refined by real recomputes.
  // Without a model (or with a forced level) recomputing is never chosen.
  const bool may_recompute = model != nullptr && !o.level;
  double recompute_ms_per_token = 0;
  if (n > 0 && may_recompute) {
    auto scratch = make_caches("fp32", *model);
    const std::size_t probe = std::min<std::size_t>(C, 16);
    const auto tp = Clock::now();
    model->forward(tokens.first(probe), scratch);
    recompute_ms_per_token = ms_since(tp) / static_cast<double>(probe);
  }
  rep.prefill_ms_estimate = recompute_ms_per_token * static_cast<double>(static_cast<std::size_t>(n) * C);

  Link link(o);
  double decode_ms_per_byte = 1e-6;  // prior: 1 GB/s
  const auto choose = [&](int i) -> int {  // index into the directory's entries, or -1: recompute
    const auto& e = dirs[static_cast<std::size_t>(i)].entries;
    std::vector<int> order(e.size());
    for (std::size_t k = 0; k < e.size(); ++k) order[k] = static_cast<int>(k);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      const bool fa = e[static_cast<std::size_t>(a)].level == "fp32", fb = e[static_cast<std::size_t>(b)].level == "fp32";
      if (fa != fb) return fa;
      return e[static_cast<std::size_t>(a)].bytes > e[static_cast<std::size_t>(b)].bytes;
    });
    const auto est = [&](int k) {
      const double b = static_cast<double>(e[static_cast<std::size_t>(k)].bytes);
      return b / link.bytes_per_ms() + b * decode_ms_per_byte;
    };
    if (o.level)
      for (std::size_t k = 0; k < e.size(); ++k)
        if (e[k].level == *o.level) return static_cast<int>(k);
    int pick = order.front();
    if (o.slo_ms) {
      const double per_chunk = (*o.slo_ms - ms_since(t0)) / static_cast<double>(n - i);
      pick = order.back();
      for (const int k : order)
        if (est(k) <= per_chunk) {
          pick = k;
          break;
        }
    }
    if (may_recompute && recompute_ms_per_token * static_cast<double>(C) < est(pick)) return -1;
    return pick;
  };
  const auto start_fetch = [&](int i, int k) {
    const std::string key = dirs[static_cast<std::size_t>(i)].entries[static_cast<std::size_t>(k)].key;
    return std::async(std::launch::async, [&store, &link, key] {
      Fetched f;
      const auto t = Clock::now();
      try {
        f.blob = store.get(key);
        if (!f.blob) f.error = fmt::format("blob '{}' missing", key);
      } catch (const std::exception& e) {  // IoError, FormatError, or a forged size's bad_alloc
        f.error = fmt::format("store {} failed ({})", store.describe(), e.what());
      }
      f.fetch_ms = link.finish(f.blob ? f.blob->size() : 0, t);
      return f;
    });
  };

  // vq levels' layer models, built once (none without a model: only data-derived transforms decode)
  const VqLayerModelSource vq_models = model ? chunk_vq_models(*model) : VqLayerModelSource{};
  const Shape4 want{1, shape.kv_heads, static_cast<std::int64_t>(C), shape.head_dim};
  int choice = n > 0 ? choose(0) : -1;
  std::future<Fetched> fut;
  if (n > 0 && choice >= 0) fut = start_fetch(0, choice);
  for (int i = 0; i < n; ++i) {
    LoadedChunk rc;
    rc.index = i;
    std::optional<Fetched> f;
    if (choice >= 0) {
      f = fut.get();
      if (!f->blob) {
        warn(fmt::format("chunk {}: {}; {}", i, f->error, rest));
        break;
      }
    }
    // Start the next fetch now: it overlaps this chunk's decode.
    int next_choice = -1;
    std::future<Fetched> next;
    if (i + 1 < n) {
      next_choice = choose(i + 1);
      if (next_choice >= 0) next = start_fetch(i + 1, next_choice);
    }
    const auto td = Clock::now();
    if (choice >= 0) {
      const auto& entry = dirs[static_cast<std::size_t>(i)].entries[static_cast<std::size_t>(choice)];
      ChunkKV kv;
      try {
        kv = decode_chunk(*f->blob, scheme.model_fingerprint, entry.level, i, chunk_tokens(i), vq_models);
        if (kv.size() != caches.size()) throw FormatError(fmt::format("{} layers, the model has {}", kv.size(), caches.size()));
        for (const auto& l : kv)
          if (l.keys.shape() != want || l.values.shape() != want)
            throw FormatError(fmt::format("K/V of shape {}, the model's chunk is {}", shape_string(l.keys.shape()), shape_string(want)));
      } catch (const std::exception& e) {
        warn(fmt::format("chunk {}: level {} blob rejected ({}); {}", i, entry.level, e.what(), rest));
        break;  // `next` finishes in its destructor; nothing of this chunk was fed
      }
      for (std::size_t l = 0; l < caches.size(); ++l) caches[l]->update(kv[l].keys, kv[l].values);
      rc.level = entry.level;
      rc.bytes = f->blob->size();
      rc.fetch_ms = f->fetch_ms;
      rc.decode_ms = ms_since(td);
      decode_ms_per_byte = rc.decode_ms / std::max<double>(1.0, static_cast<double>(rc.bytes));
    } else {
      model->forward(chunk_tokens(i), caches);  // choose() returns -1 only with a model
      rc.level = "recompute";
      rc.decode_ms = ms_since(td);
      recompute_ms_per_token = rc.decode_ms / static_cast<double>(C);
    }
    rep.chunks.push_back(rc);
    rep.tokens_filled += static_cast<int>(C);
    if (choice >= 0) rep.tokens_reused += static_cast<int>(C);
    choice = next_choice;
    fut = std::move(next);
  }
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

}  // namespace vq
