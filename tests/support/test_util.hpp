// Shared helpers for the GoogleTest suite.
#pragma once
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <system_error>
#include <array>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "veloxquant/core/tensor.hpp"

namespace vqtest {

// A random-walk tensor (correlated along tokens, as real KV is), deterministic for a seed.
inline vq::Tensor random_walk(const vq::Shape4& shape, std::uint64_t seed, vq::DType dtype = vq::DType::F32, float step = 0.1f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(shape[0] * shape[1] * shape[2] * shape[3]));
  const auto S = shape[2], D = shape[3];
  for (std::int64_t bh = 0; bh < shape[0] * shape[1]; ++bh)
    for (std::int64_t d = 0; d < D; ++d) {
      float x = n(rng);
      for (std::int64_t s = 0; s < S; ++s) {
        x += step * n(rng);
        v[static_cast<std::size_t>((bh * S + s) * D + d)] = x;
      }
    }
  return vq::Tensor::from_f32(shape, v, dtype);
}

// I.i.d. uniform values in [-1, 1).
inline vq::Tensor random_uniform(const vq::Shape4& shape, std::uint64_t seed, vq::DType dtype = vq::DType::F32) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(shape[0] * shape[1] * shape[2] * shape[3]));
  for (auto& x : v) x = u(rng);
  return vq::Tensor::from_f32(shape, v, dtype);
}

// Row-major [S, D] floats of slice (b, h) of a tensor.
inline std::vector<float> slice_f32(const vq::Tensor& t, std::int64_t b, std::int64_t h) {
  return t.slice(0, b, b + 1).slice(1, h, h + 1).to_f32_vector();
}

// A whole file's bytes ("" when it cannot be read), and a file written with exactly `bytes`.
inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
inline void spit(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

// This test process's own scratch directory, made on first use and removed with everything in it
// when the process exits (ctest runs every test in a process of its own: without the removal each
// run left hundreds of /tmp/vq_test_* behind).
inline std::string temp_dir() {
  struct Dir {
    std::string path;
    bool made = false;
    Dir() {
      char tmpl[] = "/tmp/vq_test_XXXXXX";
      const char* d = mkdtemp(tmpl);
      made = d != nullptr;
      path = made ? d : "/tmp";
    }
    ~Dir() {
      std::error_code ec;
      if (made) std::filesystem::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

struct CliRun {
  int code = -1;
  std::string out, err;
};

// Run a shell command line; stdout is captured, stderr goes through a file of this process's own.
inline CliRun run_shell(const std::string& command) {
  const std::string err_path = temp_dir() + "/cli_stderr.txt";
  CliRun r;
  FILE* p = popen((command + " 2>" + err_path).c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  std::size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream e(err_path);
  r.err.assign(std::istreambuf_iterator<char>(e), {});
  return r;
}

// The largest |a - b| over two tensors' elements (as float32), and in `mag` the largest |b|.
inline double max_abs_diff(const vq::Tensor& a, const vq::Tensor& b, double& mag) {
  const auto x = a.to_f32_vector(), y = b.to_f32_vector();
  double diff = 0;
  mag = 0;
  for (std::size_t i = 0; i < x.size(); ++i) diff = std::max(diff, std::fabs(double(x[i]) - y[i])), mag = std::max(mag, std::fabs(double(y[i])));
  return diff;
}

// Run the built veloxquant binary with `args`.
inline CliRun run_cli(const std::string& args) { return run_shell(std::string(VQ_CLI_PATH) + " " + args); }

}  // namespace vqtest
