#include "veloxquant/format/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <regex>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "veloxquant/core/atomic_file.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/format/vqkv.hpp"

namespace vq {

namespace {

// A JSON header larger than this is not a KV file (the reference implementation caps it at 100 MB).
constexpr std::uint64_t kMaxHeader = 100u << 20;

const char* st_dtype(DType d) { return d == DType::F32 ? "F32" : d == DType::F16 ? "F16" : "BF16"; }

[[noreturn]] void bad(const std::string& path, const std::string& why) { throw FormatError(fmt::format("{}: not a valid safetensors file: {}", path, why)); }

// A JSON array of non-negative integers, each exactly as written: nlohmann's get<> would turn 40.5
// into 40 and -1 into 2^64 - 1.
std::vector<std::uint64_t> unsigned_list(const std::string& path, const std::string& name, const char* field, const nlohmann::json& j) {
  if (!j.is_array()) bad(path, fmt::format("tensor '{}' has a {} that is not a list", name, field));
  std::vector<std::uint64_t> out;
  for (const auto& v : j) {
    if (!v.is_number_unsigned()) bad(path, fmt::format("tensor '{}' has {} {} (entries must be non-negative integers)", name, field, j.dump()));
    out.push_back(v.get<std::uint64_t>());
  }
  return out;
}

}  // namespace

std::map<std::string, Tensor> read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  const std::vector<std::uint8_t> file = read_file_bytes(path);
  if (file.size() < 8) bad(path, "shorter than its 8-byte header length");
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(file[static_cast<std::size_t>(i)]) << (8 * i);
  if (n > kMaxHeader || n > file.size() - 8) bad(path, fmt::format("header length {} runs past the end of the file", n));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(file.begin() + 8, file.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  } catch (const nlohmann::json::exception& e) {
    bad(path, fmt::format("header is not JSON ({})", e.what()));
  }
  if (!header.is_object()) bad(path, "header is not a JSON object");
  const std::uint64_t data_size = file.size() - 8 - n;
  const std::uint8_t* data = file.data() + 8 + n;
  std::map<std::string, Tensor> out;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) bad(path, "__metadata__ is not an object");
      for (const auto& [k, v] : info.items()) {
        if (!v.is_string()) bad(path, fmt::format("__metadata__ value of '{}' is not a string", k));
        if (metadata) (*metadata)[k] = v.get<std::string>();
      }
      continue;
    }
    try {
      const std::string dt = info.at("dtype").get<std::string>();
      DType dtype;
      if (dt == "F32") dtype = DType::F32;
      else if (dt == "F16") dtype = DType::F16;
      else if (dt == "BF16") dtype = DType::BF16;
      else bad(path, fmt::format("tensor '{}' has dtype {} (KV tensors are F32, F16 or BF16)", name, dt));
      const auto shape = unsigned_list(path, name, "shape", info.at("shape"));
      if (shape.size() != 4) bad(path, fmt::format("tensor '{}' has rank {} (KV tensors are [B, H, S, D])", name, shape.size()));
      // Each dimension is bounded, and so is the product of the non-zero ones (what strides and
      // byte counts multiply, also beside a zero dimension), so neither can overflow.
      unsigned __int128 bytes = dtype_size(dtype), nonzero = dtype_size(dtype);
      for (const auto d : shape) {
        if (d > (std::uint64_t{1} << 32)) bad(path, fmt::format("tensor '{}' has a dimension of {}", name, d));
        bytes *= d;
        if (d > 0) nonzero *= d;
        if (nonzero > static_cast<unsigned __int128>(std::numeric_limits<std::int64_t>::max()))
          bad(path, fmt::format("tensor '{}' has shape [{}]: its dimensions multiply past 2^63 bytes", name, fmt::join(shape, ", ")));
      }
      const auto offs = unsigned_list(path, name, "data_offsets", info.at("data_offsets"));
      if (offs.size() != 2 || offs[0] > offs[1] || offs[1] > data_size)
        bad(path, fmt::format("tensor '{}' has data offsets outside the {} bytes of data", name, data_size));
      if (bytes != offs[1] - offs[0])
        bad(path, fmt::format("tensor '{}' holds {} bytes but its shape needs {}", name, offs[1] - offs[0], static_cast<std::uint64_t>(bytes)));
      spans.emplace_back(offs[0], offs[1]);
      Tensor t = Tensor::uninitialized({static_cast<std::int64_t>(shape[0]), static_cast<std::int64_t>(shape[1]),
                                        static_cast<std::int64_t>(shape[2]), static_cast<std::int64_t>(shape[3])},
                                       dtype);
      if (t.nbytes()) std::memcpy(t.row(0, 0, 0), data + offs[0], t.nbytes());
      out.emplace(name, std::move(t));
    } catch (const nlohmann::json::exception& e) {
      bad(path, fmt::format("tensor '{}' has a malformed entry ({})", name, e.what()));
    }
  }
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second) bad(path, "two tensors overlap");
  return out;
}

