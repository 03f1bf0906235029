// mode_of: a path's lstat mode (file type and permission bits, the link itself for a symlink), for
// tests of what files the library and the CLI write. A failed lstat is a test failure (and 0).
#pragma once
#include <sys/stat.h>

#include <string>

#include <gtest/gtest.h>

namespace vqtest {

inline mode_t mode_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode;
}

}  // namespace vqtest
