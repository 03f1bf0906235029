// SealedStore (store/sealed_store.hpp): a MAC per blob and a namespace per tenant, over any backend.
#include "veloxquant/store/sealed_store.hpp"

#include <sodium.h>

#include <cstdlib>
#include <cstring>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

constexpr unsigned char kMagic[8] = {'V', 'Q', 'M', 'A', 'C', 0, 1, 0};
constexpr std::size_t kTagBytes = 32;
constexpr std::size_t kHeader = sizeof kMagic + kTagBytes;

void init_sodium() {
  static const int rc = sodium_init();  // thread-safe, once; < 0: the library cannot be used
  if (rc < 0) throw IoError("libsodium could not be initialised");
}

// A 32-byte key derived from a domain and a text (BLAKE2b-256, unkeyed).
std::array<unsigned char, 32> derive(std::string_view domain, std::string_view text) {
  std::array<unsigned char, 32> out{};
  crypto_generichash_state st;
  crypto_generichash_init(&st, nullptr, 0, out.size());
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(domain.data()), domain.size());
  const unsigned char zero = 0;
  crypto_generichash_update(&st, &zero, 1);
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(text.data()), text.size());
  crypto_generichash_final(&st, out.data(), out.size());
  return out;
}

std::string hex(const unsigned char* p, std::size_t n) {
  std::string s;
  s.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) s += fmt::format("{:02x}", p[i]);
  return s;
}

bool sealed(std::span<const std::uint8_t> b) { return b.size() >= sizeof kMagic && std::memcmp(b.data(), kMagic, sizeof kMagic) == 0; }

// The tag of (key, blob) under `key32`: the key's length and bytes first, so no two pairs share input.
void tag(const std::array<unsigned char, 32>& key32, const std::string& stored, std::span<const std::uint8_t> blob,
         unsigned char out[kTagBytes]) {
  crypto_generichash_state st;
  crypto_generichash_init(&st, key32.data(), key32.size(), kTagBytes);
  const std::uint64_t n = stored.size();
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(&n), sizeof n);
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(stored.data()), stored.size());
  crypto_generichash_update(&st, blob.data(), blob.size());
  crypto_generichash_final(&st, out, kTagBytes);
}

}  // namespace

SealedStore::SealedStore(std::unique_ptr<KVStore> inner, const StoreGuards& guards) : inner_(std::move(inner)) {
  require(inner_ != nullptr, "SealedStore: no backend");
  init_sodium();
  if (guards.secret) {
    if (guards.secret->empty()) throw InvalidArgument("store secret is empty (unset it for a store without a MAC)");
    mac_ = true;
    mac_key_ = derive("veloxquant store secret", *guards.secret);
  }
  if (guards.name_space) {
    if (guards.name_space->empty()) throw InvalidArgument("store namespace is empty (unset it for the plain keys)");
    ns_ = true;
    ns_key_ = derive("veloxquant store namespace", *guards.name_space);
    const auto id = derive("veloxquant namespace id", std::string_view(reinterpret_cast<const char*>(ns_key_.data()), ns_key_.size()));
    ns_prefix_ = "vq-ns" + hex(id.data(), 4) + "-";
  }
}

std::string SealedStore::stored_key(std::string_view key) const {
  check_store_key(key);
  if (!ns_ || key.rfind(ns_prefix_, 0) == 0) return std::string(key);  // a name list() gave: taken as it is
  unsigned char h[16];
  crypto_generichash(h, sizeof h, reinterpret_cast<const unsigned char*>(key.data()), key.size(), ns_key_.data(), ns_key_.size());
  return ns_prefix_ + hex(h, sizeof h);
}

Blob SealedStore::seal(const std::string& stored, std::span<const std::uint8_t> blob) const {
  if (!mac_) return Blob(blob.begin(), blob.end());
  Blob out(kHeader + blob.size());
  std::memcpy(out.data(), kMagic, sizeof kMagic);
  tag(mac_key_, stored, blob, out.data() + sizeof kMagic);
  if (!blob.empty()) std::memcpy(out.data() + kHeader, blob.data(), blob.size());
  return out;
}

