// The one way veloxquant opens a file it reads (.npy, safetensors, .vqkv, model, tokenizer, text,
// profile): only a regular file (or a symbolic link to one) is accepted. A directory, a FIFO, a
// device or a socket is refused with one IoError that says what it is, before any read: a FIFO
// cannot block the reader and a directory cannot pose as an empty or huge file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace vq {

class InputFile {
 public:
  // `what` names the file in messages ("checkpoint", "tokenizer"; empty: just the path). Throws
  // IoError (InvalidArgument for an empty path or one with a NUL byte).
  InputFile(const std::string& path, std::string_view what = {});
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  std::uint64_t size() const { return size_; }  // when opened
  // Read exactly n bytes at the current position: false when the file ends first; IoError when
  // the system refuses.
  bool read(void* dst, std::size_t n);
  // The whole file from the start; IoError when it is shorter than it was when opened.
  std::vector<std::uint8_t> read_all();
  std::string read_all_text();

 private:
  std::string path_, what_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
  [[noreturn]] void fail(const char* what);
};

// The bytes of the regular file at `path` (see InputFile).
std::vector<std::uint8_t> read_input_file(const std::string& path, std::string_view what = {});
std::string read_input_text(const std::string& path, std::string_view what = {});

}  // namespace vq
