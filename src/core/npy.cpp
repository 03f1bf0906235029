#include "veloxquant/core/npy.hpp"

#include <cstring>
#include <limits>
#include <regex>

#include <fmt/format.h>

#include "veloxquant/core/atomic_file.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/input_file.hpp"

namespace vq {

namespace {

constexpr char kMagic[] = "\x93NUMPY";

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw FormatError(fmt::format("{}: not a valid .npy file: {}", path, what));
}

std::string header_value(const std::string& header, const std::string& key, const std::string& path) {
  // The header is a Python dict literal; find 'key': and take the text up to the next top-level
  // comma or closing brace (tuples are kept whole).
  const std::string k1 = "'" + key + "'";
  auto pos = header.find(k1);
  if (pos == std::string::npos) bad(path, "header has no '" + key + "' entry");
  pos = header.find(':', pos + k1.size());
  if (pos == std::string::npos) bad(path, "header entry '" + key + "' has no value");
  ++pos;
  int depth = 0;
  std::string out;
  for (; pos < header.size(); ++pos) {
    const char c = header[pos];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (depth == 0 && (c == ',' || c == '}')) break;
    out += c;
  }
  const auto b = out.find_first_not_of(" \t");
  const auto e = out.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : out.substr(b, e - b + 1);
}

}  // namespace

Tensor read_npy(const std::string& path) {
  InputFile in(path);
  const std::uint64_t file_size = in.size();

  char pre[8];
  if (file_size < 10 || !in.read(pre, 8)) bad(path, "file is too short");
  if (std::memcmp(pre, kMagic, 6) != 0) bad(path, "wrong magic (expected \\x93NUMPY)");
  const int major = static_cast<unsigned char>(pre[6]);
  std::uint64_t header_len = 0;
  std::uint64_t prefix = 0;
  if (major == 1) {
    unsigned char l[2];
    if (!in.read(reinterpret_cast<char*>(l), 2)) bad(path, "truncated header length");
    header_len = l[0] | (l[1] << 8);
    prefix = 10;
  } else if (major == 2 || major == 3) {
    unsigned char l[4];
    if (!in.read(reinterpret_cast<char*>(l), 4)) bad(path, "truncated header length");
    header_len = l[0] | (l[1] << 8) | (l[2] << 16) | (static_cast<std::uint64_t>(l[3]) << 24);
    prefix = 12;
  } else {
    bad(path, fmt::format("unsupported format version {}.{}", major, static_cast<int>(pre[7])));
  }
  if (header_len > 1 << 20 || prefix + header_len > file_size) bad(path, "header length points past the end of the file");
  std::string header(header_len, '\0');
  if (!in.read(header.data(), static_cast<std::size_t>(header_len))) bad(path, "truncated header");

  const std::string descr = header_value(header, "descr", path);
  DType dtype;
  if (descr == "'<f4'" || descr == "'=f4'") {
    dtype = DType::F32;
  } else if (descr == "'<f2'" || descr == "'=f2'") {
    dtype = DType::F16;
  } else {
    bad(path, "dtype " + descr + " is not supported (expected little-endian float32 '<f4' or float16 '<f2')");
  }
  if (header_value(header, "fortran_order", path) != "False") bad(path, "Fortran-order arrays are not supported (save with C order)");

  const std::string shape_text = header_value(header, "shape", path);
  static const std::regex shape_re(R"(^\(\s*(\d+\s*(,\s*\d+\s*)*,?)?\s*\)$)");
  if (!std::regex_match(shape_text, shape_re)) bad(path, "cannot parse shape " + shape_text);
  std::vector<std::int64_t> dims;
  static const std::regex num_re(R"(\d+)");
  for (auto it = std::sregex_iterator(shape_text.begin(), shape_text.end(), num_re); it != std::sregex_iterator(); ++it) {
    const std::string s = it->str();
    if (s.size() > 12) bad(path, "absurd dimension " + s);
    dims.push_back(std::stoll(s));
  }
  if (dims.size() != 4) bad(path, fmt::format("expected a rank-4 array [B, H, S, D], got rank {} shape {}", dims.size(), shape_text));
  const Shape4 shape{dims[0], dims[1], dims[2], dims[3]};
  // The non-zero dimensions' product bounds every stride and byte count, also beside a zero
  // dimension (where the data size says nothing): refuse it past 2^63 bytes.
  unsigned __int128 nonzero = dtype_size(dtype);
  for (const auto d : dims)
    if (d > 0 && (nonzero *= static_cast<std::uint64_t>(d)) > static_cast<unsigned __int128>(std::numeric_limits<std::int64_t>::max()))
      bad(path, fmt::format("shape {} multiplies past 2^63 bytes", shape_text));

  long double expect = dtype_size(dtype);
  for (auto d : dims) expect *= static_cast<long double>(d);
  const std::uint64_t data_bytes = file_size - prefix - header_len;
  if (expect != static_cast<long double>(data_bytes))
    bad(path, fmt::format("shape {} {} needs {} data bytes but the file holds {}", shape_string(shape), dtype_name(dtype),
                          static_cast<unsigned long long>(expect), data_bytes));

  Tensor t = Tensor::zeros(shape, dtype);
  if (data_bytes > 0 && !in.read(t.row(0, 0, 0), static_cast<std::size_t>(data_bytes)))
    bad(path, "truncated data");
  return t;
}

void write_npy(const std::string& path, const Tensor& tensor) {
  std::string descr;
  if (tensor.dtype() == DType::F32) {
    descr = "<f4";
  } else if (tensor.dtype() == DType::F16) {
    descr = "<f2";
  } else {
    throw InvalidArgument(fmt::format("{}: .npy has no bfloat16 dtype; convert to float32 first", path));
  }
  const auto& s = tensor.shape();
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}, {}, {}, {}), }}", descr, s[0], s[1], s[2], s[3]);
  // Pad so that the data starts on a 64-byte boundary; the header ends with '\n'.
  const std::size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';

  AtomicFile out(path);
  out.write(std::string_view(kMagic, 6));
  const char ver[2] = {1, 0};
  out.write(std::string_view(ver, 2));
  const char len[2] = {static_cast<char>(header.size() & 0xff), static_cast<char>(header.size() >> 8)};
  out.write(std::string_view(len, 2));
  out.write(header);
  const Tensor c = tensor.contiguous();
  if (!c.empty()) out.write({reinterpret_cast<const std::uint8_t*>(c.row(0, 0, 0)), c.nbytes()});
  out.commit();
}

}  // namespace vq
