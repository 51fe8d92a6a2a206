#include "optstate/io.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE (glibc >= 2.28)
#include <fmt/format.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <new>
#include <random>
#include <string_view>

namespace optstate {
namespace {
std::string errno_text() { return std::strerror(errno); }

// Lock-free, so a signal handler may store into it.
std::atomic<int> g_interrupt{0};
static_assert(std::atomic<int>::is_always_lock_free);

// Bytes per write(2) call: a large buffer is written in pieces, so an interrupt stops it within one.
constexpr size_t kWritePiece = size_t{64} << 20;
constexpr size_t kBouncePieceBytes = size_t{8} << 20;
}  // namespace

void request_interrupt(int signal) noexcept { g_interrupt.store(signal, std::memory_order_relaxed); }
int interrupt_signal() noexcept { return g_interrupt.load(std::memory_order_relaxed); }
void clear_interrupt() noexcept { g_interrupt.store(0, std::memory_order_relaxed); }

Status check_interrupt(const fs::path& where) {
  const int sig = interrupt_signal();
  if (sig == 0) return Status::Ok();
  return {ErrorCode::kCancelled, fmt::format("{}: interrupted by signal {} ({})", where.string(), sig, strsignal(sig))};
}

struct InputFile::State {
  fs::path path;
  uint64_t size = 0;
  dev_t dev = 0;
  ino_t ino = 0;
  int fd = -1;    // -1 while closed for another file
  int pins = 0;   // reads in progress: not closed (nor let go) under them
  std::list<State*>::iterator lru;  // valid while fd >= 0, or while a made file holds its bytes
  // A made file (InputFile::made): no descriptor; its bytes, held while `held`.
  InputFile::Maker make;
  ByteVector bytes;
  bool held = false;
  std::mutex making;  // one make() at a time for this file
};

namespace {

// The open InputFile descriptors, most recently read first.
struct InputPool {
  std::mutex mu;
  std::list<InputFile::State*> open;
  std::list<InputFile::State*> held;  // made files holding their bytes, most recently read first
  uint64_t held_bytes = 0;
};
// A quarter of the machine's memory, within [1 GiB, 64 GiB]: a checkpoint's first read (open) and
// its later one decode each item once while what they decode fits (a DCP opens by parsing every
// item, and reads them again in another order).
uint64_t default_made_input_budget() {
  return std::clamp(machine_memory_bytes() / 4, uint64_t{1} << 30, uint64_t{64} << 30);
}

// A cgroup's memory limit: cgroup v2's memory.max, v1's memory.limit_in_bytes; 0 when none is set
// ("max", or v1's huge "unlimited").
uint64_t cgroup_memory_limit() {
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::FILE* f = std::fopen(path, "re");
    if (!f) continue;
    char text[32] = {};
    const size_t n = std::fread(text, 1, sizeof text - 1, f);
    std::fclose(f);
    unsigned long long v = 0;
    if (n > 0 && std::sscanf(text, "%llu", &v) == 1 && v > 0 && v < (uint64_t{1} << 60)) return v;
  }
  return 0;
}
std::atomic<uint64_t> g_made_input_budget{default_made_input_budget()};
InputPool& pool() {
  static InputPool* p = new InputPool;  // never destroyed: InputFiles may outlive static destruction
  return *p;
}

rlim_t soft_open_limit() {
  rlimit lim{};
  return ::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY ? lim.rlim_cur : 1 << 20;
}

// Closes the least recently read unpinned descriptor; false if every open one is in use. Holds mu.
bool close_one(InputPool& p) {
  for (auto it = p.open.end(); it != p.open.begin();) {
    InputFile::State* s = *--it;
    if (s->pins > 0) continue;
    ::close(s->fd);
    s->fd = -1;
    p.open.erase(it);
    return true;
  }
  return false;
}

// Opens `s`'s file (first open, or again after its descriptor was closed for another) and lists it
// as most recently read. Holds mu.
Status open_listed(InputPool& p, InputFile::State& s, bool first) {
  const size_t cap = max_open_inputs();
  while (p.open.size() >= cap && close_one(p)) {
  }
  // O_NONBLOCK: a FIFO where a file should be would block the open until something writes to it;
  // it is refused below as not a regular file. Cleared once the file is known to be one.
  constexpr int kFlags = O_RDONLY | O_CLOEXEC | O_NONBLOCK;
  int fd = ::open(s.path.c_str(), kFlags);
  while (fd < 0 && (errno == EMFILE || errno == ENFILE) && close_one(p)) fd = ::open(s.path.c_str(), kFlags);
  if (fd < 0) {
    if (errno == ENOENT) return not_found(fmt::format("{}: no such file", s.path.string()));
    return io_error(fmt::format("{}: {}", s.path.string(), errno_text()));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const Status e = io_error(fmt::format("{}: {}", s.path.string(), errno_text()));
    ::close(fd);
    return e;
  }
  if (first) {
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return corrupt(fmt::format("{}: not a regular file", s.path.string()));
    }
    s.size = static_cast<uint64_t>(st.st_size);
    s.dev = st.st_dev;
    s.ino = st.st_ino;
  } else if (st.st_dev != s.dev || st.st_ino != s.ino || static_cast<uint64_t>(st.st_size) != s.size) {
    ::close(fd);
    return corrupt(fmt::format("{}: replaced or resized while it was being read", s.path.string()));
  }
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    const Status e = io_error(fmt::format("{}: {}", s.path.string(), errno_text()));
    ::close(fd);
    return e;
  }
  s.fd = fd;
  p.open.push_front(&s);
  s.lru = p.open.begin();
  return Status::Ok();
}

