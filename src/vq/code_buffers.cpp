// VqCodeBuffers (vq/code_buffers.hpp): a pool of code arrays, and vq_decode into arrays taken from
// it, built on the decoder's write-into form (vq/codec_decode_into.hpp), which writes every code
// once over whatever an array of the right size held.
#include "veloxquant/vq/code_buffers.hpp"

#include "veloxquant/vq/codec_decode_into.hpp"

namespace vq {

std::vector<std::int16_t> VqCodeBuffers::take() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) return {};
  std::vector<std::int16_t> v = std::move(free_.back());
  free_.pop_back();
  return v;
}

void VqCodeBuffers::give(std::vector<std::int16_t>&& codes) {
  if (codes.capacity() == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(std::move(codes));
}

void VqCodeBuffers::give(VqLayerCodes&& codes) {
  give(std::move(codes.k.codes));
  give(std::move(codes.v.codes));
}

std::size_t VqCodeBuffers::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

VqLayerCodes vq_decode(std::span<const std::uint8_t> bytes, std::uint64_t max_codes, RansKernel kernel, VqCodeBuffers* buffers) {
  VqLayerCodes out;
  if (buffers) {
    out.k.codes = buffers->take();
    out.v.codes = buffers->take();
  }
  vq_decode(bytes, max_codes, out, kernel);
  return out;
}

}  // namespace vq
