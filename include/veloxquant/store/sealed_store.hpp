// SealedStore: a store shared by writers who may not all be trusted (issue 36). It wraps any
// backend (KVStore) with two optional guards, chosen by the store URL or the environment:
//
// - A secret (`?secret=TEXT`, else the environment variable VQ_STORE_SECRET): every blob written
//   carries a MAC over the blob's key and bytes, checked before anything decodes the blob: a blob
//   written without the secret, forged, moved to another key or corrupted is a FormatError naming
//   the key, so the loaders treat it as corrupt (one warning, recompute). A reader without a secret
//   refuses sealed blobs the same way (it says the store has a secret), never decodes them. The
//   secret is never printed: describe() drops it from the URL.
//   The MAC is GMAC (AES-256-GCM over additional data only) from Debian's OpenSSL (libcrypto), under
//   a key of its own per blob, HMAC-SHA256(K, 16 random bytes stored with the blob), K =
//   HMAC-SHA256 of the secret: no AES key ever tags two blobs. GMAC because the check must cost
//   under 2 % of a load from RAM (issue 36): on this project's machine it runs at ~9.6 GB/s, where
//   HMAC-SHA256 runs at 1.9, keyed BLAKE2b (libsodium) at 0.7 and Poly1305 at 4.7 GB/s
//   (docs/benchmarks.md, "Sealed store").
// - A namespace (`?namespace=TEXT`, else VQ_STORE_NAMESPACE; vLLM's `cache_salt`): every key is
//   replaced by "vq-ns<8 hex>-<32 hex>", an HMAC-SHA256 of the key under the namespace, so one
//   tenant's prefixes are never another's (their chains never meet) and cannot be found by
//   computing a prompt's keys without the namespace. A namespace meant to hide prefixes must be as
//   hard to guess as a password. Keys of the namespace listed by list() are its stored names; they
//   are taken back as they are (store ls / rm work on them).
//
// A sealed blob is the blob, then its nonce (16 bytes), its tag (16) and "VQMAC\0\2\0" (8): a
// trailer, so a reader strips it without moving the blob.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "veloxquant/core/error.hpp"
#include "veloxquant/store/kv_store.hpp"

namespace vq {

// A sealed blob this store cannot vouch for: sealed under another secret (or its tag forged), or
// sealed while this store has no secret. Index writers never overwrite such a blob (a writer with a
// wrong secret would otherwise replace the index every other writer shares); corrupt and unsealed
// blobs stay plain FormatErrors, which a put replaces.
class StoreAuthError : public FormatError {
 public:
  using FormatError::FormatError;
};

struct StoreGuards {
  std::optional<std::string> secret;     // unset: no MAC
  std::optional<std::string> name_space; // unset: the store's plain keys
};

class SealedStore : public KVStore {
 public:
  // `inner`: the backend. No guard: blobs pass as they are, but a sealed one is refused with a
  // message that says the store has a secret (open_store always wraps its backend so). An empty
  // secret or namespace is InvalidArgument.
  SealedStore(std::unique_ptr<KVStore> inner, const StoreGuards& guards);

  void put(std::string_view key, std::span<const std::uint8_t> blob) override;
  void replace(std::string_view key, std::span<const std::uint8_t> blob) override;
  std::optional<Blob> get(std::string_view key) override;
  std::vector<std::optional<Blob>> get_many(std::span<const std::string> keys) override;
  std::optional<Blob> get_at_most(std::string_view key, std::uint64_t max_bytes) override;
  std::vector<std::optional<Blob>> get_many_at_most(std::span<const std::string> keys, std::uint64_t max_bytes) override;
  std::optional<Blob> get_immutable_at_most(std::string_view key, std::uint64_t max_bytes) override;
  bool exists(std::string_view key) override;
  bool remove(std::string_view key) override;
  std::vector<std::string> list() override;  // with a namespace: its keys only, as stored
  StoreStats stats() override;
  std::string describe() const override;
  void mark_used(std::span<const std::string> keys) override;
  void hold_eviction(bool hold) override { inner_->hold_eviction(hold); }
  void set_deadline(std::optional<std::chrono::steady_clock::time_point> until) override { inner_->set_deadline(until); }

  // The key a plain key is stored under (itself without a namespace).
  std::string stored_key(std::string_view key) const;

 private:
  Blob seal(const std::string& stored, std::span<const std::uint8_t> blob) const;
  Blob open(const std::string& stored, Blob sealed) const;

  std::unique_ptr<KVStore> inner_;
  bool mac_ = false;
  std::array<unsigned char, 32> mac_key_{};
  bool ns_ = false;
  std::array<unsigned char, 32> ns_key_{};
  std::string ns_prefix_;  // "vq-ns<8 hex>-"
};

// Splits the guard options (secret=, namespace=) off a store URL's query, falling back to the
// environment (VQ_STORE_SECRET, VQ_STORE_NAMESPACE): the URL left for the backend, and the guards.
std::pair<std::string, StoreGuards> split_store_guards(const std::string& url);

}  // namespace vq
