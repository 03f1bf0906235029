// TieredStore (store/tiered_store.hpp): immutable blobs in bounded RAM and on a local disk, in front
// of the shared backend.
#include "veloxquant/store/tiered_store.hpp"

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"

namespace vq {

TieredStore::TieredStore(std::unique_ptr<KVStore> backend, std::uint64_t ram_bytes, std::unique_ptr<KVStore> disk)
    : backend_(std::move(backend)), disk_(std::move(disk)), ram_capacity_(ram_bytes) {
  require(backend_ != nullptr, "TieredStore: no backend");
  stats_.ram_capacity = ram_bytes;
}

std::string TieredStore::describe() const {
  std::string d = backend_->describe();
  if (ram_capacity_) d += fmt::format(" (RAM tier {} bytes)", ram_capacity_);
  if (disk_) d += fmt::format(" (disk tier {})", disk_->describe());
  return d;
}

void TieredStore::ram_insert(const std::string& key, const Blob& blob) {
  if (!ram_capacity_ || blob.size() > ram_capacity_) return;  // larger than the whole tier: not kept
  std::lock_guard lock(mu_);
  if (const auto it = index_.find(key); it != index_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second);
    return;
  }
  lru_.emplace_front(key, blob);
  index_[key] = lru_.begin();
  stats_.ram_bytes += blob.size();
  ++stats_.ram_blobs;
  while (stats_.ram_bytes > ram_capacity_) {
    auto& last = lru_.back();
    stats_.ram_bytes -= last.second.size();
    --stats_.ram_blobs;
    ++stats_.ram_evictions;
    index_.erase(last.first);
    lru_.pop_back();
  }
}

void TieredStore::ram_erase(const std::string& key) {
  std::lock_guard lock(mu_);
  const auto it = index_.find(key);
  if (it == index_.end()) return;
  stats_.ram_bytes -= it->second->second.size();
  --stats_.ram_blobs;
  lru_.erase(it->second);
  index_.erase(it);
}

void TieredStore::disk_keep(const std::string& key, const Blob& blob) {
  if (!disk_) return;
  try {
    disk_->put(key, blob);
  } catch (const std::exception&) {  // a cache: a full or read-only disk only costs its hits
  }
}

void TieredStore::put(std::string_view key, std::span<const std::uint8_t> blob) {
  backend_->put(key, blob);  // the truth first: a tier never holds what the backend refused
  const std::string k(key);
  const Blob b(blob.begin(), blob.end());
  disk_keep(k, b);
  ram_insert(k, b);
}

void TieredStore::drop_tiers(const std::string& key) {
  ram_erase(key);
  if (!disk_) return;
  try {
    disk_->remove(key);
  } catch (const std::exception&) {  // a copy the disk would not drop is checked like any blob when read
  }
}

void TieredStore::replace(std::string_view key, std::span<const std::uint8_t> blob) {
  drop_tiers(std::string(key));
  backend_->replace(key, blob);
}

bool TieredStore::remove(std::string_view key) {
  drop_tiers(std::string(key));
  return backend_->remove(key);
}

std::optional<Blob> TieredStore::get_immutable_at_most(std::string_view key, std::uint64_t max_bytes) {
  const std::string k(key);
  {
    std::lock_guard lock(mu_);
    if (const auto it = index_.find(k); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      const Blob& b = it->second->second;
      if (b.size() > max_bytes) throw_blob_too_large(describe(), key, b.size(), max_bytes);
      ++stats_.ram_hits;
      return b;
    }
  }
  if (disk_) {
    std::optional<Blob> b;
    try {
      b = disk_->get_at_most(k, max_bytes);
    } catch (const FormatError&) {  // a bad copy on the local disk: dropped, the backend's is read
      try {
        disk_->remove(k);
      } catch (const std::exception&) {
      }
    } catch (const IoError&) {
    }
    if (b) {
      {
        std::lock_guard lock(mu_);
        ++stats_.disk_hits;
      }
      ram_insert(k, *b);
      return b;
    }
  }
  auto b = backend_->get_immutable_at_most(key, max_bytes);
  {
    std::lock_guard lock(mu_);
    ++stats_.backend_reads;
  }
  if (b) {
    disk_keep(k, *b);
    ram_insert(k, *b);
  }
  return b;
}

TierStats TieredStore::tier_stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

}  // namespace vq
