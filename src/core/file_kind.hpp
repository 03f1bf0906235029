// Private to the core stage: what a stat() mode is, in words, for error messages about files that
// are not regular files ("a directory", "a FIFO", ...).
#pragma once
#include <sys/stat.h>

namespace vq::core_detail {

inline const char* file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

}  // namespace vq::core_detail
