// Prefix lookup (store/prefix_lookup.hpp): chunk sizes and levels discovered from the store, the
// longest usable prefix, and why it ends where it ends.
#include "veloxquant/store/prefix_lookup.hpp"

#include <algorithm>
#include <map>

#include <fmt/core.h>
#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

std::string list_text(const std::vector<std::string>& v) { return v.empty() ? std::string("none") : fmt::format("{}", fmt::join(v, "; ")); }

// One chunk size's walk along the prompt.
struct Walk {
  int C = 0;
  int positions = 0;   // whole chunks in the prompt: chunk positions looked at
  int usable_max = 0;  // chunks that leave a prompt token after them
  std::vector<std::string> keys;             // directory key per position
  std::vector<std::optional<Blob>> got;      // per position, until the first missing or failed one
  std::string get_fault;                     // the get that failed (one by one), at position got.size()
  // The analysis (dirs.size(): the usable chunks).
  std::vector<std::string> common;           // the levels the usable chunks share
  std::vector<ChunkDirectory> dirs;          // per usable chunk: this model's entries of `common`
  std::vector<std::vector<std::string>> stored;  // per usable chunk: every level stored for this model
  std::optional<PrefixEnd> end;
  bool found_any = false;                    // a directory at position 0
};

// The key chain of each level over this walk's chunks, built as far as asked.
class LevelKeys {
 public:
  LevelKeys(std::uint64_t fp, int C, std::span<const int> tokens) : fp_(fp), C_(static_cast<std::size_t>(C)), tokens_(tokens) {}
  const std::string& key(const std::string& level, int i) {
    auto& chain = chains_[level];
    std::uint64_t h = chain.hashes.empty() ? 0 : chain.hashes.back();
    while (static_cast<int>(chain.hashes.size()) <= i) {
      h = chain_hash(h, fp_, level, tokens_.subspan(chain.hashes.size() * C_, C_));
      chain.hashes.push_back(h);
      chain.keys.push_back(chunk_key(level, h));
    }
    return chain.keys[static_cast<std::size_t>(i)];
  }

 private:
  struct Chain {
    std::vector<std::uint64_t> hashes;
    std::vector<std::string> keys;
  };
  std::uint64_t fp_;
  std::size_t C_;
  std::span<const int> tokens_;
  std::map<std::string, Chain> chains_;
};

void analyse(Walk& w, std::uint64_t fp, const std::vector<std::string>& allowed, std::span<const int> tokens) {
  LevelKeys keys(fp, w.C, tokens);
  const auto stop = [&](int i, const char* status, std::vector<std::string> levels, std::string reason, bool stored = false) {
    w.end = PrefixEnd{i, status, std::move(levels), std::move(reason), stored};
  };
  for (int i = 0; i < w.positions; ++i) {
    const auto at = static_cast<std::size_t>(i);
    if (at >= w.got.size() || !w.got[at]) {
      if (at == w.got.size() && !w.get_fault.empty()) stop(i, "fault", {}, w.get_fault);
      else stop(i, "miss", {}, "not stored");
      return;
    }
    if (i == 0) w.found_any = true;
    ChunkDirectory d;
    try {
      d = decode_directory(*w.got[at]);
      if (d.chunk_tokens != w.C) throw FormatError(fmt::format("its chunk size is {}, its key's {}", d.chunk_tokens, w.C));
    } catch (const FormatError& e) {
      stop(i, "fault", {}, fmt::format("corrupt directory blob ({})", e.what()));
      return;
    }
    std::vector<std::string> stored;
    std::vector<const ChunkDirectory::Entry*> usable;
    std::vector<std::uint64_t> others;
    for (const auto& e : d.entries) {
      if (e.model != fp) {
        if (std::find(others.begin(), others.end(), e.model) == others.end()) others.push_back(e.model);
        continue;
      }
      if (std::find(stored.begin(), stored.end(), e.level) == stored.end()) stored.push_back(e.level);
      if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), e.level) == allowed.end()) continue;
      if (e.key != keys.key(e.level, i)) {
        stop(i, "fault", stored,
             fmt::format("corrupt directory blob (its key for level {} is not this model's, level's and token sequence's)", e.level));
        return;
      }
      usable.push_back(&e);
    }
    if (stored.empty()) {
      std::string fps;
      for (std::size_t k = 0; k < others.size() && k < 3; ++k) fps += fmt::format("{}{:016x}", k ? ", " : "", others[k]);
      if (others.size() > 3) fps += ", ...";
      stop(i, "miss", {}, others.empty() ? std::string("not stored (an empty directory)")
                                         : fmt::format("stored for another model only (fingerprint {}; this model's is {:016x})", fps, fp),
           !others.empty());
      return;
    }
    if (usable.empty()) {
      stop(i, "miss", stored, fmt::format("stored at levels {}; none is among the levels asked for ({})", list_text(stored), list_text(allowed)),
           true);
      return;
    }
    std::vector<std::string> common;
    if (i == 0) {
      for (const auto* e : usable)
        if (std::find(common.begin(), common.end(), e->level) == common.end()) common.push_back(e->level);
    } else {
      for (const auto& l : w.common)
        if (std::any_of(usable.begin(), usable.end(), [&](const auto* e) { return e->level == l; })) common.push_back(l);
    }
    if (common.empty()) {
      stop(i, "miss", stored,
           fmt::format("stored at levels {}, none of which the chunks before it hold ({})", list_text(stored), list_text(w.common)), true);
      return;
    }
    if (i >= w.usable_max) {
      stop(i, "miss", stored,
           "stored, not used: it holds the prompt's last token, which the host computes itself (its logits start the generation)", true);
      return;
    }
    w.common = std::move(common);
    ChunkDirectory kept;
    kept.chunk_tokens = w.C;
    for (const auto* e : usable) kept.entries.push_back(*e);
    w.dirs.push_back(std::move(kept));
    w.stored.push_back(std::move(stored));
  }
}

}  // namespace

