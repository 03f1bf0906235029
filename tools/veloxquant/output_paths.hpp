// Checks on the output paths a subcommand is given, before it computes anything.
#pragma once
#include <filesystem>
#include <string>
#include <system_error>

#include "veloxquant/core/error.hpp"

namespace vqcli {

// Whether two paths name one file: the same path once symbolic links and `..` are resolved, or
// two names (hard links) of one existing file.
inline bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (std::filesystem::equivalent(a, b, ec) && !ec) return true;
  std::error_code ea, eb;
  const auto ca = std::filesystem::weakly_canonical(std::filesystem::absolute(a, ea), ea);
  const auto cb = std::filesystem::weakly_canonical(std::filesystem::absolute(b, eb), eb);
  return !ea && !eb && ca == cb;
}

// Two outputs of one run must be two files: the second would silently replace the first.
inline void require_distinct_outputs(const std::string& a, const char* flag_a, const std::string& b, const char* flag_b) {
  vq::require(!same_file(a, b), "{} {} and {} {} name the same file: give two different paths", flag_a, a, flag_b, b);
}

}  // namespace vqcli
