// File I/O at the edges: positional reads, durable writes, directory commits, path containment.
// Parsers and encoders never touch files; they work on byte spans handed to them from here.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "optstate/status.h"

namespace optstate {

namespace fs = std::filesystem;

// Stopping a write from a signal handler (the CLI's, for SIGINT, SIGTERM and SIGHUP while it writes a
// checkpoint). request_interrupt is async-signal-safe: it only stores the signal number. From then on
// every OutputFile write, and each writer's own loop through check_interrupt, fails with kCancelled,
// so the writer stops and removes its staging output as after any other error: nothing is published
// and no partial output is left behind.
void request_interrupt(int signal) noexcept;
int interrupt_signal() noexcept;  // the signal that asked to stop; 0 if none
void clear_interrupt() noexcept;
// A kCancelled error naming `where` once an interrupt was requested; ok otherwise.
Status check_interrupt(const fs::path& where);

// Bytes that a resize leaves uninitialized (a buffer about to be written whole, such as a decoder's
// output): std::vector's value-initialization would write every byte twice.
template <class T>
struct DefaultInitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  using std::allocator<T>::allocator;
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using ByteVector = std::vector<std::byte, DefaultInitAllocator<std::byte>>;

// Where read bytes land, relative to the page cache: the kernel copies a pread's bytes with `rep
// movsb`, which on AMD Zen 3 runs about 6x slower when the destination lies 1 to 31 bytes past the
// source modulo the page size (4K aliasing; measured: hashing 1.6 GB from the page cache took 1.0 s
// with 16-byte-aligned heap buffers, 0.33 s without the skew). Reads avoid such skews.
inline constexpr size_t kPageBytes = 4096;
// True when a read from file offset `offset` into `dst` would hit that skew (a margin to 63 bytes).
inline bool skewed_read(uint64_t offset, const void* dst) {
  const uint64_t skew = (reinterpret_cast<uintptr_t>(dst) - offset) % kPageBytes;
  return skew != 0 && skew < 64;
}

// A reusable buffer for reading pieces of files: `for_read(offset, n)` gives n bytes placed at
// `offset`'s position within a page, so the kernel's copy is never skewed. Its contents are not
// kept when it grows.
class ReadBuffer {
 public:
  std::span<std::byte> for_read(uint64_t offset, size_t n);

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t capacity_ = 0;
};

// A file read by position. Its descriptor is process-wide pooled: at most max_open_inputs() are
// open at once, the least recently read one closed to make room and reopened when read again (and
// checked to be the same file), so a checkpoint of thousands of ranks' files reads within the
// usual limit of 1024 open files. Reads from several threads are safe.
class InputFile {
 public:
  static Result<InputFile> open(const fs::path& path);
  // A file held in memory whose bytes are made from elsewhere (a compressed item's, decoded):
  // `make` gives them all, and is called once here. They are let go when other made files'
  // bytes pass a process-wide budget (made_input_budget()), least recently read first, and made
  // again when read after that (a different size then is an error). `name` names it in errors.
  using Maker = std::function<Result<ByteVector>()>;
  static Result<InputFile> made(const fs::path& name, Maker make);
  InputFile(InputFile&& other) noexcept;
  InputFile& operator=(InputFile&& other) noexcept;
  InputFile(const InputFile&) = delete;
  ~InputFile();

  uint64_t size() const;
  const fs::path& path() const;
  // Reads exactly out.size() bytes at offset; a short file is a corrupt error naming the file.
  // A large read into a skewed destination (skewed_read) goes through a bounce buffer (8 MiB,
  // kept by the thread that needed it).
  Status read_at(uint64_t offset, std::span<std::byte> out) const;

  struct State;  // the pool's view of the file (io.cpp)

 private:
  InputFile() = default;
  std::unique_ptr<State> s_;
};
// The memory this process may use: the machine's, or its cgroup's limit where that is lower (a
// container's). What memory-bound readers size their caps by.
uint64_t machine_memory_bytes();
// What one hostile-input parser may hold in memory (a pickle's values, a JSON document): a quarter
// of machine_memory_bytes. Past it the parser refuses the file, naming it, before the machine runs
// out.
inline uint64_t parser_memory_budget() { return machine_memory_bytes() / 4; }
// How many bytes made InputFiles hold at once (those being read stay held regardless): a quarter
// of the machine's memory, within [1 GiB, 64 GiB], unless set (tests set less);
// set_made_input_budget returns the budget it replaced.
uint64_t made_input_budget();
uint64_t set_made_input_budget(uint64_t bytes);
// How many InputFile descriptors may be open at once: half the soft limit on open files (the rest
// is left for outputs), at least 8.
size_t max_open_inputs();
// Raises the soft limit on open files to the hard one (a write of many ranks keeps a file per rank
// open). Returns the limit now in force.
uint64_t raise_open_file_limit();

class OutputFile {
 public:
  // Creates a new file; fails if it exists.
  static Result<OutputFile> create(const fs::path& path);
  OutputFile(OutputFile&& other) noexcept;
  OutputFile& operator=(OutputFile&& other) noexcept;
  OutputFile(const OutputFile&) = delete;
  ~OutputFile();

