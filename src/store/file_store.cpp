// FileStore: one file per blob, written atomically; LRU eviction by modification time.
#include "veloxquant/store/file_store.hpp"

#include <sys/stat.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <system_error>

#include <fmt/core.h>

#include "veloxquant/core/atomic_file.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/format/vqkv.hpp"

namespace vq {

namespace fs = std::filesystem;

namespace {
constexpr char kHex[] = "0123456789abcdef";

std::string hex_name(std::string_view key) {
  std::string out;
  out.reserve(key.size() * 2);
  for (const char c : key) {
    const auto u = static_cast<unsigned char>(c);
    out += kHex[u >> 4];
    out += kHex[u & 15];
  }
  return out;
}

// The key a blob file name encodes, or nullopt for a name that is not one of ours (a temporary).
std::optional<std::string> key_of_name(const std::string& name) {
  if (name.empty() || name.size() % 2 != 0 || name.size() > 2 * kMaxStoreKeyBytes) return std::nullopt;
  std::string key;
  for (std::size_t i = 0; i < name.size(); i += 2) {
    int v = 0;
    for (int j = 0; j < 2; ++j) {
      const char c = name[i + j];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return std::nullopt;
      v = v * 16 + d;
    }
    key += static_cast<char>(v);
  }
  return key;
}
}  // namespace

FileStore::FileStore(fs::path dir, std::uint64_t capacity) : dir_(std::move(dir)), blobs_(dir_ / "blobs"), capacity_(capacity) {
  std::error_code ec;
  // A dangling symbolic link reads as "File exists" from create_directories: say what it is.
  if (std::error_code lc; fs::is_symlink(dir_, lc) && !fs::exists(dir_, lc))
    throw IoError(fmt::format("store file:{}: it is a symbolic link to {}, which does not exist", dir_.string(),
                              fs::read_symlink(dir_, lc).string()));
  fs::create_directories(blobs_, ec);
  if (ec || !fs::is_directory(blobs_))
    throw IoError(fmt::format("store file:{}: cannot create directory {}: {}", dir_.string(), blobs_.string(),
                              ec ? ec.message() : "not a directory"));
}

fs::path FileStore::blob_path(std::string_view key) const {
  check_store_key(key);
  return blobs_ / hex_name(key);
}

std::string FileStore::describe() const {
  return capacity_ ? fmt::format("file:{}?capacity={}", dir_.string(), capacity_) : "file:" + dir_.string();
}

void FileStore::put(std::string_view key, std::span<const std::uint8_t> blob) { write(key, blob, true); }

// The rename of write_file_atomically replaces an existing file in one step.
void FileStore::replace(std::string_view key, std::span<const std::uint8_t> blob) { write(key, blob, false); }

void FileStore::write(std::string_view key, std::span<const std::uint8_t> blob, bool keep_existing) {
  const fs::path p = blob_path(key);
  if (capacity_ && blob.size() > capacity_)
    throw IoError(fmt::format("store {}: blob '{}' of {} bytes exceeds the capacity of {} bytes", describe(), std::string(key),
                              blob.size(), capacity_));
  std::error_code ec;
  if (keep_existing && fs::exists(p, ec)) return;  // immutable: the first complete writer wins, later ones are no-ops
  write_file_atomically(p.string(), blob);
  if (capacity_ && held_.load() == 0) evict_to_capacity();
}

void FileStore::mark_used(std::span<const std::string> keys) {
  if (!capacity_ || keys.empty()) return;
  // Explicit times, a microsecond apart, the first newest: the order survives coarse clocks.
  struct timespec now {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  const std::int64_t base = static_cast<std::int64_t>(now.tv_sec) * 1000000 + now.tv_nsec / 1000;
  for (std::size_t j = 0; j < keys.size(); ++j) {
    const std::int64_t us = base - static_cast<std::int64_t>(j);
    struct timespec t[2];
    t[0].tv_sec = t[1].tv_sec = static_cast<time_t>(us / 1000000);
    t[0].tv_nsec = t[1].tv_nsec = static_cast<long>(us % 1000000) * 1000;
    ::utimensat(AT_FDCWD, blob_path(keys[j]).c_str(), t, 0);  // a blob evicted meanwhile: nothing to mark
  }
}

void FileStore::hold_eviction(bool hold) {
  if (hold) {
    ++held_;
    return;
  }
  if (--held_ == 0 && capacity_) evict_to_capacity();
}

std::optional<Blob> FileStore::get(std::string_view key) { return get_at_most(key, UINT64_MAX); }

std::optional<Blob> FileStore::get_at_most(std::string_view key, std::uint64_t max_bytes) {
  const fs::path p = blob_path(key);
  // One open, then its size from the open file (no race with a replace between a stat and the read).
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;  // missing, or evicted or removed by another process meanwhile
    throw IoError(fmt::format("store {}: cannot open blob '{}': {}", describe(), std::string(key), std::strerror(errno)));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw IoError(fmt::format("store {}: cannot stat blob '{}': {}", describe(), std::string(key), std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) throw FormatError(fmt::format("store {}: blob '{}' is not a regular file", describe(), std::string(key)));
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes) throw_blob_too_large(describe(), key, size, max_bytes);
  Blob bytes(size);
  std::size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(fmt::format("store {}: cannot read blob '{}': {}", describe(), std::string(key), std::strerror(errno)));
    if (n == 0) throw FormatError(fmt::format("store {}: blob '{}' ended after {} of its {} bytes", describe(), std::string(key), got, size));
    got += static_cast<std::size_t>(n);
  }
  // Mark it used (LRU): the modification time is recency, visible to every process.
  if (capacity_) ::utimensat(AT_FDCWD, p.c_str(), nullptr, 0);
  return bytes;
}

bool FileStore::exists(std::string_view key) {
  std::error_code ec;
  return fs::exists(blob_path(key), ec);
}

bool FileStore::remove(std::string_view key) {
  std::error_code ec;
  const bool removed = fs::remove(blob_path(key), ec);
  if (ec) throw IoError(fmt::format("store {}: cannot remove '{}': {}", describe(), std::string(key), ec.message()));
  return removed;
}

std::vector<std::string> FileStore::list() {
  std::vector<std::string> keys;
  std::error_code ec;
  for (fs::directory_iterator it(blobs_, ec), end; !ec && it != end; it.increment(ec))
    if (auto k = key_of_name(it->path().filename().string())) keys.push_back(std::move(*k));
  if (ec) throw IoError(fmt::format("store {}: cannot list {}: {}", describe(), blobs_.string(), ec.message()));
  std::sort(keys.begin(), keys.end());
  return keys;
}

StoreStats FileStore::stats() {
  StoreStats s;
  s.backend = "file";
  s.capacity = capacity_;
  for (const auto& k : list()) {
    std::error_code ec;
    const auto n = fs::file_size(blob_path(k), ec);
    if (ec) continue;  // removed meanwhile
    ++s.blobs;
    s.bytes += n;
  }
  return s;
}

void FileStore::evict_to_capacity() {
  std::lock_guard lock(evict_mutex_);
  struct Entry {
    fs::path path;
    std::uint64_t bytes;
    struct timespec mtime;
  };
  std::vector<Entry> entries;
  std::uint64_t total = 0;
  std::error_code ec;
  for (fs::directory_iterator it(blobs_, ec), end; !ec && it != end; it.increment(ec)) {
    if (!key_of_name(it->path().filename().string())) continue;
    struct stat st {};
    if (::stat(it->path().c_str(), &st) != 0) continue;
    entries.push_back({it->path(), static_cast<std::uint64_t>(st.st_size), st.st_mtim});
    total += static_cast<std::uint64_t>(st.st_size);
  }
  if (total <= capacity_) return;
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    if (a.mtime.tv_sec != b.mtime.tv_sec) return a.mtime.tv_sec < b.mtime.tv_sec;
    if (a.mtime.tv_nsec != b.mtime.tv_nsec) return a.mtime.tv_nsec < b.mtime.tv_nsec;
    return a.path < b.path;
  });
  for (const auto& e : entries) {
    if (total <= capacity_) break;
    if (fs::remove(e.path, ec)) total -= e.bytes;  // another process may have evicted it already
  }
}

}  // namespace vq
