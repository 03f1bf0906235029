#include "veloxquant/peers/peer_coders.hpp"

#include <cstdlib>
#include <cstring>
#include <limits>

#include <fmt/format.h>
#include <htscodecs/rANS_static4x16.h>
#include <lz4.h>
#include <zstd.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/transform/bit_pack.hpp"

namespace vq {

namespace {

PeerCoder htscodecs_rans(int order) {
  PeerCoder c;
  c.name = fmt::format("htscodecs-rans4x16-o{}", order);
  c.encode = [order](std::span<const std::uint8_t> codes) {
    require(codes.size() < std::numeric_limits<unsigned>::max() / 2, "htscodecs: input too large");
    unsigned out_size = rans_compress_bound_4x16(static_cast<unsigned>(codes.size()), order);
    std::vector<std::uint8_t> out(out_size);
    if (!rans_compress_to_4x16(const_cast<unsigned char*>(codes.data()), static_cast<unsigned>(codes.size()), out.data(), &out_size, order))
      throw Error("htscodecs rans_compress_to_4x16 failed");
    out.resize(out_size);
    return out;
  };
  c.decode = [](std::span<const std::uint8_t> comp, std::size_t n) {
    std::vector<std::uint8_t> out(n);
    unsigned out_size = static_cast<unsigned>(n);
    if (!rans_uncompress_to_4x16(const_cast<unsigned char*>(comp.data()), static_cast<unsigned>(comp.size()), out.data(), &out_size) ||
        out_size != n)
      throw FormatError("htscodecs rans_uncompress_to_4x16 failed");
    return out;
  };
  return c;
}

// One compression and one decompression context per thread, kept between calls, as a program
// coding many streams would (ZSTD_compress / ZSTD_decompress make and free one per call).
struct ZstdContexts {
  ZSTD_CCtx* c = ZSTD_createCCtx();
  ZSTD_DCtx* d = ZSTD_createDCtx();
  ~ZstdContexts() {
    ZSTD_freeCCtx(c);
    ZSTD_freeDCtx(d);
  }
};
ZstdContexts& zstd_contexts() {
  thread_local ZstdContexts z;
  require(z.c != nullptr && z.d != nullptr, "zstd: cannot create a context");
  return z;
}

PeerCoder zstd_coder(int level, int bits) {
  PeerCoder c;
  c.name = fmt::format("zstd-{}", level);
  c.encode = [level, bits](std::span<const std::uint8_t> codes) {
    const auto packed = pack_bits(codes, bits);
    std::vector<std::uint8_t> out(ZSTD_compressBound(packed.size()));
    const std::size_t r = ZSTD_compressCCtx(zstd_contexts().c, out.data(), out.size(), packed.data(), packed.size(), level);
    if (ZSTD_isError(r)) throw Error(std::string("zstd: ") + ZSTD_getErrorName(r));
    out.resize(r);
    return out;
  };
  c.decode = [bits](std::span<const std::uint8_t> comp, std::size_t n) {
    std::vector<std::uint8_t> packed(packed_size(n, bits));
    const std::size_t r = ZSTD_decompressDCtx(zstd_contexts().d, packed.data(), packed.size(), comp.data(), comp.size());
    if (ZSTD_isError(r) || r != packed.size()) throw FormatError("zstd: corrupt input");
    return unpack_bits(packed, n, bits);
  };
  return c;
}

PeerCoder lz4_coder(int bits) {
  PeerCoder c;
  c.name = "lz4";
  c.encode = [bits](std::span<const std::uint8_t> codes) {
    const auto packed = pack_bits(codes, bits);
    require(packed.size() < static_cast<std::size_t>(LZ4_MAX_INPUT_SIZE), "lz4: input too large");
    std::vector<std::uint8_t> out(static_cast<std::size_t>(LZ4_compressBound(static_cast<int>(packed.size()))));
    const int r = LZ4_compress_default(reinterpret_cast<const char*>(packed.data()), reinterpret_cast<char*>(out.data()),
                                       static_cast<int>(packed.size()), static_cast<int>(out.size()));
    if (r <= 0) throw Error("lz4 compression failed");
    out.resize(static_cast<std::size_t>(r));
    return out;
  };
  c.decode = [bits](std::span<const std::uint8_t> comp, std::size_t n) {
    std::vector<std::uint8_t> packed(packed_size(n, bits));
    const int r = LZ4_decompress_safe(reinterpret_cast<const char*>(comp.data()), reinterpret_cast<char*>(packed.data()),
                                      static_cast<int>(comp.size()), static_cast<int>(packed.size()));
    if (r < 0 || static_cast<std::size_t>(r) != packed.size()) throw FormatError("lz4: corrupt input");
    return unpack_bits(packed, n, bits);
  };
  return c;
}

}  // namespace

std::vector<PeerCoder> peer_coders(int bits) {
  require(bits >= 1 && bits <= 8, "peer_coders: bits must be in 1..8, got {}", bits);
  return {htscodecs_rans(0), htscodecs_rans(1), zstd_coder(1, bits), zstd_coder(3, bits), zstd_coder(19, bits), lz4_coder(bits)};
}

}  // namespace vq