PrefixLookup lookup_prefix(KVStore& store, std::uint64_t fp, int chunk_tokens, const std::vector<std::string>& levels,
                           std::span<const int> tokens) {
  require(chunk_tokens >= 0, "chunk tokens must be >= 0 (0: every size stored), got {}", chunk_tokens);
  PrefixLookup out;
  if (tokens.empty()) return out;
  const auto fault_end = [&](std::string reason) {
    out.fault = reason;
    out.end = PrefixEnd{0, "fault", {}, std::move(reason)};
    return out;
  };
  // The sizes to walk.
  std::vector<int> sizes;
  if (chunk_tokens > 0) {
    sizes.push_back(chunk_tokens);
  } else {
    std::optional<Blob> blob;
    try {
      blob = store.get_at_most(kChunkSizesKey, kMaxIndexBlobBytes);
    } catch (const std::exception& e) {
      return fault_end(fmt::format("store {} failed ({})", store.describe(), e.what()));
    }
    if (!blob) {
      out.end = PrefixEnd{0, "miss", {}, "not stored (the store lists no chunk size)"};
      return out;
    }
    try {
      sizes = decode_chunk_sizes(*blob);
    } catch (const FormatError& e) {
      return fault_end(fmt::format("corrupt chunk-sizes blob ({})", e.what()));
    }
    std::sort(sizes.begin(), sizes.end());
  }
  std::vector<Walk> walks;
  std::vector<std::string> all_keys;
  for (const int C : sizes) {
    Walk w;
    w.C = C;
    const auto uC = static_cast<std::size_t>(C);
    w.positions = static_cast<int>(tokens.size() / uC);
    w.usable_max = static_cast<int>((tokens.size() - 1) / uC);
    std::uint64_t h = 0;
    for (int i = 0; i < w.positions; ++i) {
      h = directory_hash(h, C, tokens.subspan(static_cast<std::size_t>(i) * uC, uC));
      w.keys.push_back(directory_key(h));
      all_keys.push_back(w.keys.back());
    }
    walks.push_back(std::move(w));
  }
  // Every directory key in one pipelined get; one by one (per size, to the first missing or failed)
  // when the batch fails.
  bool batch_ok = true;
  std::vector<std::optional<Blob>> got;
  if (!all_keys.empty()) {
    try {
      got = store.get_many_at_most(all_keys, kMaxIndexBlobBytes);
    } catch (const std::exception&) {
      batch_ok = false;
    }
  }
  std::size_t at = 0;
  for (Walk& w : walks) {
    if (batch_ok) {
      for (int i = 0; i < w.positions; ++i) w.got.push_back(std::move(got[at++]));
      const auto first_miss = std::find_if(w.got.begin(), w.got.end(), [](const auto& b) { return !b.has_value(); });
      w.got.erase(first_miss, w.got.end());
      continue;
    }
    for (int i = 0; i < w.positions; ++i) {
      try {
        auto b = store.get_at_most(w.keys[static_cast<std::size_t>(i)], kMaxIndexBlobBytes);
        if (!b) break;
        w.got.push_back(std::move(b));
      } catch (const std::exception& e) {
        w.get_fault = fmt::format("store {} failed ({})", store.describe(), e.what());
        break;
      }
    }
  }
  for (Walk& w : walks) analyse(w, fp, levels, tokens);
  // The size reusing the most tokens (ties: the larger); with none usable, the one that found
  // something at position 0 (to say why it was not used), else the first.
  const Walk* best = nullptr;
  for (const Walk& w : walks) {
    if (!best) {
      best = &w;
      continue;
    }
    const auto tokens_of = [](const Walk& x) { return static_cast<std::int64_t>(x.dirs.size()) * x.C; };
    if (tokens_of(w) > tokens_of(*best) || (tokens_of(w) == tokens_of(*best) && tokens_of(w) > 0 && w.C > best->C) ||
        (tokens_of(*best) == 0 && tokens_of(w) == 0 && w.found_any && !best->found_any))
      best = &w;
  }
  if (!best) {  // a size list with no size in it
    out.end = PrefixEnd{0, "miss", {}, "not stored (the store lists no chunk size)"};
    return out;
  }
  out.chunk_tokens = best->C;
  out.end = best->end;
  if (out.end && out.end->status == "fault") out.fault = out.end->reason;
  out.stored_levels = best->stored;
  // Only the common levels, in chunk 0's order (the planner prices "the rest at one level").
  for (const ChunkDirectory& d : best->dirs) {
    ChunkDirectory kept;
    kept.chunk_tokens = d.chunk_tokens;
    for (const auto& l : best->common)
      for (const auto& e : d.entries)
        if (e.level == l) {
          kept.entries.push_back(e);
          break;
        }
    out.dirs.push_back(std::move(kept));
  }
  return out;
}

}  // namespace vq