Blob SealedStore::open(const std::string& stored, Blob b) const {
  if (!mac_) {
    if (sealed(b))
      throw FormatError(fmt::format("blob '{}' carries a MAC: the store has a secret (set VQ_STORE_SECRET or ?secret= to read it)", stored));
    return b;
  }
  if (!sealed(b) || b.size() < kHeader)
    throw FormatError(fmt::format("blob '{}' carries no MAC: it was not written with this store's secret", stored));
  unsigned char want[kTagBytes];
  tag(mac_key_, stored, std::span<const std::uint8_t>(b).subspan(kHeader), want);
  if (crypto_verify_32(want, b.data() + sizeof kMagic) != 0)
    throw FormatError(fmt::format("blob '{}' fails its MAC: forged, corrupt, moved from another key, or written with another secret", stored));
  b.erase(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(kHeader));
  return b;
}

void SealedStore::put(std::string_view key, std::span<const std::uint8_t> blob) {
  const std::string k = stored_key(key);
  inner_->put(k, seal(k, blob));
}

void SealedStore::replace(std::string_view key, std::span<const std::uint8_t> blob) {
  const std::string k = stored_key(key);
  inner_->replace(k, seal(k, blob));
}

std::optional<Blob> SealedStore::get(std::string_view key) { return get_at_most(key, UINT64_MAX); }

std::vector<std::optional<Blob>> SealedStore::get_many(std::span<const std::string> keys) { return get_many_at_most(keys, UINT64_MAX); }

std::optional<Blob> SealedStore::get_at_most(std::string_view key, std::uint64_t max_bytes) {
  const std::string k(key);
  return std::move(get_many_at_most(std::span<const std::string>(&k, 1), max_bytes)[0]);
}

std::vector<std::optional<Blob>> SealedStore::get_many_at_most(std::span<const std::string> keys, std::uint64_t max_bytes) {
  std::vector<std::string> stored;
  stored.reserve(keys.size());
  for (const auto& k : keys) stored.push_back(stored_key(k));
  // The seal's header on top of the bound (a reader without the secret allows it too, to say why it
  // refuses a sealed blob rather than that it is too large).
  const std::uint64_t inner_max = max_bytes > UINT64_MAX - kHeader ? UINT64_MAX : max_bytes + kHeader;
  auto got = stored.size() == 1 ? std::vector<std::optional<Blob>>{inner_->get_at_most(stored[0], inner_max)}
                                 : inner_->get_many_at_most(stored, inner_max);
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i]) {
      got[i] = open(stored[i], std::move(*got[i]));
      if (got[i]->size() > max_bytes) throw_blob_too_large(describe(), keys[i], got[i]->size(), max_bytes);
    }
  return got;
}

bool SealedStore::exists(std::string_view key) { return inner_->exists(stored_key(key)); }
bool SealedStore::remove(std::string_view key) { return inner_->remove(stored_key(key)); }

std::vector<std::string> SealedStore::list() {
  auto all = inner_->list();
  if (ns_) std::erase_if(all, [&](const std::string& k) { return k.rfind(ns_prefix_, 0) != 0; });
  return all;
}

StoreStats SealedStore::stats() { return inner_->stats(); }

void SealedStore::mark_used(std::span<const std::string> keys) {
  std::vector<std::string> stored;
  stored.reserve(keys.size());
  for (const auto& k : keys) stored.push_back(stored_key(k));
  inner_->mark_used(stored);
}

std::string SealedStore::describe() const {
  std::string d = inner_->describe();
  if (mac_) d += " (sealed)";
  if (ns_) d += fmt::format(" (namespace {})", ns_prefix_.substr(3, 10));
  return d;
}

std::pair<std::string, StoreGuards> split_store_guards(const std::string& url) {
  StoreGuards g;
  std::string base = url;
  if (const auto q = url.find('?'); q != std::string::npos) {
    base = url.substr(0, q);
    std::string kept;
    std::string_view query = std::string_view(url).substr(q + 1);
    while (true) {
      const auto amp = query.find('&');
      const std::string_view kv = query.substr(0, amp);
      if (kv.rfind("secret=", 0) == 0) g.secret = std::string(kv.substr(7));
      else if (kv.rfind("namespace=", 0) == 0) g.name_space = std::string(kv.substr(10));
      else if (!kv.empty()) kept += (kept.empty() ? "" : "&") + std::string(kv);
      if (amp == std::string_view::npos) break;
      query.remove_prefix(amp + 1);
    }
    if (!kept.empty()) base += "?" + kept;
  }
  if (!g.secret)
    if (const char* s = std::getenv("VQ_STORE_SECRET"); s && *s) g.secret = s;
  if (!g.name_space)
    if (const char* s = std::getenv("VQ_STORE_NAMESPACE"); s && *s) g.name_space = s;
  return {base, g};
}

}  // namespace vq