  // Writes under kBufferBytes are gathered and handed to the kernel together (a DCP of 50,000
  // params writes ~10 small records per item: one write(2) each was 40% of the conversion).
  // What is gathered reaches the file by sync_and_close; a file dropped without it is incomplete
  // anyway (every writer removes its staging then).
  Status write(std::span<const std::byte> bytes);
  Status write_zeros(uint64_t count);
  // Overwrites bytes already written at `at` (a header field known only after its data: a CRC).
  Status patch(uint64_t at, std::span<const std::byte> bytes);
  uint64_t offset() const { return offset_; }
  // fsync + close; the file is durable when this returns ok.
  Status sync_and_close();

 private:
  OutputFile() = default;
  Status flush();  // hands the gathered bytes to the kernel
  static constexpr uint64_t kWritebackKickBytes = uint64_t{32} << 20;
  static constexpr size_t kBufferBytes = size_t{64} << 10;
  int fd_ = -1;
  uint64_t offset_ = 0;  // bytes written, gathered ones included
  uint64_t kicked_ = 0;  // bytes handed to writeback so far
  std::vector<std::byte> gathered_;
  fs::path path_;
};

// Reads a whole file that must not exceed max_bytes (checked before allocating).
Result<std::vector<std::byte>> read_small_file(const fs::path& path, uint64_t max_bytes);
// Writes a small file durably (create, write, fsync, close).
Status write_small_file(const fs::path& path, std::span<const std::byte> bytes);
// Copies a file byte for byte to a new file, durably, in pieces (a file beside a checkpoint that a
// write carries over).
Status copy_file_durably(const fs::path& from, const fs::path& to);
// Copies what a checkpoint's folder holds beside it, as it is: a file durably, a folder whole, a
// link as a link (never followed: a hostile folder's link to '/' stays a link). Errors name both.
Status copy_entry_as_is(const fs::path& from, const fs::path& to);
Status fsync_directory(const fs::path& dir);

// Joins a relative path read from a checkpoint onto its root, refusing anything that could leave the
// root: absolute paths, "..", empty components, backslashes and control characters.
Result<fs::path> contained_path(const fs::path& root, const std::string& relative);

// Makes a fresh staging directory beside `final_dir` (same filesystem, so the rename is atomic).
Result<fs::path> make_staging_dir(const fs::path& final_dir);
// Atomically publishes a fully written, fsync'd staging directory as final_dir. With overwrite, an
// existing final_dir is first renamed aside, then removed after the new one is in place.
Status publish_directory(const fs::path& staging, const fs::path& final_dir, bool overwrite);

// Single-file formats: a fresh, unused name beside `final_file` to write into, and the commit that
// fsyncs the written file, moves it into place in one rename (without overwrite: never replacing
// anything, RENAME_NOREPLACE) and fsyncs the directory. A reader sees the old file or the new one.
Result<fs::path> make_staging_path(const fs::path& final_file);
Status publish_file(const fs::path& staging, const fs::path& final_file, bool overwrite);

// After a failed write: removes the staging output (file or directory; never leave a partial
// checkpoint behind) and returns `why` naming the destination ("writing DST: ..."), as its message
// names the hidden staging path.
Status abandon_staging(const fs::path& staging, const fs::path& final_path, const Status& why);

// A staging output (directory or file) beside its destination, owned: removed on every path that does
// not publish it, also when an exception unwinds through the writer (a bug, std::bad_alloc), so no
// failed write leaves its hidden partial output behind. Only SIGKILL, OOM or power loss do
// (find_leftovers).
class Staging {
 public:
  static Result<Staging> directory(const fs::path& final_dir);  // made now (make_staging_dir)
  static Result<Staging> file(const fs::path& final_file);      // a free name; the writer creates it
  Staging(Staging&& other) noexcept;
  Staging& operator=(Staging&& other) noexcept;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging();

  const fs::path& path() const { return staging_; }
  // Ends the write: publishes it (publish_directory / publish_file) when `written` is ok; otherwise,
  // or when publishing fails, removes it and returns the error naming the destination
  // (abandon_staging).
  Status commit(const Status& written, bool overwrite);

 private:
  Staging(fs::path staging, fs::path final_path, bool is_directory)
      : staging_(std::move(staging)), final_(std::move(final_path)), is_directory_(is_directory) {}
  void discard() noexcept;

  fs::path staging_, final_;
  bool is_directory_ = false;
  bool settled_ = false;  // committed, abandoned or moved from: nothing left to remove
};

// What writes of `final_path` that were killed (SIGKILL, OOM, power loss) left beside it: staging
// outputs `.<name>.partial-<pid>-<hex>` and old checkpoints moved aside `.<name>.old-<pid>` whose
// process no longer runs on this machine (<name>: DST's name; over 200 bytes, its first 180 and
// `~<hash>`, so the suffixes fit NAME_MAX). Only found, never removed: on a shared filesystem
// another machine's writer may still own one.
struct Leftover {
  fs::path path;
  uint64_t bytes = 0;  // of its regular files
};
std::vector<Leftover> find_leftovers(const fs::path& final_path);

}  // namespace optstate
