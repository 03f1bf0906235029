#include "atomic_file.hpp"

#include <cerrno>
#include <cstring>
#include <unistd.h>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq::format_detail {

AtomicFile::AtomicFile(const std::string& path) : target_(path) {
  require(!path.empty(), "empty output path");
  tmp_ = target_.parent_path() / fmt::format(".{}.tmp.{}", target_.filename().string(), ::getpid());
  f_ = std::fopen(tmp_.c_str(), "wb");
  if (!f_) throw IoError(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
}

AtomicFile::~AtomicFile() {
  if (f_) std::fclose(f_);
  if (!committed_) {
    std::error_code ec;
    std::filesystem::remove(tmp_, ec);
  }
}

void AtomicFile::fail(const std::string& what) const {
  throw IoError(fmt::format("cannot {} {}: {}", what, target_.string(), std::strerror(errno)));
}

void AtomicFile::write(std::span<const std::uint8_t> bytes) {
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f_) != bytes.size()) fail("write");
}

void AtomicFile::commit() {
  if (std::fflush(f_) != 0 || ::fsync(::fileno(f_)) != 0) fail("write");
  const int rc = std::fclose(f_);
  f_ = nullptr;
  if (rc != 0) fail("write");
  if (std::rename(tmp_.c_str(), target_.c_str()) != 0) fail("rename a temporary file onto");
  committed_ = true;
}

}  // namespace vq::format_detail