// Lets go of the least recently read made files' bytes, unpinned ones, until the held ones fit the
// budget. Holds mu.
void let_go_made(InputPool& p) {
  for (auto it = p.held.end(); p.held_bytes > g_made_input_budget.load(std::memory_order_relaxed) && it != p.held.begin();) {
    InputFile::State* s = *--it;
    if (s->pins > 0) continue;
    p.held_bytes -= s->bytes.size();
    ByteVector().swap(s->bytes);
    s->held = false;
    it = p.held.erase(it);
  }
}

// Holds a made file's new bytes, most recently read first. Holds mu.
void hold_made(InputPool& p, InputFile::State& s, ByteVector bytes) {
  s.bytes = std::move(bytes);
  s.held = true;
  p.held.push_front(&s);
  s.lru = p.held.begin();
  p.held_bytes += s.bytes.size();
}

// Closes a file's descriptor, if open, and takes it off the pool (before its State is freed).
void close_listed(InputFile::State* s) {
  if (!s) return;
  InputPool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  if (s->held) {
    p.held_bytes -= s->bytes.size();
    p.held.erase(s->lru);
    s->held = false;
  }
  if (s->fd >= 0) {
    ::close(s->fd);
    p.open.erase(s->lru);
  }
}

}  // namespace

uint64_t machine_memory_bytes() {
  // Read once: every pickle and JSON document sizes its cap by it (a DCP unpickles each item).
  static const uint64_t known = [] {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
    uint64_t bytes = pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
    if (const uint64_t limit = cgroup_memory_limit(); limit && (!bytes || limit < bytes)) bytes = limit;
    return bytes ? bytes : uint64_t{4} << 30;  // neither known: assume a small machine
  }();
  return known;
}

uint64_t made_input_budget() { return g_made_input_budget.load(std::memory_order_relaxed); }
uint64_t set_made_input_budget(uint64_t bytes) { return g_made_input_budget.exchange(bytes); }

size_t max_open_inputs() { return std::max<size_t>(8, static_cast<size_t>(soft_open_limit() / 2)); }

uint64_t raise_open_file_limit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return 0;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  return lim.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(lim.rlim_cur);
}

Result<InputFile> InputFile::open(const fs::path& path) {
  InputFile f;
  f.s_ = std::make_unique<State>();
  f.s_->path = path;
  InputPool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  OPTSTATE_RETURN_IF_ERROR(open_listed(p, *f.s_, /*first=*/true));
  return f;
}

Result<InputFile> InputFile::made(const fs::path& name, Maker make) {
  InputFile f;
  f.s_ = std::make_unique<State>();
  f.s_->path = name;
  OPTSTATE_ASSIGN_OR_RETURN(ByteVector bytes, make());
  f.s_->make = std::move(make);
  f.s_->size = bytes.size();
  InputPool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  hold_made(p, *f.s_, std::move(bytes));
  let_go_made(p);
  return f;
}

