// open_store: the URL -> backend table, and the key rules every backend shares.
#include "veloxquant/store/kv_store.hpp"

#include <charconv>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/store/file_store.hpp"
#include "veloxquant/store/redis_store.hpp"
#include "veloxquant/store/sealed_store.hpp"
#include "veloxquant/store/tiered_store.hpp"

namespace vq {

void check_store_key(std::string_view key) {
  if (key.empty() || key.size() > kMaxStoreKeyBytes)
    throw InvalidArgument(fmt::format("store key must be 1..{} bytes, got {}", kMaxStoreKeyBytes, key.size()));
  for (const char c : key) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f || c == '{' || c == '}')
      throw InvalidArgument(fmt::format("store key '{}' holds a character keys may not (space, control, non-ASCII, '{{' or '}}')",
                                        std::string(key.substr(0, 64))));
  }
}

std::vector<std::optional<Blob>> KVStore::get_many(std::span<const std::string> keys) {
  std::vector<std::optional<Blob>> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(get(k));
  return out;
}

std::optional<Blob> KVStore::get_at_most(std::string_view key, std::uint64_t max_bytes) {
  auto b = get(key);
  if (b && b->size() > max_bytes) throw_blob_too_large(describe(), key, b->size(), max_bytes);
  return b;
}

std::vector<std::optional<Blob>> KVStore::get_many_at_most(std::span<const std::string> keys, std::uint64_t max_bytes) {
  std::vector<std::optional<Blob>> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(get_at_most(k, max_bytes));
  return out;
}

void throw_blob_too_large(const std::string& store, std::string_view key, std::uint64_t bytes, std::uint64_t max_bytes) {
  if (bytes)
    throw FormatError(fmt::format("store {}: blob '{}' holds {} bytes, more than the {} expected; refused unread", store,
                                  std::string(key.substr(0, 100)), bytes, max_bytes));
  throw FormatError(fmt::format("store {}: blob '{}' holds more than the {} bytes expected; refused unread", store,
                                std::string(key.substr(0, 100)), max_bytes));
}

namespace {
std::uint64_t parse_u64(std::string_view text, const std::string& what) {
  std::uint64_t v = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || text.empty())
    throw InvalidArgument(fmt::format("store URL: {} must be a non-negative integer, got '{}'", what, std::string(text)));
  return v;
}

std::unique_ptr<KVStore> open_file_store(std::string_view rest) {
  std::uint64_t capacity = 0;
  std::string dir(rest);
  if (const auto q = dir.find('?'); q != std::string::npos) {
    const std::string query = dir.substr(q + 1);
    dir.resize(q);
    if (query.rfind("capacity=", 0) != 0)
      throw InvalidArgument(fmt::format("store URL: file: takes only ?capacity=BYTES, got '?{}'", query));
    capacity = parse_u64(std::string_view(query).substr(9), "capacity");
  }
  if (dir.empty()) throw InvalidArgument("store URL: file: needs a directory, e.g. file:./.vqkv-store");
  return std::make_unique<FileStore>(dir, capacity);
}
}  // namespace

namespace {
std::unique_ptr<KVStore> open_backend(const std::string& u) {
  if (u.rfind("file:", 0) == 0) return open_file_store(std::string_view(u).substr(5));
  if (u.rfind("redis://", 0) == 0 || u.rfind("redis-cluster://", 0) == 0) return make_redis_store(parse_redis_url(u));
  throw InvalidArgument(fmt::format("store URL '{}' is not one of file:DIR, redis://host:port, redis-cluster://host:port[,...]", u));
}

// A byte count with an optional K, M or G (binary) suffix.
std::uint64_t parse_bytes(std::string_view text, const std::string& what) {
  std::uint64_t scale = 1;
  if (!text.empty()) {
    const char s = text.back();
    scale = s == 'K' || s == 'k' ? 1ull << 10 : s == 'M' || s == 'm' ? 1ull << 20 : s == 'G' || s == 'g' ? 1ull << 30 : 1;
    if (scale > 1) text.remove_suffix(1);
  }
  const std::uint64_t v = parse_u64(text, what);
  if (v > UINT64_MAX / scale) throw InvalidArgument(fmt::format("store URL: {} is too large", what));
  return v * scale;
}

// The tier options (ram=, disk=, disk_bytes=) taken off a URL's query.
struct TierOptions {
  std::uint64_t ram = 0, disk_bytes = 0;
  std::string disk;
};
std::string split_tiers(const std::string& url, TierOptions& t) {
  const auto q = url.find('?');
  if (q == std::string::npos) return url;
  std::string base = url.substr(0, q), kept;
  std::string_view query = std::string_view(url).substr(q + 1);
  while (true) {
    const auto amp = query.find('&');
    const std::string_view kv = query.substr(0, amp);
    if (kv.rfind("ram=", 0) == 0) t.ram = parse_bytes(kv.substr(4), "ram");
    else if (kv.rfind("disk_bytes=", 0) == 0) t.disk_bytes = parse_bytes(kv.substr(11), "disk_bytes");
    else if (kv.rfind("disk=", 0) == 0) t.disk = std::string(kv.substr(5));
    else if (!kv.empty()) kept += (kept.empty() ? "" : "&") + std::string(kv);
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  if (t.disk.empty() && t.disk_bytes) throw InvalidArgument("store URL: disk_bytes= needs disk=DIR");
  return kept.empty() ? base : base + "?" + kept;
}
}  // namespace

std::unique_ptr<KVStore> open_store(const std::string& url) {
  // The guards (secret=, namespace=, or their environment variables) first: the backend never sees
  // the secret, so no message of its names it.
  auto [guarded, guards] = split_store_guards(url.empty() ? std::string(kDefaultStoreUrl) : url);
  TierOptions tiers;
  const std::string base = split_tiers(guarded, tiers);
  std::unique_ptr<KVStore> store = open_backend(base);
  if (tiers.ram || !tiers.disk.empty())
    store = std::make_unique<TieredStore>(std::move(store), tiers.ram,
                                          tiers.disk.empty() ? nullptr : std::make_unique<FileStore>(tiers.disk, tiers.disk_bytes));
  // Above the tiers, so they hold sealed blobs under stored names. Without guards the wrapper only
  // refuses sealed blobs with a message that says why.
  return std::make_unique<SealedStore>(std::move(store), guards);
}

}  // namespace vq
