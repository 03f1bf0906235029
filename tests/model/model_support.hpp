// Shared helpers for the model tests: paths of the shared stories260K files, and file I/O.
#pragma once
#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include <fstream>
#include <iterator>
#include <string>

namespace vqtest {

// The message of the InvalidArgument that MethodSpec::parse throws for `spec` ("" if it parses).
inline std::string spec_error(const std::string& spec) {
  try {
    vq::MethodSpec::parse(spec);
  } catch (const vq::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

inline std::string models_dir() { return std::string(VQ_SOURCE_DIR) + "/../shared/models"; }
inline std::string model_path() { return models_dir() + "/stories260K.bin"; }
inline std::string tokenizer_path() { return models_dir() + "/tok512.bin"; }

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The greedy sample of stories260K.md: the text between the fences after "./run ... -t 0.0".
inline std::string expected_greedy_sample() {
  const std::string md = read_file(models_dir() + "/stories260K.md");
  const std::string marker = "-t 0.0\n";
  const auto start = md.find(marker);
  if (start == std::string::npos) return {};
  const auto end = md.find("```", start);
  return md.substr(start + marker.size(), end - start - marker.size());
}

}  // namespace vqtest
