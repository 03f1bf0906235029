// Private to the format stage: write a file atomically. Bytes go to a temporary file beside the
// target (same directory, so the same file system); commit() flushes it to disk and renames it over
// the target. Destroyed without commit() (an exception, an interrupted save), it removes the
// temporary: the target is either the old file or the complete new one, never a partial one.
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <span>
#include <string>

namespace vq::format_detail {

class AtomicFile {
 public:
  explicit AtomicFile(const std::string& path);  // throws IoError
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(std::span<const std::uint8_t> bytes);  // throws IoError
  void commit();                                    // throws IoError

 private:
  std::filesystem::path target_, tmp_;
  std::FILE* f_ = nullptr;
  bool committed_ = false;
  [[noreturn]] void fail(const std::string& what) const;
};

}  // namespace vq::format_detail
