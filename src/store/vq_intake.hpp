// Private to the prefix loader: how a stored chunk's vq layers enter a code-domain host, one whose
// every cache is a VqKVCache with the model's layer models. The loader knows chunks, levels and the
// plan; this knows vq's codes.
//
// - A vq chunk is decoded as codes (arrays reused from chunks already fed), not rows.
// - On a decoder thread each layer the host can take is packed at the host's layouts (or, before the
//   host has one, at the widths the directory's entry recorded), so the feeding thread copies rows.
// - On the feeding thread feed() appends a layer's codes where the host's config, layer model and
//   calibration are the chunk's; otherwise it says no and the loader feeds the rebuilt rows
//   through update(), re-quantized by the host, as every non-vq level's rows are.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/store/prefix_chunks.hpp"
#include "veloxquant/vq/code_buffers.hpp"
#include "veloxquant/vq/packed_codes.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace vq {

class VqIntake {
 public:
  using Layouts = std::array<std::shared_ptr<const VqFieldLayout>, 2>;  // K, V

  // The intake for `caches` when each is a VqKVCache with a model-derived layer model; null otherwise.
  static std::unique_ptr<VqIntake> for_caches(const std::vector<std::shared_ptr<KVCache>>& caches);

  // Whether chunks at `level` come as codes (vq levels).
  static bool decodes(const std::string& level);
  // Chunk `index` at a vq level, as codes (decode_chunk_codes with this intake's arrays).
  ChunkCodes decode(std::span<const std::uint8_t> blob, std::uint64_t fingerprint, const std::string& level, int index,
                    std::uint64_t chain, std::span<const int> tokens, const VqLayerModelSource& models);
  // Decoder thread: the chunk's layers packed at the host's layouts, those the host can take (the
  // codes of a packed layer go back to the arrays); `entry` and `hint_widths`: the directory entry
  // the chunk came from and the widths it recorded (ChunkDirectory::Entry::widths).
  std::vector<std::optional<VqPackedCodes>> pack(ChunkCodes& kv, int entry, const std::vector<std::uint8_t>& hint_widths);
  // Feeding thread: layer l of a chunk into its host as codes (packed: what pack() made of it, or
  // null); false when the host cannot take them (v.codes then hold the layer's codes).
  bool feed(std::size_t l, VqStoredLayer& v, std::optional<VqPackedCodes>* packed);

 private:
  explicit VqIntake(std::vector<VqKVCache*> hosts) : hosts_(std::move(hosts)), pack_at_(hosts_.size()) {}
  void publish_layout(std::size_t l);
  Layouts hinted(int entry, std::size_t l, const std::vector<std::uint8_t>& widths);

  std::vector<VqKVCache*> hosts_;
  // The code arrays of chunks fed, given back for the decoders of later chunks (no allocation, page
  // faults or zeroing per layer and chunk).
  VqCodeBuffers buffers_;
  std::mutex mu_;  // guards what follows
  // Per host layer, the layouts decoder threads pack at: the host's, published by the feeding
  // thread whenever they change (chunk 0 sets them, a widening changes them). A chunk packed at a
  // layout the host no longer has is unpacked and appended as codes.
  std::vector<Layouts> pack_at_;
  std::vector<VqPackedCodes> packed_free_;  // packed chunks fed: their arrays for the next
  // Before the host has a layout: the widths the live caches of a level held after the last chunk
  // stored, per directory entry and layer, made once; none when there is no hint or it does not fit.
  std::map<int, std::vector<Layouts>> hints_;
};

}  // namespace vq