InputFile::InputFile(InputFile&& o) noexcept : s_(std::move(o.s_)) {}
InputFile& InputFile::operator=(InputFile&& o) noexcept {
  if (this != &o) {
    close_listed(s_.get());
    s_ = std::move(o.s_);
  }
  return *this;
}
InputFile::~InputFile() { close_listed(s_.get()); }

uint64_t InputFile::size() const { return s_->size; }
const fs::path& InputFile::path() const { return s_->path; }

void ReadBuffer::Free::operator()(std::byte* p) const { std::free(p); }

std::span<std::byte> ReadBuffer::for_read(uint64_t offset, size_t n) {
  const size_t need = n + kPageBytes;
  if (need > capacity_) {
    const size_t rounded = (need + kPageBytes - 1) / kPageBytes * kPageBytes;
    data_.reset(static_cast<std::byte*>(std::aligned_alloc(kPageBytes, rounded)));
    if (!data_) throw std::bad_alloc();
    capacity_ = rounded;
  }
  return {data_.get() + offset % kPageBytes, n};
}

Status InputFile::read_at(uint64_t offset, std::span<std::byte> out) const {
  State& s = *s_;
  if (offset > s.size || out.size() > s.size - offset)
    return corrupt(fmt::format("{}: truncated: need bytes [{}, {}) but the file has {}", s.path.string(), offset,
                               offset + out.size(), s.size));
  InputPool& p = pool();
  if (s.make) {
    std::unique_lock<std::mutex> lock(p.mu);
    if (!s.held) {
      lock.unlock();
      std::lock_guard<std::mutex> one_maker(s.making);
      lock.lock();
      if (!s.held) {
        lock.unlock();
        auto bytes = s.make();
        if (!bytes.ok()) return bytes.status();
        if (bytes->size() != s.size)
          return corrupt(fmt::format("{}: made again as {} bytes, {} before", s.path.string(), bytes->size(), s.size));
        lock.lock();
        hold_made(p, s, std::move(*bytes));
      }
    }
    if (s.lru != p.held.begin()) p.held.splice(p.held.begin(), p.held, s.lru);
    ++s.pins;  // before letting others go: this one stays held while read
    let_go_made(p);
    lock.unlock();
    if (!out.empty()) std::memcpy(out.data(), s.bytes.data() + offset, out.size());
    lock.lock();
    --s.pins;
    return Status::Ok();
  }
  int fd;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    if (s.fd < 0) {
      OPTSTATE_RETURN_IF_ERROR(open_listed(p, s, /*first=*/false));
    } else if (s.lru != p.open.begin()) {
      p.open.splice(p.open.begin(), p.open, s.lru);
    }
    ++s.pins;
    fd = s.fd;
  }
  Status result;
  size_t done = 0;
  // A skewed destination: read unskewed pieces into a bounce buffer and copy them (glibc's memcpy
  // handles the skew); cheaper than the kernel's skewed copy from 64 KiB on.
  const bool bounce = out.size() >= (size_t{64} << 10) && skewed_read(offset, out.data());
  thread_local ReadBuffer bounce_buffer;
  while (done < out.size()) {
    ssize_t n;
    if (bounce) {
      const auto piece = bounce_buffer.for_read(offset + done, std::min(out.size() - done, kBouncePieceBytes));
      n = ::pread(fd, piece.data(), piece.size(), static_cast<off_t>(offset + done));
      if (n > 0) std::memcpy(out.data() + done, piece.data(), static_cast<size_t>(n));
    } else {
      n = ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      result = io_error(fmt::format("{}: read failed: {}", s.path.string(), errno_text()));
      break;
    }
    if (n == 0) {
      result = corrupt(fmt::format("{}: truncated while reading at offset {}", s.path.string(), offset + done));
      break;
    }
    done += static_cast<size_t>(n);
  }
  std::lock_guard<std::mutex> lock(p.mu);
  --s.pins;
  return result;
}

Result<OutputFile> OutputFile::create(const fs::path& path) {
  OutputFile f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (f.fd_ < 0) return io_error(fmt::format("{}: cannot create: {}", path.string(), errno_text()));
  return f;
}

