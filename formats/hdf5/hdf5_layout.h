// The few HDF5 structures the driver reads itself, parsed as pure functions over bytes (reads go
// through a ReadAt the caller gives). libhdf5 parses the file; but it loops without end on a global
// heap collection whose object sizes walk onto a free-space object of size 0, so before libhdf5
// reads a variable-length string attribute the driver finds where the string is stored (the
// superblock, the object header and its continuation chunks, the attribute message) and walks the
// collection it lies in as libhdf5 will. Byte layouts: FORMAT.md ("What the driver parses itself").
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "optstate/status.h"

namespace optstate::hdf5 {

// Caps on what a hostile file can make this parser read.
inline constexpr uint64_t kMaxLocalHeapBytes = uint64_t{64} << 20;  // a symbol table's names
inline constexpr int kMaxSymbolTableNodes = 1 << 20;                 // B-tree and symbol nodes of one group
inline constexpr uint64_t kMaxDenseBytes = uint64_t{256} << 20;      // the messages of one dense storage
inline constexpr uint64_t kMaxHeaderChunkBytes = uint64_t{16} << 20;  // one object header chunk
inline constexpr int kMaxHeaderChunks = 4096;                          // chunks of one object header
inline constexpr uint64_t kMaxCollectionBytes = uint64_t{512} << 20;   // one global heap collection
inline constexpr uint64_t kMinCollectionBytes = 4096;                  // libhdf5's H5HG_MINSIZE

struct Superblock {
  int version = 0;
  int offset_size = 8;       // bytes of a file address
  int length_size = 8;       // bytes of a length
  uint64_t root_header = 0;  // the root group's object header, relative to the base address
  // Half the entries of a symbol table's B-tree nodes and symbol nodes: versions 0-1 hold them;
  // versions 2-3 keep them in the superblock extension where they differ from libhdf5's defaults
  // (read_superblock_extension). 0: unknown.
  unsigned group_internal_k = 0, group_leaf_k = 0;
  uint64_t extension = UINT64_MAX;    // versions 2-3: the extension's object header (UINT64_MAX: none)
  uint64_t driver_info = UINT64_MAX;  // versions 0-1: the driver information block (UINT64_MAX: none)
};
// The superblock from its signature on (`bytes`: at least up to its end; 256 bytes hold every
// version's). Versions 0-3; addresses and lengths of 2, 4 or 8 bytes.
Result<Superblock> parse_superblock(std::span<const std::byte> bytes, const std::string& where);

// Reads exactly out.size() bytes at `address` (relative to the base address), or an error.
using ReadAt = std::function<Status(uint64_t address, std::span<std::byte> out)>;

// Versions 2-3: the group K values, from the extension's B-tree 'K' values message (0x13:
// version(1)=0, indexed storage internal K(2), group internal K(2), group leaf K(2)) where there
// is one, else libhdf5's defaults (16 and 4), which it writes no message for. Every message
// libhdf5 1.10.8 decodes from the extension when it opens the file (before anything else can be
// checked, and trusting their sizes) is checked first: the K values (none 0), the driver info
// (its data inside it) and the file space info (its addresses inside it, a page size of 512 B to
// 1 GiB). A table of shared object header messages with indexes, and a metadata cache image, are
// refused: libhdf5 would read messages, or the metadata cache, from them and not from the headers
// these checks read.
Status read_superblock_extension(const ReadAt& read, Superblock& sb, const std::string& where);
// Versions 0-1: the driver information block, which libhdf5 reads when it opens the file: version
// 0, and the size it states (which libhdf5 allocates and reads) inside the file.
Status check_driver_info_block(const ReadAt& read, const Superblock& sb, const std::string& where);

// A variable-length value as stored: `length` elements (a string's bytes) in object `index` of the
// global heap collection at `collection` (0: nothing stored, libhdf5 reads nothing).
struct VlenRef {
  uint64_t length = 0;
  uint64_t collection = 0;
  uint32_t index = 0;
};

// Every attribute held as an attribute message in the object header at `header` (version 1, or 2
// with "OHDR") and its continuation chunks is checked to lie inside its message (parse sizes libhdf5
// 1.10 trusts); those whose type is a variable-length string come back with their stored values, in
// the order found, then those of dense storage (past 8 attributes: dense_messages). A
// shared attribute message is kept elsewhere: not found.
struct NamedVlenRef {
  std::string name;
  VlenRef ref;
};
Result<std::vector<NamedVlenRef>> find_vlen_string_attributes(const ReadAt& read, const Superblock& sb,
                                                              uint64_t header, const std::string& where);

// The messages of dense storage (a group's attributes or links past 8): every record of the name
// index (a version 2 B-tree) names a message in the fractal heap, read through the heap's doubling
// table (direct and indirect blocks), each part checked to lie where the file says. The messages of
// huge objects (kept through another B-tree) are not read.
enum class DenseKind { kAttributes, kLinks };
Result<std::vector<std::vector<std::byte>>> dense_messages(const ReadAt& read, const Superblock& sb, DenseKind kind,
                                                           uint64_t heap, uint64_t name_index,
                                                           const std::string& where);

// The messages libhdf5 1.10.8 decodes when it opens the dataset whose object header is at `header`
// (and its continuation chunks), each checked to lie inside itself: the dataspace, the datatype,
// fill values (and, where a value is given, of the datatype's element size), the data layout and the
// filter pipeline. Data stored outside the file (an external file list, a virtual dataset) is
// refused: the reader reads only what the file holds. How many layout messages (a dataset has one).
Result<int> check_dataset_header(const ReadAt& read, const Superblock& sb, uint64_t header, const std::string& where);
// A data layout message (versions 1-4): its fields lie inside it (a compact layout's data by the size
// it states); a chunked layout's dimensions number 2-33 (the rank, then the element size) and are
// none of them 0 (libhdf5 1.10.8 divides by each when it opens the dataset: SIGFPE); a virtual
// layout is refused. Versions and classes libhdf5 1.10 does not know pass (it refuses them itself).
Status check_layout_message(std::span<const std::byte> message, const Superblock& sb, const std::string& where);
// A datatype message: every nested type, member name and dimension inside it.
Status check_datatype_message(std::span<const std::byte> message, const std::string& where);
// A fill value message (`old`: type 0x0004; else 0x0005, versions 1-3): the value lies inside it.
// Its size; -1 when it gives no value.
Result<int64_t> fill_value_size(std::span<const std::byte> message, bool old, const std::string& where);
// A filter pipeline message (versions 1-2): at most 32 filters, each one's name (with its NUL) and
// values inside it; no N-bit or scale-offset filter (libhdf5 1.10 decompresses those unbounded).
Status check_filter_pipeline_message(std::span<const std::byte> message, const std::string& where);

// A link as a group's object header holds it (compact storage).
inline constexpr unsigned kHardLink = 0, kSoftLink = 1, kExternalLink = 64;  // 65-255: user-defined
struct Link {
  std::string name;
  unsigned type = kHardLink;
  uint64_t address = 0;  // a hard link's object header
};
// The messages libhdf5 1.10.8 decodes when it looks a name up in the group whose object header is at
// `header`, each checked to lie inside itself: every link message (libhdf5 decodes them all, copying
// names and values by the lengths they state), the link info, group info and symbol table messages,
// and a symbol table's B-tree, nodes and heap (check_symbol_table).
// The links held in the header, in order, then those of dense storage (past 8 links:
// dense_messages); none for a symbol table (its B-tree and local heap are walked, not listed).
Result<std::vector<Link>> check_group_header(const ReadAt& read, const Superblock& sb, uint64_t header,
                                             const std::string& where);
// A group's symbol table (the earliest file format; h5py's default): the local heap of its names
// (its free list inside it, no block twice), the v1 B-tree from `btree` (each node a group node of
// at most 2K entries, its children one level down, none twice) and the symbol nodes at its leaves
// (at most 2 x leaf K entries: libhdf5 1.10.8 decodes the stated count into an array of that many).
// Every name a key or entry points at, and every soft link's value, ends in a NUL inside the heap
// (libhdf5 compares and copies them as C strings). How many entries.
Result<uint64_t> check_symbol_table(const ReadAt& read, const Superblock& sb, uint64_t btree, uint64_t heap,
                                    const std::string& where);

// A link message (version 1): its name and value inside it. nullopt: one libhdf5 refuses itself (a
// version, flags or type it does not know, an empty name).
Result<std::optional<Link>> parse_link_message(std::span<const std::byte> message, const Superblock& sb,
                                               const std::string& where);

// A collection's size from its first 16 bytes ("GCOL", version 1, the size as a length), checked
// against kMinCollectionBytes and kMaxCollectionBytes.
Result<uint64_t> parse_collection_size(std::span<const std::byte> head, int length_size, const std::string& where);

// Walks the objects of `collection` (all its bytes) as libhdf5's loader does, and refuses what that
// loader would loop on or read past: a step of 0 bytes, an object running past the collection's end,
// an index twice. Then object `ref.index` must be there, holding exactly `ref.length` bytes (libhdf5
// copies the object's bytes into a buffer of the length's size).
Status check_collection(std::span<const std::byte> collection, int length_size, const VlenRef& ref,
                        const std::string& where);

}  // namespace optstate::hdf5
