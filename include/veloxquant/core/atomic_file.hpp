// The one way veloxquant writes a file: atomically. Bytes go to a temporary file created
// exclusively (O_CREAT|O_EXCL|O_NOFOLLOW, a random name) in the destination's directory, so on the
// same file system; commit() flushes it to disk and renames it over the destination. Destroyed
// without commit() (an exception, an interrupted save), it removes the temporary: the destination
// is either the old file or the complete new one, never a partial one.
//
// The destination:
//  - missing: created, with the usual permissions (0666 less the umask);
//  - a regular file: replaced, keeping its permission bits (0777 part) and, where the process may
//    (root), its owner and group; refused when the process may not write it;
//  - a symbolic link: followed to its final target, which must be a regular file; the target is
//    replaced (the temporary goes in the target's directory) and the link stays a link. A dangling
//    link is refused rather than written through;
//  - anything else (a directory, a character or block device such as /dev/null, a FIFO, a socket):
//    refused with an IoError that says what it is.
//
// Termination signals: remove_temporaries_on_signals() (the CLI calls it first thing) makes
// SIGINT, SIGTERM and SIGHUP remove every live temporary before the process dies of the signal.
#pragma once
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

namespace vq {

class AtomicFile {
 public:
  explicit AtomicFile(const std::string& path);  // throws IoError (InvalidArgument for an empty path or a NUL byte)
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(std::span<const std::uint8_t> bytes);  // throws IoError
  void write(std::string_view text);                // throws IoError
  void commit();                                    // throws IoError

  // The file that commit() replaces: the path given, or a symbolic link's final target.
  const std::filesystem::path& target() const { return target_; }
  // The temporary file (for tests).
  const std::filesystem::path& temporary() const { return tmp_; }

 private:
  std::string path_;  // as given, for messages
  std::filesystem::path target_, tmp_;
  int fd_ = -1;
  int slot_ = -1;  // in the signal handler's registry of live temporaries
  bool committed_ = false;
  [[noreturn]] void fail(const char* what) const;
};

// Write `bytes` (or `text`) to `path` through an AtomicFile.
void write_file_atomically(const std::string& path, std::span<const std::uint8_t> bytes);
void write_file_atomically(const std::string& path, std::string_view text);

// Install handlers for SIGINT, SIGTERM and SIGHUP that unlink every live AtomicFile temporary and
// then re-raise the signal with its default action (so the exit status still says which signal).
// A signal the process ignores (nohup's SIGHUP) stays ignored. Call once, early, from a program's
// main; a library must not (the Python module leaves Python's handlers alone).
void remove_temporaries_on_signals();

}  // namespace vq
