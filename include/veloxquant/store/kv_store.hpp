// KVStore: a narrow store of immutable blobs by key (LMCache's storage backends, vLLM's
// connectors). Everything about chunks, prefixes and quality levels lives above it
// (store/prefix_chunks.hpp), so a backend is one file and tests never need a fake.
//
// What a caller must know first:
// - Blobs are immutable: put() of a key that exists leaves it as it is (put is idempotent; two
//   writers of one key race harmlessly because they write the same bytes). A reader sees a blob
//   whole or not at all, never half of one. replace() is the one mutable write, for the prefix
//   index's small blobs (store/prefix_chunks.hpp), which writers merge by read-modify-replace.
// - Keys are 1..100 bytes of printable ASCII without spaces or braces ('{', '}' are reserved for
//   Redis Cluster hash tags); anything else is InvalidArgument.
// - Every method is thread-safe. Failures to reach or use the backend throw IoError with one
//   sentence naming the backend and the cause; get() of a missing key is std::nullopt, not an error.
//
// Backends, chosen by URL (open_store):
//   file:DIR                               one file per blob under DIR (default ./.vqkv-store),
//       ?capacity=BYTES                    least-recently-used eviction above BYTES (store/file_store.hpp)
//   redis://[:password@]host:port[/db]     Redis through hiredis (store/redis_store.hpp)
//       ?prefix=P [vqkv:]  &timeout_ms=N [2000]  &part_bytes=N [64 MiB]
//   redis-cluster://host:port[,host:port...]   a Redis Cluster, same options (store/redis_store.hpp)
// and on any of them: ?secret=S&namespace=N (store/sealed_store.hpp), ?ram=BYTES&disk=DIR&disk_bytes=BYTES
// (store/tiered_store.hpp).
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vq {

using Blob = std::vector<std::uint8_t>;

// What a store holds now (stats()).
struct StoreStats {
  std::uint64_t blobs = 0;
  std::uint64_t bytes = 0;          // the blobs' own bytes (not the backend's overhead)
  std::uint64_t capacity = 0;       // 0: unbounded
  std::string backend;              // "file", "redis", "redis-cluster"
};

class KVStore {
 public:
  virtual ~KVStore() = default;

  // Store `blob` under `key` unless the key exists (then nothing changes). Throws IoError.
  virtual void put(std::string_view key, std::span<const std::uint8_t> blob) = 0;
  // Store `blob` under `key` whether or not the key exists. A reader sees the old blob or the new
  // one whole (a blob split into parts that a reader catches mid-replace fails its checksum:
  // FormatError, never a mix). Throws IoError.
  virtual void replace(std::string_view key, std::span<const std::uint8_t> blob) = 0;
  // The blob, or nullopt when the key is missing. Throws IoError (and FormatError when the backend
  // holds something under the key that is not a whole blob of ours).
  virtual std::optional<Blob> get(std::string_view key) = 0;
  // Several blobs at once (pipelined where the backend can); result i is get(keys[i]).
  virtual std::vector<std::optional<Blob>> get_many(std::span<const std::string> keys);
  // Bounded reads: get / get_many, but a blob of more than `max_bytes` is refused before it is read
  // (FormatError naming the key, its size where known, and the bound), so a forged or runaway blob
  // never costs its size in memory. The prefix store reads every level blob bounded by the size its
  // directory records, and index blobs by kMaxIndexBlobBytes. The defaults read whole and then
  // check; every backend here overrides them to bound the read itself.
  virtual std::optional<Blob> get_at_most(std::string_view key, std::uint64_t max_bytes);
  virtual std::vector<std::optional<Blob>> get_many_at_most(std::span<const std::string> keys, std::uint64_t max_bytes);
  // get_at_most of a blob the caller knows is immutable (put once, never replaced: the prefix
  // store's level blobs), which a store may then serve from a cache of its own (store/tiered_store.hpp:
  // RAM and local disk tiers). Default: get_at_most.
  virtual std::optional<Blob> get_immutable_at_most(std::string_view key, std::uint64_t max_bytes) { return get_at_most(key, max_bytes); }
  virtual bool exists(std::string_view key) = 0;
  // Remove the blob; true when it was there.
  virtual bool remove(std::string_view key) = 0;
  // Every key held, sorted.
  virtual std::vector<std::string> list() = 0;
  virtual StoreStats stats() = 0;
  // The URL this store was opened with (password removed), for messages.
  virtual std::string describe() const = 0;
  // Recency for backends that evict (file:?capacity=): `keys` were just used, the first most
  // recently. The prefix store marks a prefix's chunks first-chunk-newest after a put or a load, so
  // eviction takes a prefix's last chunks before its first: it never strands chunks that a walk
  // from chunk 0 can no longer reach. Default: nothing.
  virtual void mark_used(std::span<const std::string> keys) { (void)keys; }
  // Writes between hold_eviction(true) and hold_eviction(false) (counted, any thread) evict nothing;
  // the release evicts down to the capacity. put_context holds it around its writes and its
  // mark_used, so its own first chunks are never the oldest while it writes the later ones.
  virtual void hold_eviction(bool hold) { (void)hold; }
  // A deadline for every call on this store from now on (any thread), until reset with nullopt: a
  // networked backend waits no longer than it for a reply (nor retries past it) and fails with an
  // IoError that says so. load_prefix sets it from slo_ms, so the whole load, directory included,
  // ends by its deadline however the store stalls. Default (local backends): nothing.
  virtual void set_deadline(std::optional<std::chrono::steady_clock::time_point> until) { (void)until; }
};

// The store a URL names (see the table above); "" is file:./.vqkv-store. Throws InvalidArgument on
// a malformed URL and IoError when the backend cannot be reached.
std::unique_ptr<KVStore> open_store(const std::string& url);

inline constexpr const char* kDefaultStoreUrl = "file:./.vqkv-store";
inline constexpr std::size_t kMaxStoreKeyBytes = 100;  // file: names a blob by its hex (200 chars), under the 255 a name may have

// Throws InvalidArgument unless `key` is a valid store key (see above).
void check_store_key(std::string_view key);
// The FormatError of a bounded read that found more than it allows (bytes 0: size unknown).
[[noreturn]] void throw_blob_too_large(const std::string& store, std::string_view key, std::uint64_t bytes, std::uint64_t max_bytes);

}  // namespace vq
