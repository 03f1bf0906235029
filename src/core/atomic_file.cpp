#include "veloxquant/core/atomic_file.hpp"

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <pthread.h>
#include <random>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "file_kind.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

// The registry of live temporaries that the signal handler unlinks. Async-signal-safe: fixed
// storage, a lock-free state per slot (0 free, 1 being filled, 2 live); the handler reads only
// live slots. A writer beyond the 64th at once (or a path too long to store) still works, it is
// just not cleaned up on a signal.
constexpr int kSlots = 64;
constexpr std::size_t kPathBytes = 4096;
struct Slot {
  std::atomic<int> state{0};
  char path[kPathBytes];
};
Slot g_slots[kSlots];
static_assert(std::atomic<int>::is_always_lock_free);

int register_temporary(const std::string& path) {
  if (path.size() >= kPathBytes) return -1;
  for (int i = 0; i < kSlots; ++i) {
    int expected = 0;
    if (g_slots[i].state.compare_exchange_strong(expected, 1, std::memory_order_acquire)) {
      std::memcpy(g_slots[i].path, path.c_str(), path.size() + 1);
      g_slots[i].state.store(2, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

void unregister_temporary(int slot) {
  if (slot >= 0) g_slots[slot].state.store(0, std::memory_order_release);
}

constexpr int kTerminationSignals[] = {SIGINT, SIGTERM, SIGHUP};

extern "C" void remove_temporaries_and_die(int sig) {
  for (auto& s : g_slots)
    if (s.state.load(std::memory_order_acquire) == 2) ::unlink(s.path);
  // Blocked while this handler runs: the re-raised signal is delivered, with the default action,
  // when it returns.
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Blocks the termination signals for its lifetime, so that creating (or renaming, or removing) a
// temporary and recording it in the registry happen together as far as the handler can see.
class SignalsBlocked {
 public:
  SignalsBlocked() {
    sigset_t set;
    sigemptyset(&set);
    for (int s : kTerminationSignals) sigaddset(&set, s);
    pthread_sigmask(SIG_BLOCK, &set, &old_);
  }
  ~SignalsBlocked() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }
  SignalsBlocked(const SignalsBlocked&) = delete;
  SignalsBlocked& operator=(const SignalsBlocked&) = delete;

 private:
  sigset_t old_;
};

std::string random_suffix() {
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::random_device rd;
  std::uint64_t x = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  std::string s;
  for (int i = 0; i < 12; ++i, x /= 36) s += kChars[x % 36];
  return s;
}

}  // namespace

AtomicFile::AtomicFile(const std::string& path) : path_(path) {
  require(!path.empty(), "empty output path");
  require(path.find('\0') == std::string::npos, "output path contains a NUL byte");
  // Where the bytes go: the path itself, or a symbolic link's final target.
  struct stat st {};
  bool exists = false;
  if (::lstat(path.c_str(), &st) == 0) {
    exists = true;
    target_ = path;
    if (S_ISLNK(st.st_mode)) {
      char* real = ::realpath(path.c_str(), nullptr);
      if (!real) {
        if (errno == ENOENT) throw IoError(fmt::format("cannot write {}: it is a symbolic link to a missing file (not written through)", path));
        fail("resolve the symbolic link");
      }
      target_ = real;
      std::free(real);
      if (::stat(target_.c_str(), &st) != 0) fail("resolve the symbolic link");
    }
    if (!S_ISREG(st.st_mode)) {
      const std::string what = target_ == path ? std::string("it") : fmt::format("its target {}", target_.string());
      throw IoError(fmt::format("cannot write {}: {} is {}, not a regular file", path, what, core_detail::file_kind(st.st_mode)));
    }
    if (::faccessat(AT_FDCWD, target_.c_str(), W_OK, AT_EACCESS) != 0) fail("write");
  } else if (errno == ENOENT) {
    target_ = path;
  } else {
    fail("write");
  }

  // The temporary: a fresh random name beside the target, created exclusively (never through a
  // symbolic link or over another file), mode 0666 less the umask.
  std::string name = target_.filename().string().substr(0, 200);
  for (int attempt = 0; fd_ < 0; ++attempt) {
    tmp_ = target_.parent_path() / fmt::format(".{}.tmp.{}", name, random_suffix());
    SignalsBlocked blocked;
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd_ >= 0) {
      slot_ = register_temporary(std::filesystem::absolute(tmp_).string());
    } else if (errno != EEXIST || attempt == 100) {
      fail("write");
    }
  }
  if (exists) {
    // Keep the replaced file's permission bits and, where allowed, its owner and group.
    if ((st.st_uid != ::geteuid() || st.st_gid != ::getegid()) && ::fchown(fd_, st.st_uid, st.st_gid) != 0) {
      // not allowed (not root): the new file is ours
    }
    if (::fchmod(fd_, st.st_mode & 0777) != 0) fail("set the permissions of");
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !tmp_.empty()) {
    SignalsBlocked blocked;
    ::unlink(tmp_.c_str());
    unregister_temporary(slot_);
  }
}

void AtomicFile::fail(const char* what) const {
  throw IoError(fmt::format("cannot {} {}: {}", what, path_, std::strerror(errno)));
}

void AtomicFile::write(std::span<const std::uint8_t> bytes) {
  require(fd_ >= 0, "AtomicFile::write after commit");
  const std::uint8_t* p = bytes.data();
  std::size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write");
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

void AtomicFile::write(std::string_view text) { write({reinterpret_cast<const std::uint8_t*>(text.data()), text.size()}); }

void AtomicFile::commit() {
  require(fd_ >= 0, "AtomicFile::commit twice");
  if (::fsync(fd_) != 0) fail("write");
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) fail("write");
  {
    SignalsBlocked blocked;
    if (::rename(tmp_.c_str(), target_.c_str()) != 0) fail("rename a temporary file onto");
    committed_ = true;
    unregister_temporary(slot_);
  }
  // Make the rename itself durable; a failure here leaves a complete file, so it is not an error.
  const auto dir = target_.parent_path().empty() ? std::filesystem::path(".") : target_.parent_path();
  if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_file_atomically(const std::string& path, std::span<const std::uint8_t> bytes) {
  AtomicFile f(path);
  f.write(bytes);
  f.commit();
}

void write_file_atomically(const std::string& path, std::string_view text) {
  AtomicFile f(path);
  f.write(text);
  f.commit();
}

void remove_temporaries_on_signals() {
  struct sigaction sa {};
  sa.sa_handler = remove_temporaries_and_die;
  sigemptyset(&sa.sa_mask);
  for (int s : kTerminationSignals) sigaddset(&sa.sa_mask, s);
  for (int s : kTerminationSignals) {
    struct sigaction old {};
    if (::sigaction(s, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    ::sigaction(s, &sa, nullptr);
  }
}

}  // namespace vq
