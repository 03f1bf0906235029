// llama.cpp's saved sequence state (`llama_state_seq_save_file`, node-llama-cpp's
// `LlamaContextSequence.saveStateToFile`): read into K/V tensors, written back so llama.cpp loads it.
//
// What a reader must know first:
// - The file holds no model shape. A K row is n_kv_heads x head_dim values of the cache's type, so
//   the reader needs the model (LlamaStateModel) to split rows into heads, and checks every row size
//   against it: a state saved from another model is refused, never reinterpreted.
// - V is stored per cell (flash attention on) or transposed (flash attention off: per channel, the
//   values of every cell); `v_trans` says which, and a context only loads the layout it uses, so it is
//   kept and written back as read.
// - Only the plain-llama case is read: one sequence at positions 0 .. n-1 in cell order, every cell
//   of one sequence id, K and V of all layers in one of F32, F16 or BF16. Anything else (quantized
//   cache types, cells of several sequences, gaps, models whose cells carry extra data) is one
//   FormatError naming the field.
//
// Layout (llama.cpp release shipped in node-llama-cpp 3.21.1, src/llama-context.cpp
// state_seq_save_file and src/llama-kv-cache.cpp state_write*; LLAMA_STATE_SEQ_VERSION 3). All
// integers little-endian:
//   u32 magic 0x67677371 ('ggsq'), u32 version 3
//   u32 n_token, i32 token[n_token]                   the prompt the caller saved with the state; llama-server
//                                                     packs it (tools/server/server-common.cpp, server_tokens::
//                                                     serialize): i32 -1, u32 version 1, u32 count, count ids,
//                                                     u32 media chunks (read only when 0)
//   u32 n_stream                                      KV streams of the context (1 when unified)
//   n_stream times:
//     u32 cell_count                                  cells of this sequence in the stream (0: next stream)
//     cell_count times: i32 pos, u32 n_seq_id (= 1), i32 seq_id
//     u32 v_trans (0/1), u32 n_layer
//     n_layer times (keys):   i32 ggml type, u64 row bytes, cell_count rows
//     v_trans = 0, n_layer times (values): i32 ggml type, u64 row bytes, cell_count rows
//     v_trans = 1, n_layer times (values): i32 ggml type, u32 element bytes, u32 n_embd_v_gqa,
//                                          then for each channel j the cell_count values of channel j
// A row (and a transposed V channel index j) runs head-major: element h * head_dim + d.
// docs/format.md ("llama.cpp state files") has the same table with the source it was read from.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/format/safetensors.hpp"  // KVPair

namespace vq {

inline constexpr std::uint32_t kLlamaStateMagic = 0x67677371u;  // 'ggsq', LLAMA_STATE_SEQ_MAGIC
inline constexpr std::uint32_t kLlamaStateVersion = 3;           // LLAMA_STATE_SEQ_VERSION
// llama-server's slot files pack their token list: LLAMA_TOKEN_NULL, then SERVER_TOKENS_STATE_VERSION.
inline constexpr std::int32_t kLlamaServerTokensMarker = -1;
inline constexpr std::uint32_t kLlamaServerTokensVersion = 1;

// The model's KV shape, which the file does not carry: every count is checked against it.
struct LlamaStateModel {
  int layers = 0;
  int kv_heads = 0;
  int key_dim = 0;    // per head
  int value_dim = 0;  // per head
};

struct LlamaState {
  std::vector<std::int32_t> tokens;  // the token ids saved with the state (not checked against the cells)
  bool server_tokens = false;        // saved by llama-server (POST /slots/N?action=save): its token packing
  std::uint32_t n_stream = 1;        // the saving context's streams (a loading context must have as many)
  std::uint32_t stream = 0;          // the stream that holds the cells (the others hold none)
  std::int32_t seq_id = 0;           // the sequence id of every cell (llama.cpp's loader replaces it)
  bool v_trans = false;              // V stored transposed (flash attention off)
  DType dtype = DType::F16;          // the cache's type: F32, F16 or BF16 (ggml 0, 1, 30)
  std::vector<KVPair> layers;        // per layer [1, kv_heads, cells, dim] keys and values, contiguous
  std::int64_t cells() const { return layers.empty() ? 0 : layers[0].keys.dim(2); }
};

// ggml's type numbers for the three types a state is read in (never renumbered by ggml).
std::int32_t ggml_type_of(DType dtype);
// "f16", "q8_0", ... or "type N" for numbers we do not name.
std::string ggml_type_name(std::int32_t type);

// Parses a state. Throws FormatError "<name>: llama.cpp state: ..." with the field and byte offset
// for a foreign or truncated file, trailing bytes, a count the file cannot hold, a row size or layer
// count other than the model's, a type other than F32/F16/BF16, mixed types, several sequences or
// positions other than 0 .. n-1, a negative token id, a llama-server token list of another version or
// with media chunks, or a non-finite K/V value. Allocates only after the sizes were
// checked against the bytes present.
LlamaState read_llama_state(std::span<const std::uint8_t> bytes, const LlamaStateModel& model, const std::string& name = "state");
LlamaState load_llama_state(const std::string& path, const LlamaStateModel& model);

// The bytes llama.cpp writes for `state` (read_llama_state of them gives it back bit for bit).
// The layers' K/V are converted to state.dtype when they hold another type. Throws InvalidArgument
// when the layers disagree in shape, are empty, or the stream/type fields are out of range.
std::vector<std::uint8_t> write_llama_state(const LlamaState& state);
// Written atomically (core/atomic_file.hpp).
void save_llama_state(const std::string& path, const LlamaState& state);

}  // namespace vq
