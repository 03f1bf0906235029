// SealedStore (store/sealed_store.hpp): a MAC per blob and a namespace per tenant, over any backend.
#include "veloxquant/store/sealed_store.hpp"

#include <openssl/crypto.h>
#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <cstring>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

// Trailer of a sealed blob: the blob, then its nonce (16 random bytes), its tag (16), the magic (8).
constexpr unsigned char kMagic[8] = {'V', 'Q', 'M', 'A', 'C', 0, 2, 0};
constexpr std::size_t kNonceBytes = 16, kTagBytes = 16;
constexpr std::size_t kTrailer = kNonceBytes + kTagBytes + sizeof kMagic;

// HMAC-SHA256(key, parts...): key derivation and the namespace's key names (small inputs).
std::array<unsigned char, 32> hmac(std::span<const unsigned char> key, std::initializer_list<std::string_view> parts) {
  std::array<unsigned char, 32> out{};
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  EVP_MAC_CTX* ctx = mac ? EVP_MAC_CTX_new(mac) : nullptr;
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", const_cast<char*>("SHA256"), 0), OSSL_PARAM_construct_end()};
  std::size_t n = 0;
  bool ok = ctx && EVP_MAC_init(ctx, key.data(), key.size(), params) == 1;
  for (const auto& p : parts) {
    const std::uint64_t len = p.size();  // lengths first: no two part lists share a byte string
    ok = ok && EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(&len), sizeof len) == 1 &&
         EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(p.data()), p.size()) == 1;
  }
  ok = ok && EVP_MAC_final(ctx, out.data(), &n, out.size()) == 1 && n == out.size();
  EVP_MAC_CTX_free(ctx);
  EVP_MAC_free(mac);
  if (!ok) throw IoError("OpenSSL's HMAC-SHA256 failed");
  return out;
}

std::span<const unsigned char> bytes_of(std::string_view s) { return {reinterpret_cast<const unsigned char*>(s.data()), s.size()}; }
std::string_view view_of(std::span<const unsigned char> b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

std::string hex(const unsigned char* p, std::size_t n) {
  std::string s;
  s.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) s += fmt::format("{:02x}", p[i]);
  return s;
}

bool sealed(std::span<const std::uint8_t> b) {
  return b.size() >= kTrailer && std::memcmp(b.data() + b.size() - sizeof kMagic, kMagic, sizeof kMagic) == 0;
}

// The tag of (stored key, blob) under the blob's own key: GMAC (AES-256-GCM over additional data
// only), keyed by HMAC(secret key, nonce), so no AES key ever tags two blobs (a fixed IV is safe).
void tag(const std::array<unsigned char, 32>& mac_key, const unsigned char* nonce, const std::string& stored,
         std::span<const std::uint8_t> blob, unsigned char out[kTagBytes]) {
  const auto key = hmac(mac_key, {"blob", view_of({nonce, kNonceBytes})});
  static constexpr unsigned char kIv[12] = {};
  EVP_CIPHER_CTX* c = EVP_CIPHER_CTX_new();
  int len = 0;
  const std::uint64_t n = stored.size();
  bool ok = c && EVP_EncryptInit_ex(c, EVP_aes_256_gcm(), nullptr, key.data(), kIv) == 1 &&
            EVP_EncryptUpdate(c, nullptr, &len, reinterpret_cast<const unsigned char*>(&n), sizeof n) == 1 &&
            EVP_EncryptUpdate(c, nullptr, &len, reinterpret_cast<const unsigned char*>(stored.data()), static_cast<int>(stored.size())) == 1;
  // In pieces under 2 GiB (EVP takes an int length).
  for (std::size_t at = 0; ok && at < blob.size(); at += std::size_t{1} << 30) {
    const std::size_t piece = std::min<std::size_t>(blob.size() - at, std::size_t{1} << 30);
    ok = EVP_EncryptUpdate(c, nullptr, &len, blob.data() + at, static_cast<int>(piece)) == 1;
  }
  ok = ok && EVP_EncryptFinal_ex(c, nullptr, &len) == 1 && EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, kTagBytes, out) == 1;
  EVP_CIPHER_CTX_free(c);
  if (!ok) throw IoError("OpenSSL's AES-256-GCM failed");
}

}  // namespace

