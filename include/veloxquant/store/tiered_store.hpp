// TieredStore: a store's immutable blobs also kept in bounded host RAM and, optionally, on a local
// disk, in front of the backend every server shares (issue 30: RAM, then disk, then Redis). Chosen
// by options on any store URL:
//   ?ram=BYTES                the RAM tier's bound (least recently used blobs leave first)
//   ?disk=DIR[&disk_bytes=BYTES]   a local file: tier (its own LRU bound; unbounded without one)
// BYTES take K, M, G (binary) suffixes: ram=256M.
//
// What a reader must know first:
// - Only blobs read through get_immutable_at_most (the prefix loader's level blobs, which are put
//   once and never replaced) are served from the tiers: a hit in RAM, else on disk (then kept in
//   RAM), else from the backend (then kept on disk and in RAM). Everything else (get, get_at_most,
//   get_many: the prefix index, which writers merge by replace) always comes from the backend, so
//   every server sees what the others stored.
// - put writes the backend first (the truth), then the tiers. replace and remove reach the backend
//   and drop the key from the tiers; so does a loader's repair of a refused blob (remove), so a bad
//   blob is never served again from RAM or disk.
// - Thread-safe. The tiers are a cache: failing to write one is not an error.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "veloxquant/store/kv_store.hpp"

namespace vq {

struct TierStats {
  std::uint64_t ram_hits = 0, disk_hits = 0, backend_reads = 0;
  std::uint64_t ram_bytes = 0, ram_blobs = 0, ram_capacity = 0, ram_evictions = 0;
};

class TieredStore : public KVStore {
 public:
  // ram_bytes 0: no RAM tier; disk null: no disk tier.
  TieredStore(std::unique_ptr<KVStore> backend, std::uint64_t ram_bytes, std::unique_ptr<KVStore> disk);

  void put(std::string_view key, std::span<const std::uint8_t> blob) override;
  void replace(std::string_view key, std::span<const std::uint8_t> blob) override;
  std::optional<Blob> get(std::string_view key) override { return backend_->get(key); }
  std::vector<std::optional<Blob>> get_many(std::span<const std::string> keys) override { return backend_->get_many(keys); }
  std::optional<Blob> get_at_most(std::string_view key, std::uint64_t max_bytes) override { return backend_->get_at_most(key, max_bytes); }
  std::vector<std::optional<Blob>> get_many_at_most(std::span<const std::string> keys, std::uint64_t max_bytes) override {
    return backend_->get_many_at_most(keys, max_bytes);
  }
  std::optional<Blob> get_immutable_at_most(std::string_view key, std::uint64_t max_bytes) override;
  bool exists(std::string_view key) override { return backend_->exists(key); }
  bool remove(std::string_view key) override;
  std::vector<std::string> list() override { return backend_->list(); }
  StoreStats stats() override { return backend_->stats(); }
  std::string describe() const override;
  void mark_used(std::span<const std::string> keys) override { backend_->mark_used(keys); }
  void hold_eviction(bool hold) override { backend_->hold_eviction(hold); }
  void set_deadline(std::optional<std::chrono::steady_clock::time_point> until) override { backend_->set_deadline(until); }

  TierStats tier_stats() const;

 private:
  void ram_insert(const std::string& key, const Blob& blob);
  void ram_erase(const std::string& key);
  void drop_tiers(const std::string& key);  // RAM and disk forget the key (replace, remove)
  void disk_keep(const std::string& key, const Blob& blob);

  std::unique_ptr<KVStore> backend_, disk_;
  std::uint64_t ram_capacity_;
  mutable std::mutex mu_;
  std::list<std::pair<std::string, Blob>> lru_;  // front: most recently used
  std::unordered_map<std::string, std::list<std::pair<std::string, Blob>>::iterator> index_;
  TierStats stats_;
};

}  // namespace vq