OutputFile::OutputFile(OutputFile&& o) noexcept
    : fd_(o.fd_), offset_(o.offset_), kicked_(o.kicked_), gathered_(std::move(o.gathered_)), path_(std::move(o.path_)) {
  o.fd_ = -1;
}
OutputFile& OutputFile::operator=(OutputFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    offset_ = o.offset_;
    kicked_ = o.kicked_;
    gathered_ = std::move(o.gathered_);
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}
OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

Status write_all(int fd, std::span<const std::byte> bytes, const fs::path& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    OPTSTATE_RETURN_IF_ERROR(check_interrupt(path));
    ssize_t n = ::write(fd, bytes.data() + done, std::min(bytes.size() - done, kWritePiece));
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error(fmt::format("{}: write failed: {}", path.string(), errno_text()));
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace

Status OutputFile::flush() {
  if (gathered_.empty()) return Status::Ok();
  Status st = write_all(fd_, gathered_, path_);
  gathered_.clear();
  return st;
}

Status OutputFile::write(std::span<const std::byte> bytes) {
  if (fd_ < 0) return internal_error(fmt::format("{}: already closed", path_.string()));
  if (bytes.size() < kBufferBytes) {
    if (gathered_.size() + bytes.size() > kBufferBytes) OPTSTATE_RETURN_IF_ERROR(flush());
    if (gathered_.capacity() < kBufferBytes) gathered_.reserve(kBufferBytes);
    gathered_.insert(gathered_.end(), bytes.begin(), bytes.end());
  } else {
    OPTSTATE_RETURN_IF_ERROR(flush());
    OPTSTATE_RETURN_IF_ERROR(write_all(fd_, bytes, path_));
  }
  offset_ += bytes.size();
  // Start writeback of what is complete now rather than leaving it all to the final fsync, so the
  // disk works while later chunks are produced (a hint: errors surface at fsync).
  const uint64_t handed = offset_ - gathered_.size();
  if (handed - kicked_ >= kWritebackKickBytes) {
    (void)::sync_file_range(fd_, static_cast<off_t>(kicked_), static_cast<off_t>(handed - kicked_),
                            SYNC_FILE_RANGE_WRITE);
    kicked_ = handed;
  }
  return Status::Ok();
}

Status OutputFile::patch(uint64_t at, std::span<const std::byte> bytes) {
  if (at > offset_ || bytes.size() > offset_ - at)
    return internal_error(fmt::format("{}: patch of {} bytes at {} beyond the {} written", path_.string(), bytes.size(),
                                      at, offset_));
  const uint64_t gathered_from = offset_ - gathered_.size();
  if (at >= gathered_from) {  // still here: changed in place
    std::memcpy(gathered_.data() + (at - gathered_from), bytes.data(), bytes.size());
    return Status::Ok();
  }
  if (at + bytes.size() > gathered_from) OPTSTATE_RETURN_IF_ERROR(flush());
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(at + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error(fmt::format("{}: write failed: {}", path_.string(), errno_text()));
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status OutputFile::write_zeros(uint64_t count) {
  static const std::byte kZeros[4096] = {};
  while (count > 0) {
    const uint64_t n = std::min<uint64_t>(count, sizeof(kZeros));
    OPTSTATE_RETURN_IF_ERROR(write({kZeros, static_cast<size_t>(n)}));
    count -= n;
  }
  return Status::Ok();
}

Status OutputFile::sync_and_close() {
  if (fd_ < 0) return internal_error(fmt::format("{}: already closed", path_.string()));
  OPTSTATE_RETURN_IF_ERROR(flush());
  if (::fsync(fd_) != 0) return io_error(fmt::format("{}: fsync failed: {}", path_.string(), errno_text()));
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return io_error(fmt::format("{}: close failed: {}", path_.string(), errno_text()));
  return Status::Ok();
}

Result<std::vector<std::byte>> read_small_file(const fs::path& path, uint64_t max_bytes) {
  OPTSTATE_ASSIGN_OR_RETURN(InputFile f, InputFile::open(path));
  if (f.size() > max_bytes)
    return corrupt(fmt::format("{}: {} bytes is more than the {} allowed", path.string(), f.size(), max_bytes));
  std::vector<std::byte> bytes(f.size());
  OPTSTATE_RETURN_IF_ERROR(f.read_at(0, bytes));
  return bytes;
}

Status write_small_file(const fs::path& path, std::span<const std::byte> bytes) {
  OPTSTATE_ASSIGN_OR_RETURN(OutputFile f, OutputFile::create(path));
  OPTSTATE_RETURN_IF_ERROR(f.write(bytes));
  return f.sync_and_close();
}

Status copy_file_durably(const fs::path& from, const fs::path& to) {
  OPTSTATE_ASSIGN_OR_RETURN(InputFile in, InputFile::open(from));
  OPTSTATE_ASSIGN_OR_RETURN(OutputFile out, OutputFile::create(to));
  std::vector<std::byte> buf(static_cast<size_t>(std::min<uint64_t>(in.size(), uint64_t{8} << 20)));
  for (uint64_t at = 0; at < in.size();) {
    const auto piece = std::span(buf).first(static_cast<size_t>(std::min<uint64_t>(buf.size(), in.size() - at)));
    OPTSTATE_RETURN_IF_ERROR(in.read_at(at, piece));
    OPTSTATE_RETURN_IF_ERROR(out.write(piece));
    at += piece.size();
  }
  return out.sync_and_close();
}

Status copy_entry_as_is(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(from, ec);
  if (!ec && fs::is_regular_file(st)) return copy_file_durably(from, to);
  if (!ec && fs::is_symlink(st))
    fs::copy_symlink(from, to, ec);
  else if (!ec)
    fs::copy(from, to, fs::copy_options::recursive | fs::copy_options::copy_symlinks, ec);
  if (ec) return io_error(fmt::format("{}: cannot copy to {}: {}", from.string(), to.string(), ec.message()));
  return Status::Ok();
}

Status fsync_directory(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return io_error(fmt::format("{}: cannot open directory: {}", dir.string(), errno_text()));
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return io_error(fmt::format("{}: directory fsync failed: {}", dir.string(), errno_text()));
  return Status::Ok();
}

Result<fs::path> contained_path(const fs::path& root, const std::string& relative) {
  auto bad = [&](const char* why) {
    return corrupt(fmt::format("{}: path '{}' {}", root.string(), relative, why));
  };
  if (relative.empty() || relative.size() > 4096) return bad("is empty or too long");
  if (relative.front() == '/') return bad("is absolute");
  for (char ch : relative)
    if (static_cast<unsigned char>(ch) < 0x20 || ch == '\\' || ch == ':') return bad("has a forbidden character");
  size_t start = 0;
  while (start <= relative.size()) {
    size_t slash = relative.find('/', start);
    if (slash == std::string::npos) slash = relative.size();
    std::string_view part(relative.data() + start, slash - start);
    if (part.empty() || part == "." || part == "..") return bad("leaves the checkpoint directory or is malformed");
    start = slash + 1;
  }
  return root / relative;
}

namespace {

// The DST part of staging and moved-aside names: DST's name, or, for a name too long to take the
// suffixes within NAME_MAX (255 bytes), its first 180 bytes and an FNV-1a hash of all of it (stable
// across processes and builds, so find_leftovers recognizes another process's names).
std::string staging_stem(const fs::path& final_path) {
  const std::string name = final_path.filename().string();
  if (name.size() <= 200) return name;
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return fmt::format("{}~{:016x}", name.substr(0, 180), h);
}

fs::path staging_parent(const fs::path& final_path) {
  fs::path parent = final_path.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// The output's folder must exist: writers make no folders above it (a mistyped path fails rather
// than growing a tree). A file in its place is named as such, not as a missing folder.
Status check_parent(const fs::path& final_path, const fs::path& parent) {
  std::error_code ec;
  const fs::file_status st = fs::status(parent, ec);
  if (fs::is_directory(st)) return Status::Ok();
  if (fs::exists(st))
    return invalid_argument(fmt::format("{}: '{}' is not a directory", final_path.string(), parent.string()));
  return not_found(fmt::format("{}: parent directory does not exist", final_path.string()));
}

}  // namespace

Result<fs::path> make_staging_dir(const fs::path& final_dir) {
  const fs::path parent = staging_parent(final_dir);
  OPTSTATE_RETURN_IF_ERROR(check_parent(final_dir, parent));
  std::random_device rd;
  for (int attempt = 0; attempt < 16; ++attempt) {
    fs::path staging = parent / fmt::format(".{}.partial-{}-{:08x}", staging_stem(final_dir), ::getpid(), rd());
    if (::mkdir(staging.c_str(), 0755) == 0) return staging;
    if (errno != EEXIST) return io_error(fmt::format("{}: cannot create: {}", staging.string(), errno_text()));
  }
  return io_error(fmt::format("{}: cannot create a staging directory", final_dir.string()));
}

Status publish_directory(const fs::path& staging, const fs::path& final_dir, bool overwrite) {
  fs::path parent = final_dir.parent_path();
  if (parent.empty()) parent = ".";
  OPTSTATE_RETURN_IF_ERROR(fsync_directory(staging));
  OPTSTATE_RETURN_IF_ERROR(check_interrupt(final_dir));  // the last moment a stop leaves nothing published
  std::error_code ec;
  if (fs::exists(fs::symlink_status(final_dir, ec))) {
    if (!overwrite) return invalid_argument(fmt::format("{}: already exists", final_dir.string()));
    // Swap the two directories in one step, so there is never a moment without a complete
    // checkpoint at final_dir; the old one ends up under the staging name and is removed.
    if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      OPTSTATE_RETURN_IF_ERROR(fsync_directory(parent));
      fs::remove_all(staging, ec);
      return Status::Ok();
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
      return io_error(fmt::format("{}: cannot publish: {}", final_dir.string(), errno_text()));
    // Filesystems without RENAME_EXCHANGE: move the old one aside first (a short window in which
    // final_dir is absent; the old checkpoint stays complete under .<name>.old-<pid>).
    const fs::path aside = parent / fmt::format(".{}.old-{}", staging_stem(final_dir), ::getpid());
    if (::rename(final_dir.c_str(), aside.c_str()) != 0)
      return io_error(fmt::format("{}: cannot move the old checkpoint aside: {}", final_dir.string(), errno_text()));
    if (::rename(staging.c_str(), final_dir.c_str()) != 0) {
      Status st = io_error(fmt::format("{}: cannot publish: {}", final_dir.string(), errno_text()));
      ::rename(aside.c_str(), final_dir.c_str());  // put the old one back
      return st;
    }
    OPTSTATE_RETURN_IF_ERROR(fsync_directory(parent));
    fs::remove_all(aside, ec);
    return Status::Ok();
  }
  if (::rename(staging.c_str(), final_dir.c_str()) != 0)
    return io_error(fmt::format("{}: cannot publish: {}", final_dir.string(), errno_text()));
  return fsync_directory(parent);
}

Result<fs::path> make_staging_path(const fs::path& final_file) {
  const fs::path parent = staging_parent(final_file);
  OPTSTATE_RETURN_IF_ERROR(check_parent(final_file, parent));
  std::error_code ec;
  std::random_device rd;
  for (int attempt = 0; attempt < 16; ++attempt) {
    fs::path p = parent / fmt::format(".{}.partial-{}-{:08x}", staging_stem(final_file), ::getpid(), rd());
    if (!fs::exists(fs::symlink_status(p, ec))) return p;
  }
  return io_error(fmt::format("{}: cannot find a free staging name", final_file.string()));
}

Status abandon_staging(const fs::path& staging, const fs::path& final_path, const Status& why) {
  std::error_code ec;
  fs::remove_all(staging, ec);
  return why.with_context(fmt::format("writing {}", final_path.string()));
}

Result<Staging> Staging::directory(const fs::path& final_dir) {
  OPTSTATE_ASSIGN_OR_RETURN(fs::path staging, make_staging_dir(final_dir));
  return Staging(std::move(staging), final_dir, true);
}

Result<Staging> Staging::file(const fs::path& final_file) {
  OPTSTATE_ASSIGN_OR_RETURN(fs::path staging, make_staging_path(final_file));
  return Staging(std::move(staging), final_file, false);
}

Staging::Staging(Staging&& other) noexcept
    : staging_(std::move(other.staging_)), final_(std::move(other.final_)), is_directory_(other.is_directory_),
      settled_(other.settled_) {
  other.settled_ = true;
}

Staging& Staging::operator=(Staging&& other) noexcept {
  if (this != &other) {
    discard();
    staging_ = std::move(other.staging_);
    final_ = std::move(other.final_);
    is_directory_ = other.is_directory_;
    settled_ = other.settled_;
    other.settled_ = true;
  }
  return *this;
}

Staging::~Staging() { discard(); }

void Staging::discard() noexcept {
  if (settled_) return;
  settled_ = true;
  try {
    std::error_code ec;
    fs::remove_all(staging_, ec);  // a file the writer never created is simply absent
  } catch (...) {                  // std::bad_alloc inside remove_all: the leftover stays, findable
  }
}

Status Staging::commit(const Status& written, bool overwrite) {
  Status st = written;
  if (st.ok()) st = is_directory_ ? publish_directory(staging_, final_, overwrite) : publish_file(staging_, final_, overwrite);
  if (st.ok()) {
    settled_ = true;  // published: the staging name is gone (or holds the replaced checkpoint, already removed)
    return st;
  }
  discard();
  return abandon_staging(staging_, final_, st);
}

std::vector<Leftover> find_leftovers(const fs::path& final_path) {
  std::vector<Leftover> out;
  fs::path parent = final_path.parent_path();
  if (parent.empty()) parent = ".";
  if (final_path.filename().empty()) return out;
  const std::string name = staging_stem(final_path);
  std::error_code ec;
  fs::directory_iterator it(parent, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    std::string_view rest(n);
    const std::string partial = "." + name + ".partial-", old = "." + name + ".old-";
    if (rest.starts_with(partial)) rest.remove_prefix(partial.size());
    else if (rest.starts_with(old)) rest.remove_prefix(old.size());
    else continue;
    const std::string_view digits = rest.substr(0, rest.find('-'));
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string_view::npos)
      continue;
    const pid_t pid = static_cast<pid_t>(std::stoi(std::string(digits)));
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;  // still running here
    Leftover l{final_path.parent_path() / n, 0};  // as the caller named the directory
    std::error_code fe;
    if (it->is_regular_file(fe)) {
      l.bytes = it->file_size(fe);
    } else if (it->is_directory(fe) && !it->is_symlink(fe)) {
      for (fs::recursive_directory_iterator r(it->path(), fe), rend; !fe && r != rend; r.increment(fe))
        if (r->is_regular_file(fe)) l.bytes += r->file_size(fe);
    }
    out.push_back(std::move(l));
  }
  std::sort(out.begin(), out.end(), [](const Leftover& a, const Leftover& b) { return a.path < b.path; });
  return out;
}

Status publish_file(const fs::path& staging, const fs::path& final_file, bool overwrite) {
  fs::path parent = final_file.parent_path();
  if (parent.empty()) parent = ".";
  int fd = ::open(staging.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error(fmt::format("{}: cannot open: {}", staging.string(), errno_text()));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return io_error(fmt::format("{}: fsync failed: {}", staging.string(), errno_text()));
  OPTSTATE_RETURN_IF_ERROR(check_interrupt(final_file));  // the last moment a stop leaves nothing published
  std::error_code ec;
  if (overwrite) {
    if (fs::is_directory(final_file, ec))
      return invalid_argument(fmt::format("{}: is a directory; not replacing it with a file", final_file.string()));
    if (::rename(staging.c_str(), final_file.c_str()) != 0)
      return io_error(fmt::format("{}: cannot publish: {}", final_file.string(), errno_text()));
  } else if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, final_file.c_str(), RENAME_NOREPLACE) != 0) {
    if (errno == EEXIST) return invalid_argument(fmt::format("{}: already exists (overwrite not requested)", final_file.string()));
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
      return io_error(fmt::format("{}: cannot publish: {}", final_file.string(), errno_text()));
    // No RENAME_NOREPLACE here: link() fails on an existing name just as well.
    if (::link(staging.c_str(), final_file.c_str()) != 0)
      return io_error(fmt::format("{}: cannot publish: {}", final_file.string(), errno_text()));
    ::unlink(staging.c_str());
  }
  return fsync_directory(parent);
}

}  // namespace optstate
