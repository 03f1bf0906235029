#include "veloxquant/core/input_file.hpp"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "file_kind.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

InputFile::InputFile(const std::string& path, std::string_view what) : path_(path), what_(what) {
  require(!path.empty(), "empty input path");
  require(path.find('\0') == std::string::npos, "input path contains a NUL byte");
  // O_NONBLOCK: opening a FIFO must not wait for a writer; cleared again once it is known to be a
  // regular file.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd_ < 0) fail("open");
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail("open");
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    throw IoError(fmt::format("cannot read {}{}{}: it is {}, not a regular file", what_, what_.empty() ? "" : " ", path_,
                              core_detail::file_kind(st.st_mode)));
  }
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) fail("open");
  size_ = static_cast<std::uint64_t>(st.st_size);
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InputFile::fail(const char* what) {
  const std::string err = std::strerror(errno);
  if (fd_ >= 0) ::close(fd_);  // unusable from here on
  fd_ = -1;
  throw IoError(fmt::format("cannot {} {}{}{}: {}", what, what_, what_.empty() ? "" : " ", path_, err));
}

bool InputFile::read(void* dst, std::size_t n) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = ::read(fd_, p, n);
    if (got < 0) {
      if (errno == EINTR) continue;
      fail("read");
    }
    if (got == 0) return false;
    p += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

std::vector<std::uint8_t> InputFile::read_all() {
  if (::lseek(fd_, 0, SEEK_SET) != 0) fail("read");
  std::vector<std::uint8_t> out(static_cast<std::size_t>(size_));
  if (!read(out.data(), out.size()))
    throw IoError(fmt::format("cannot read {}{}{}: it shrank while being read", what_, what_.empty() ? "" : " ", path_));
  return out;
}

std::string InputFile::read_all_text() {
  if (::lseek(fd_, 0, SEEK_SET) != 0) fail("read");
  std::string out(static_cast<std::size_t>(size_), '\0');
  if (!read(out.data(), out.size()))
    throw IoError(fmt::format("cannot read {}{}{}: it shrank while being read", what_, what_.empty() ? "" : " ", path_));
  return out;
}

std::vector<std::uint8_t> read_input_file(const std::string& path, std::string_view what) { return InputFile(path, what).read_all(); }
std::string read_input_text(const std::string& path, std::string_view what) { return InputFile(path, what).read_all_text(); }

}  // namespace vq
