// FileStore: the embedded KVStore backend, one file per blob under a directory (`file:DIR`).
//
// Layout: DIR/blobs/<hex of the key's bytes>, so list() recovers every key exactly and no key can
// name a path outside DIR. Writes go through core/atomic_file.hpp (a temporary file, flushed, then
// renamed), so a reader in any process sees a blob whole or not at all, and several processes may
// put, get and evict in one directory at once: rename and unlink are atomic, a reader holding a
// file open keeps reading it after another process evicts it, and concurrent writers of one key
// write the same bytes.
//
// Capacity (optional, `?capacity=BYTES`): after a put, while the blobs' bytes exceed it, the least
// recently used blob is removed. "Used" is the file's modification time, which get() refreshes,
// so recency is shared between processes through the file system. A blob larger than the whole
// capacity is refused (IoError) rather than evicting everything.
#pragma once
#include <cstdint>
#include <filesystem>
#include <atomic>
#include <mutex>

#include "veloxquant/store/kv_store.hpp"

namespace vq {

class FileStore : public KVStore {
 public:
  // Creates DIR (and DIR/blobs) when missing. capacity 0: unbounded. Throws IoError.
  explicit FileStore(std::filesystem::path dir, std::uint64_t capacity = 0);

  void put(std::string_view key, std::span<const std::uint8_t> blob) override;
  void replace(std::string_view key, std::span<const std::uint8_t> blob) override;
  std::optional<Blob> get(std::string_view key) override;
  std::optional<Blob> get_at_most(std::string_view key, std::uint64_t max_bytes) override;
  bool exists(std::string_view key) override;
  bool remove(std::string_view key) override;
  std::vector<std::string> list() override;
  StoreStats stats() override;
  std::string describe() const override;
  void mark_used(std::span<const std::string> keys) override;
  void hold_eviction(bool hold) override;

  // Where a key's blob lives (for tests).
  std::filesystem::path blob_path(std::string_view key) const;

 private:
  void write(std::string_view key, std::span<const std::uint8_t> blob, bool keep_existing);
  void evict_to_capacity();
  std::filesystem::path dir_, blobs_;
  std::uint64_t capacity_;
  std::mutex evict_mutex_;  // one evictor per process; other processes may evict concurrently
  std::atomic<int> held_{0};  // hold_eviction depth
};

}  // namespace vq