void write_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t at = 0;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", st_dtype(t.dtype())},
                    {"shape", {t.dim(0), t.dim(1), t.dim(2), t.dim(3)}},
                    {"data_offsets", {at, at + t.nbytes()}}};
    at += t.nbytes();
  }
  // The header is JSON, whose strings are Unicode: metadata bytes that are not UTF-8 (a .vqkv's
  // metadata is bytes) become U+FFFD rather than an exception from dump().
  std::string json = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  json.append((8 - json.size() % 8) % 8, ' ');  // data starts 8-byte aligned, as the reference writer does
  std::vector<std::uint8_t> prefix(8);
  for (int i = 0; i < 8; ++i) prefix[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(json.size()) >> (8 * i));
  AtomicFile out(path);
  out.write(prefix);
  out.write({reinterpret_cast<const std::uint8_t*>(json.data()), json.size()});
  for (const auto& [name, t] : tensors) {
    const Tensor c = t.contiguous();
    if (c.nbytes()) out.write({reinterpret_cast<const std::uint8_t*>(c.row(0, 0, 0)), c.nbytes()});
  }
  out.commit();
}

std::vector<KVPair> read_kv_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  std::map<std::string, Tensor> all = read_safetensors(path, metadata);
  static const std::regex name_re(R"(layers\.(0|[1-9][0-9]{0,5})\.(keys|values))");
  std::map<std::size_t, KVPair> layers;
  std::map<std::size_t, int> seen;
  for (auto& [name, t] : all) {
    std::smatch m;
    if (!std::regex_match(name, m, name_re))
      throw FormatError(fmt::format("{}: unexpected tensor '{}' (a KV file names them layers.{{i}}.keys and layers.{{i}}.values)", path, name));
    const auto i = static_cast<std::size_t>(std::stoul(m[1].str()));
    (m[2].str() == "keys" ? layers[i].keys : layers[i].values) = std::move(t);
    seen[i] |= m[2].str() == "keys" ? 1 : 2;
  }
  if (layers.empty()) throw FormatError(fmt::format("{}: holds no layers.{{i}}.keys / layers.{{i}}.values tensors", path));
  std::vector<KVPair> out;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    if (!seen.count(i)) throw FormatError(fmt::format("{}: layer {} is missing (layers are numbered 0..{} without gaps)", path, i, layers.size() - 1));
    if (seen[i] != 3) throw FormatError(fmt::format("{}: layers.{}.{} is missing", path, i, seen[i] == 1 ? "values" : "keys"));
    const KVPair& p = layers[i];
    if (p.keys.dim(0) != p.values.dim(0) || p.keys.dim(1) != p.values.dim(1) || p.keys.dim(2) != p.values.dim(2) ||
        p.keys.dtype() != p.values.dtype())
      throw FormatError(fmt::format("{}: layer {}: keys {} {} and values {} {} disagree (B, H, S and dtype must match)", path, i,
                                    shape_string(p.keys.shape()), dtype_name(p.keys.dtype()), shape_string(p.values.shape()),
                                    dtype_name(p.values.dtype())));
    out.push_back(p);
  }
  return out;
}

void write_kv_safetensors(const std::string& path, const std::vector<KVPair>& layers, const std::map<std::string, std::string>& metadata) {
  std::map<std::string, Tensor> all;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    all[fmt::format("layers.{}.keys", i)] = layers[i].keys;
    all[fmt::format("layers.{}.values", i)] = layers[i].values;
  }
  write_safetensors(path, all, metadata);
}

}  // namespace vq
