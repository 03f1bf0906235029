#include "veloxquant/core/npy.hpp"

#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "../support/test_util.hpp"

namespace {

std::string path(const std::string& name) { return vqtest::temp_dir() + "/" + name; }

using vqtest::slurp;
using vqtest::spit;

TEST(Npy, RoundTripF32AndF16) {
  for (auto dt : {vq::DType::F32, vq::DType::F16}) {
    auto t = vqtest::random_uniform({2, 3, 5, 7}, 9, dt);
    const auto p = path("rt.npy");
    vq::write_npy(p, t.slice(2, 1, 4));  // a non-contiguous view
    auto r = vq::read_npy(p);
    EXPECT_TRUE(r.bit_equal(t.slice(2, 1, 4)));
    const auto bytes = slurp(p);
    EXPECT_EQ(bytes.substr(0, 6), "\x93NUMPY");
    EXPECT_EQ((bytes.size() - r.nbytes()) % 64, 0u);  // data aligned as numpy does
  }
}

TEST(Npy, EmptyTokenAxis) {
  auto t = vq::Tensor::zeros({1, 2, 0, 4}, vq::DType::F32);
  vq::write_npy(path("empty.npy"), t);
  EXPECT_EQ(vq::read_npy(path("empty.npy")).shape(), (vq::Shape4{1, 2, 0, 4}));
}

TEST(Npy, RejectsBadFiles) {
  auto t = vqtest::random_uniform({1, 2, 3, 4}, 1);
  vq::write_npy(path("good.npy"), t);
  const std::string good = slurp(path("good.npy"));

  EXPECT_THROW(vq::read_npy(path("does_not_exist.npy")), vq::IoError);
  spit(path("trunc.npy"), good.substr(0, good.size() - 1));
  EXPECT_THROW(vq::read_npy(path("trunc.npy")), vq::FormatError);
  spit(path("long.npy"), good + "x");
  EXPECT_THROW(vq::read_npy(path("long.npy")), vq::FormatError);
  spit(path("short.npy"), good.substr(0, 9));
  EXPECT_THROW(vq::read_npy(path("short.npy")), vq::FormatError);
  std::string magic = good;
  magic[1] = 'X';
  spit(path("magic.npy"), magic);
  EXPECT_THROW(vq::read_npy(path("magic.npy")), vq::FormatError);
  std::string ver = good;
  ver[6] = 9;
  spit(path("ver.npy"), ver);
  EXPECT_THROW(vq::read_npy(path("ver.npy")), vq::FormatError);
  std::string hlen = good;
  hlen[8] = '\xff';
  hlen[9] = '\x7f';
  spit(path("hlen.npy"), hlen);
  EXPECT_THROW(vq::read_npy(path("hlen.npy")), vq::FormatError);

  auto replace = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const auto at = s.find(from);
    EXPECT_NE(at, std::string::npos);
    s.replace(at, from.size(), to);
    return s;
  };
  spit(path("i32.npy"), replace("'<f4'", "'<i4'"));
  EXPECT_THROW(vq::read_npy(path("i32.npy")), vq::FormatError);
  spit(path("be.npy"), replace("'<f4'", "'>f4'"));
  EXPECT_THROW(vq::read_npy(path("be.npy")), vq::FormatError);
  spit(path("fortran.npy"), replace("False", "True "));
  EXPECT_THROW(vq::read_npy(path("fortran.npy")), vq::FormatError);
  spit(path("rank3.npy"), replace("(1, 2, 3, 4)", "(2, 3, 4)   "));
  EXPECT_THROW(vq::read_npy(path("rank3.npy")), vq::FormatError);
  spit(path("absurd.npy"), replace("(1, 2, 3, 4)", "(1, 2, 3, 99999999999999)"));
  EXPECT_THROW(vq::read_npy(path("absurd.npy")), vq::FormatError);
  spit(path("garbage.npy"), replace("(1, 2, 3, 4)", "(1, 2, x, 4)"));
  EXPECT_THROW(vq::read_npy(path("garbage.npy")), vq::FormatError);
}

// A version 1.0 .npy with this shape text and data bytes.
std::string npy_with_shape(const std::string& shape, std::size_t data_bytes) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  return out + header + std::string(data_bytes, '\0');
}

// Shapes are non-negative integers whose non-zero product fits: a zero dimension beside huge ones
// holds no data, so the data size cannot catch it, and its strides would overflow.
TEST(Npy, RefusesShapesThatAreNotSmallNonNegativeIntegers) {
  spit(path("ok.npy"), npy_with_shape("(1, 2, 0, 4)", 0));
  EXPECT_EQ(vq::read_npy(path("ok.npy")).shape(), (vq::Shape4{1, 2, 0, 4}));
  for (const auto& [shape, fragment] : std::vector<std::pair<std::string, std::string>>{
           {"(0, 999999999999, 999999999999, 999999999999)", "multiplies past 2^63 bytes"},
           {"(1, 4294967296, 0, 4294967296)", "multiplies past 2^63 bytes"},
           {"(1, 2, 1.5, 4)", "cannot parse shape"},
           {"(1, 2, -3, 4)", "cannot parse shape"},
           {"(1, 2, 1e3, 4)", "cannot parse shape"}}) {
    SCOPED_TRACE(shape);
    spit(path("shape.npy"), npy_with_shape(shape, 0));
    try {
      (void)vq::read_npy(path("shape.npy"));
      ADD_FAILURE() << "no error";
    } catch (const vq::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  }
}

TEST(Npy, RefusesBf16) {
  auto t = vq::Tensor::zeros({1, 1, 1, 2}, vq::DType::BF16);
  EXPECT_THROW(vq::write_npy(path("bf.npy"), t), vq::InvalidArgument);
}

TEST(Npy, WriteToMissingDirectoryIsIoError) {
  auto t = vq::Tensor::zeros({1, 1, 1, 2}, vq::DType::F32);
  EXPECT_THROW(vq::write_npy("/nonexistent-dir/x.npy", t), vq::IoError);
}

}  // namespace
