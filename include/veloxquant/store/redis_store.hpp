// Redis backends of KVStore, through hiredis (Debian's libhiredis-dev 0.14), synchronous.
//
//   redis://[:password@]host:port[/db][?prefix=P&timeout_ms=N&part_bytes=N]
//   redis-cluster://[:password@]host:port[,host:port...][?same options]
//
// What a reader must know first:
// - A blob stored under key K lives in the Redis key  P{K}  (P the prefix, default "vqkv:"). Its
//   value is one tag byte then either the blob itself ('B') or, for blobs above part_bytes (default
//   64 MiB, well below Redis' 512 MB proto-max-bulk-len), a manifest ('M': part count, total size,
//   xxHash64 of the whole blob, little-endian u64 each) whose parts live in  P{K}#0, P{K}#1, ...
//   The braces make {K} the Redis Cluster hash tag, so a blob's parts share its node and slot.
// - put writes the parts first and the head key last with SET NX, so no reader ever sees a blob
//   before all of it is there; a second writer of the key finds it present and stops. get checks
//   the manifest's size and checksum against what it reassembled (FormatError when they differ).
// - Connections use connect/read timeouts (timeout_ms, default 2000). A command that fails on a
//   broken connection reconnects and is retried once (every command used is idempotent); after that
//   it is an IoError naming the server and the cause.
// - Cluster: the slot map comes from CLUSTER SLOTS (asked of any seed or known node); a key's slot is
//   CRC16-XMODEM of its hash tag mod 16384. -MOVED updates the map and retries at the named node,
//   -ASK sends ASKING then the command there once; a node that cannot be reached refreshes the map
//   once and then fails with an IoError naming the node and the slot of the key.
// - get_many pipelines: one round trip per node for all heads, then one for all parts.
// - Thread-safe: one mutex serialises a store's connections (open one store per thread for
//   parallel clients).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/store/kv_store.hpp"

namespace vq {

struct RedisOptions {
  std::vector<std::pair<std::string, int>> nodes;  // host, port (one for redis://; the seeds for a cluster)
  bool cluster = false;
  std::string password;                            // empty: no AUTH
  int db = 0;                                      // SELECT (standalone only)
  std::string prefix = "vqkv:";
  int timeout_ms = 2000;                           // connect and read/write timeout
  std::uint64_t part_bytes = std::uint64_t{64} << 20;  // blobs above it are split into parts of it
  // Internal: the store's deadline (KVStore::set_deadline), steady-clock nanoseconds, 0: none;
  // shared by its connections.
  std::shared_ptr<std::atomic<std::int64_t>> deadline_ns = std::make_shared<std::atomic<std::int64_t>>(0);
};

// Parse a redis:// or redis-cluster:// URL. Throws InvalidArgument naming the bad part.
RedisOptions parse_redis_url(const std::string& url);

// Opens the connection(s) lazily; the first operation throws IoError when no server answers.
std::unique_ptr<KVStore> make_redis_store(const RedisOptions& options);

// Redis Cluster's slot of a key: CRC16-XMODEM of its hash tag (the text inside the first {...} when
// non-empty, else the whole key) mod 16384.
int redis_cluster_slot(std::string_view key);

}  // namespace vq