SealedStore::SealedStore(std::unique_ptr<KVStore> inner, const StoreGuards& guards) : inner_(std::move(inner)) {
  require(inner_ != nullptr, "SealedStore: no backend");
  if (guards.secret) {
    if (guards.secret->empty()) throw InvalidArgument("store secret is empty (unset it for a store without a MAC)");
    mac_ = true;
    mac_key_ = hmac(bytes_of("veloxquant store secret"), {*guards.secret});
  }
  if (guards.name_space) {
    if (guards.name_space->empty()) throw InvalidArgument("store namespace is empty (unset it for the plain keys)");
    ns_ = true;
    ns_key_ = hmac(bytes_of("veloxquant store namespace"), {*guards.name_space});
    const auto id = hmac(ns_key_, {"id"});
    ns_prefix_ = "vq-ns" + hex(id.data(), 4) + "-";
  }
}

std::string SealedStore::stored_key(std::string_view key) const {
  check_store_key(key);
  if (!ns_ || key.rfind(ns_prefix_, 0) == 0) return std::string(key);  // a name list() gave: taken as it is
  const auto h = hmac(ns_key_, {key});
  return ns_prefix_ + hex(h.data(), 16);
}

Blob SealedStore::seal(const std::string& stored, std::span<const std::uint8_t> blob) const {
  if (!mac_) return Blob(blob.begin(), blob.end());
  Blob out(blob.size() + kTrailer);
  if (!blob.empty()) std::memcpy(out.data(), blob.data(), blob.size());
  unsigned char* nonce = out.data() + blob.size();
  if (RAND_bytes(nonce, kNonceBytes) != 1) throw IoError("OpenSSL's RAND_bytes failed");
  tag(mac_key_, nonce, stored, blob, nonce + kNonceBytes);
  std::memcpy(nonce + kNonceBytes + kTagBytes, kMagic, sizeof kMagic);
  return out;
}

Blob SealedStore::open(const std::string& stored, Blob b) const {
  if (!mac_) {
    if (sealed(b))
      throw StoreAuthError(fmt::format("blob '{}' carries a MAC: the store has a secret (set VQ_STORE_SECRET or ?secret= to read it)", stored));
    return b;
  }
  if (!sealed(b)) throw FormatError(fmt::format("blob '{}' carries no MAC: it was not written with this store's secret", stored));
  const std::size_t n = b.size() - kTrailer;
  unsigned char want[kTagBytes];
  tag(mac_key_, b.data() + n, stored, std::span<const std::uint8_t>(b).first(n), want);
  if (CRYPTO_memcmp(want, b.data() + n + kNonceBytes, kTagBytes) != 0)
    throw StoreAuthError(fmt::format("blob '{}' fails its MAC: forged, corrupt, moved from another key, or written with another secret", stored));
  b.resize(n);  // the trailer goes: no copy
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
  // The seal's trailer on top of the bound (a reader without the secret allows it too, to say why it
  // refuses a sealed blob rather than that it is too large).
  const std::uint64_t inner_max = max_bytes > UINT64_MAX - kTrailer ? UINT64_MAX : max_bytes + kTrailer;
  std::vector<std::optional<Blob>> got;
  if (stored.size() == 1) got.push_back(inner_->get_at_most(stored[0], inner_max));  // moved in (a braced list would copy the blob)
  else got = inner_->get_many_at_most(stored, inner_max);
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i]) {
      got[i] = open(stored[i], std::move(*got[i]));
      if (got[i]->size() > max_bytes) throw_blob_too_large(describe(), keys[i], got[i]->size(), max_bytes);
    }
  return got;
}

std::optional<Blob> SealedStore::get_immutable_at_most(std::string_view key, std::uint64_t max_bytes) {
  const std::string k = stored_key(key);
  auto b = inner_->get_immutable_at_most(k, max_bytes > UINT64_MAX - kTrailer ? UINT64_MAX : max_bytes + kTrailer);
  if (!b) return b;
  b = open(k, std::move(*b));
  if (b->size() > max_bytes) throw_blob_too_large(describe(), key, b->size(), max_bytes);
  return b;
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
