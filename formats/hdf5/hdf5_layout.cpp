#include "hdf5_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <tuple>

namespace optstate::hdf5 {

namespace {

// Little-endian unsigned of `n` bytes (1-8) at `at`; the caller has checked the range.
uint64_t le(std::span<const std::byte> b, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | std::to_integer<uint64_t>(b[at + static_cast<size_t>(i)]);
  return v;
}

bool has(std::span<const std::byte> b, size_t at, uint64_t n) { return at <= b.size() && n <= b.size() - at; }

bool starts_with(std::span<const std::byte> b, size_t at, std::string_view sig) {
  return has(b, at, sig.size()) && std::memcmp(b.data() + at, sig.data(), sig.size()) == 0;
}

uint64_t align8(uint64_t x) { return (x + 7) / 8 * 8; }

bool valid_size(uint64_t n) { return n == 2 || n == 4 || n == 8; }

// An address or length of `n` bytes (1-8) with every bit set: HDF5's "undefined".
uint64_t undefined(size_t n) { return n >= 8 ? UINT64_MAX : (uint64_t{1} << (8 * n)) - 1; }

// Message types (the specification's IV.A.2).
constexpr unsigned kDataspaceMessage = 0x0001;
constexpr unsigned kLinkInfoMessage = 0x0002;
constexpr unsigned kDatatypeMessage = 0x0003;
constexpr unsigned kOldFillValueMessage = 0x0004;
constexpr unsigned kFillValueMessage = 0x0005;
constexpr unsigned kExternalFilesMessage = 0x0007;
constexpr unsigned kLayoutMessage = 0x0008;
constexpr unsigned kGroupInfoMessage = 0x000A;
constexpr unsigned kFilterPipelineMessage = 0x000B;
constexpr unsigned kLinkMessage = 0x0006;
constexpr unsigned kSymbolTableMessage = 0x0011;
constexpr unsigned kAttributeMessage = 0x000C;
constexpr unsigned kContinuationMessage = 0x0010;
constexpr unsigned kAttributeInfoMessage = 0x0015;
constexpr unsigned kSharedTableMessage = 0x000F;
constexpr unsigned kBtreeKMessage = 0x0013;
constexpr unsigned kDriverInfoMessage = 0x0014;
constexpr unsigned kFileSpaceInfoMessage = 0x0017;
constexpr unsigned kCacheImageMessage = 0x0018;
constexpr unsigned kSharedMessageFlag = 0x02;  // the message is stored elsewhere (a shared message)

struct Chunk {
  uint64_t address = 0, size = 0;  // where the messages lie (and, for OCHK, signature + checksum)
  bool continuation = false;
};

// One message as the walk gives it.
struct Message {
  unsigned type = 0, flags = 0;
  std::span<const std::byte> data;
};

// The messages of one chunk's message area: version 1 headers have 8-byte message headers (type u16,
// size u16, flags, 3 reserved); version 2 ones 4 (type u8, size u16, flags) plus a creation order
// (u16) when the header tracks it. Bytes too few for a message header at the end are a gap.
Status walk_messages(std::span<const std::byte> area, int version, bool creation_order,
                     const std::function<Status(const Message&)>& visit, const std::string& where) {
  const size_t head = version == 1 ? 8 : 4 + (creation_order ? 2 : 0);
  size_t p = 0;
  while (has(area, p, head)) {
    Message m;
    uint64_t size = 0;
    if (version == 1) {
      m.type = static_cast<unsigned>(le(area, p, 2));
      size = le(area, p + 2, 2);
      m.flags = static_cast<unsigned>(le(area, p + 4, 1));
    } else {
      m.type = static_cast<unsigned>(le(area, p, 1));
      size = le(area, p + 1, 2);
      m.flags = static_cast<unsigned>(le(area, p + 3, 1));
    }
    if (!has(area, p + head, size))
      return corrupt(fmt::format("{}: an object header message of {} bytes runs past its chunk's end", where, size));
    m.data = area.subspan(p + head, size);
    OPTSTATE_RETURN_IF_ERROR(visit(m));
    p += head + size;
  }
  return Status::Ok();
}

// A NUL-terminated name at `at` inside `b`: its length with the NUL, padded to 8 when `pad8`;
// nullopt when no NUL is inside (libhdf5 1.10 copies such names with strdup).
std::optional<size_t> name_field(std::span<const std::byte> b, size_t at, bool pad8) {
  if (at >= b.size()) return std::nullopt;
  const void* nul = std::memchr(b.data() + at, 0, b.size() - at);
  if (!nul) return std::nullopt;
  const size_t n = static_cast<size_t>(static_cast<const std::byte*>(nul) - (b.data() + at)) + 1;
  const size_t padded = pad8 ? static_cast<size_t>(align8(n)) : n;
  return has(b, at, padded) ? std::optional<size_t>(padded) : std::nullopt;
}

// How many bytes of `b` the datatype message at its start takes, every nested type, member name and
// dimension inside `b`; nullopt when something runs past it (libhdf5 1.10.8 decodes datatypes
// without bounds: an enumeration's names past the message were read by strdup, under ASan). The
// classes: 0 integer, 1 float, 2 time, 3 string, 4 bitfield, 5 opaque (a tag), 6 compound
// (members: a name, an offset, [v1: dimensions], a type), 7 reference, 8 enumeration (a base type,
// names, values), 9 variable-length (a base type), 10 array (dimensions, a base type).
std::optional<size_t> datatype_bytes(std::span<const std::byte> b, int depth) {
  if (depth > 16 || !has(b, 0, 8)) return std::nullopt;
  const unsigned cls = static_cast<unsigned>(le(b, 0, 1) & 0x0f), version = static_cast<unsigned>(le(b, 0, 1) >> 4);
  const uint64_t bits = le(b, 1, 3), size = le(b, 4, 4);
  size_t p = 8;
  const auto nested = [&](size_t at) -> bool {
    const auto n = at <= b.size() ? datatype_bytes(b.subspan(at), depth + 1) : std::nullopt;
    if (!n) return false;
    p = at + *n;
    return true;
  };
  switch (cls) {
    case 0: case 4: p += 4; break;
    case 1: p += 12; break;
    case 2: p += 2; break;
    case 3: case 7: break;
    case 5: p += bits & 0xff; break;  // the tag, padded to 8
    case 6: {
      const uint64_t members = bits & 0xffff;
      for (uint64_t m = 0; m < members; ++m) {
        const auto name = name_field(b, p, version < 3);
        if (!name) return std::nullopt;
        p += *name;
        if (version < 3) {
          p += 4 + 1 + 3 + 4 + 4 + (version == 1 ? 16 : 0);  // offset, rank, reserved, permutation, reserved, dims
        } else {
          int offset_bytes = 1;  // as few as hold the compound's size
          while (offset_bytes < 4 && (size >> (8 * offset_bytes)) != 0) ++offset_bytes;
          p += static_cast<size_t>(offset_bytes);
        }
        if (!nested(p)) return std::nullopt;
      }
      break;
    }
    case 8: {
      if (!nested(p)) return std::nullopt;
      const uint64_t base_size = le(b, 8 + 4, 4), members = bits & 0xffff;
      for (uint64_t m = 0; m < members; ++m) {
        const auto name = name_field(b, p, version < 3);
        if (!name) return std::nullopt;
        p += *name;
      }
      if (base_size != 0 && members > (b.size() - std::min(p, b.size())) / base_size) return std::nullopt;
      p += static_cast<size_t>(members * base_size);
      break;
    }
    case 9:
      if (!nested(p)) return std::nullopt;
      break;
    case 10: {
      if (!has(b, p, 1)) return std::nullopt;
      const uint64_t rank = le(b, p, 1);
      if (rank == 0 || rank > 32) return std::nullopt;
      p += (version < 3 ? 4 : 1) + static_cast<size_t>(rank) * (version < 3 ? 8 : 4);  // dims (+ permutation)
      if (!nested(p)) return std::nullopt;
      break;
    }
    default: return std::nullopt;
  }
  return p <= b.size() ? std::optional<size_t>(p) : std::nullopt;
}

// The elements of a dataspace message (its bytes): version 1 (version, rank, flags, 5 reserved) or
// 2 (version, rank, flags, type), then rank dimensions and, with flags & 1, as many maxima (lengths)
// and, in version 1 with flags & 2, as many permutation indices. Rank 0: one element (scalar),
// unless version 2 says null (type 2: none). nullopt: a version libhdf5 refuses itself; an error
// reads after "has ".
Result<std::optional<uint64_t>> dataspace_elements(std::span<const std::byte> space, int length_size) {
  if (!has(space, 0, 4)) return corrupt("a dataspace cut short");
  const int version = static_cast<int>(le(space, 0, 1));
  const uint64_t rank = le(space, 1, 1), flags = le(space, 2, 1);
  if (version != 1 && version != 2) return std::optional<uint64_t>();
  const size_t dims_at = version == 1 ? 8 : 4;
  const uint64_t L = static_cast<uint64_t>(length_size);
  const uint64_t lists = 1 + ((flags & 1) ? 1 : 0) + (version == 1 && (flags & 2) ? 1 : 0);
  if (rank > 32 || !has(space, dims_at, rank * L * lists))
    return corrupt(fmt::format("a dataspace of rank {} that its {} bytes do not hold", rank, space.size()));
  uint64_t elements = version == 2 && le(space, 3, 1) == 2 ? 0 : 1;
  for (uint64_t d = 0; d < rank; ++d) {
    const uint64_t n = le(space, dims_at + static_cast<size_t>(d * L), length_size);
    if (n != 0 && elements > UINT64_MAX / n) return corrupt("a dataspace of more elements than 2^64");
    elements *= n;
  }
  return std::optional<uint64_t>(elements);
}

// An attribute message (versions 1-3): its name, and where its datatype and data lie. Version 1 pads
// the name, datatype and dataspace to 8 bytes each; version 3 has a name character set byte.
// libhdf5 1.10 decodes every attribute message of a header when it looks one up (H5Aexists) and
// trusts the sizes inside (the name up to its NUL, the dataspace's dimensions, the data's
// elements x element size): each must lie inside the message, or the message is refused before
// libhdf5 reads past it. nullopt: a version libhdf5 refuses itself.
struct Attribute {
  std::string_view name;
  std::span<const std::byte> datatype;         // empty when the datatype is a shared (committed) one
  std::span<const std::byte> shared_datatype;  // then: the shared message saying where it is
  std::span<const std::byte> data;
  uint64_t elements = 0;
};
Result<std::optional<Attribute>> parse_attribute(std::span<const std::byte> m, int length_size,
                                                 const std::string& where) {
  const auto refuse = [&](std::string_view what) {
    return corrupt(fmt::format("{}: an attribute message of {} bytes {}", where, m.size(), what));
  };
  if (!has(m, 0, 8)) return refuse("is cut short");
  const int version = static_cast<int>(le(m, 0, 1));
  if (version < 1 || version > 3) return std::optional<Attribute>();
  const unsigned flags = version == 1 ? 0 : static_cast<unsigned>(le(m, 1, 1));
  const uint64_t name_size = le(m, 2, 2), type_size = le(m, 4, 2), space_size = le(m, 6, 2);
  const auto pad = [&](uint64_t n) { return version == 1 ? align8(n) : n; };
  size_t p = version == 3 ? 9 : 8;
  if (!has(m, p, pad(name_size)) || !has(m, p + pad(name_size), pad(type_size)) ||
      !has(m, p + pad(name_size) + pad(type_size), pad(space_size)))
    return refuse(fmt::format("has a name, datatype and dataspace of {}, {} and {} bytes, past its end", name_size,
                              type_size, space_size));
  Attribute a;
  const char* name = reinterpret_cast<const char*>(m.data() + p);
  a.name = std::string_view(name, strnlen(name, static_cast<size_t>(name_size)));
  if (a.name.size() + 1 != name_size) return refuse("has a name that does not end in its one NUL");
  p += pad(name_size);
  if (flags & 0x01) {
    a.shared_datatype = m.subspan(p, type_size);
  } else {
    a.datatype = m.subspan(p, type_size);
    if (!datatype_bytes(a.datatype, 0))
      return refuse(fmt::format("has a datatype (class {}) whose parts run past its {} bytes",
                                a.datatype.empty() ? 0 : le(a.datatype, 0, 1) & 0x0f, type_size));
  }
  p += pad(type_size);
  const std::span<const std::byte> space = m.subspan(p, space_size);
  p += pad(space_size);
  a.data = m.subspan(p);
  // A shared dataspace is kept in a shared message heap (no dataspace is committed).
  if (flags & 0x02) return refuse("has a shared dataspace, kept where this reader does not read");
  const auto elements = dataspace_elements(space, length_size);
  if (!elements.ok()) return refuse("has " + elements.status().message());
  if (!*elements) return std::optional<Attribute>();
  a.elements = **elements;
  if (a.datatype.empty()) return std::optional<Attribute>(a);  // the caller reads the committed one
  // The datatype's element size (a u32 after the class and bit field) times the elements.
  if (!has(a.datatype, 0, 8)) return refuse("has a datatype cut short");
  const uint64_t element_size = le(a.datatype, 4, 4);
  if (element_size != 0 && **elements > a.data.size() / element_size)
    return refuse(fmt::format("holds {} elements of {} bytes in {} bytes", **elements, element_size, a.data.size()));
  return std::optional<Attribute>(a);
}

}  // namespace

Result<Superblock> parse_superblock(std::span<const std::byte> b, const std::string& where) {
  static constexpr unsigned char kSig[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  if (!has(b, 0, 9) || std::memcmp(b.data(), kSig, 8) != 0)
    return corrupt(fmt::format("{}: no HDF5 superblock", where));
  Superblock sb;
  sb.version = static_cast<int>(le(b, 8, 1));
  size_t p = 0;
  if (sb.version == 0 || sb.version == 1) {
    if (!has(b, 0, 24)) return corrupt(fmt::format("{}: the HDF5 superblock is cut short", where));
    sb.offset_size = static_cast<int>(le(b, 13, 1));
    sb.length_size = static_cast<int>(le(b, 14, 1));
    sb.group_leaf_k = static_cast<unsigned>(le(b, 16, 2));
    sb.group_internal_k = static_cast<unsigned>(le(b, 18, 2));
    // 16: leaf/internal node K (2 + 2), consistency flags (4), version 1's indexed storage K (2 + 2);
    // then base, free-space, end-of-file and driver addresses; then the root's symbol table entry
    // (link name offset, object header address, ...).
    p = 24 + (sb.version == 1 ? 4 : 0) + 4 * static_cast<size_t>(sb.offset_size) + sb.offset_size;
  } else if (sb.version == 2 || sb.version == 3) {
    if (!has(b, 0, 12)) return corrupt(fmt::format("{}: the HDF5 superblock is cut short", where));
    sb.offset_size = static_cast<int>(le(b, 9, 1));
    sb.length_size = static_cast<int>(le(b, 10, 1));
    // 12: flags (1); base, superblock extension, end-of-file addresses; root object header address.
    p = 12 + 3 * static_cast<size_t>(sb.offset_size);
    if (valid_size(static_cast<uint64_t>(sb.offset_size)) && has(b, 12, 2 * static_cast<uint64_t>(sb.offset_size))) {
      const uint64_t ext = le(b, 12 + static_cast<size_t>(sb.offset_size), sb.offset_size);
      sb.extension = ext == undefined(static_cast<size_t>(sb.offset_size)) ? UINT64_MAX : ext;
    }
  } else {
    return corrupt(fmt::format("{}: HDF5 superblock version {} is not one this reader knows (0-3)", where, sb.version));
  }
  if (!valid_size(sb.offset_size) || !valid_size(sb.length_size))
    return corrupt(fmt::format("{}: HDF5 addresses of {} bytes and lengths of {} bytes are not supported (2, 4 or 8)",
                               where, sb.offset_size, sb.length_size));
  if (!has(b, p, sb.offset_size)) return corrupt(fmt::format("{}: the HDF5 superblock is cut short", where));
  sb.root_header = le(b, p, sb.offset_size);
  if (sb.version < 2) {
    const size_t O = static_cast<size_t>(sb.offset_size), driver_at = 24 + (sb.version == 1 ? 4 : 0) + 3 * O;
    const uint64_t driver = le(b, driver_at, sb.offset_size);
    sb.driver_info = driver == undefined(O) ? UINT64_MAX : driver;
  }
  return sb;
}

namespace {

// Every message of the object header at `header` (version 1, or 2 with "OHDR") and its continuation
// chunks, in order, to `visit` (continuation messages are followed, not visited).
Status walk_object_header(const ReadAt& read, const Superblock& sb, uint64_t header,
                          const std::function<Status(const Message&)>& visit, const std::string& at) {
  // The prefix: version 1 is 16 bytes (version, reserved, message count u16, reference count u32,
  // header size u32, 4 padding); version 2 starts "OHDR", version 2, flags, then optional times
  // (flags & 0x20: 4 x u32) and attribute phase change values (flags & 0x10: 2 x u16), then the
  // first chunk's size in 1 << (flags & 3) bytes.
  std::byte prefix[40] = {};
  OPTSTATE_RETURN_IF_ERROR(read(header, std::span(prefix, 16)).with_context(at));
  const std::span<const std::byte> pre(prefix);
  int version = 0;
  bool creation_order = false;
  std::deque<Chunk> chunks;
  if (starts_with(pre, 0, "OHDR")) {
    version = static_cast<int>(le(pre, 4, 1));
    if (version != 2) return corrupt(fmt::format("{}: version {} (\"OHDR\" is version 2)", at, version));
    const unsigned flags = static_cast<unsigned>(le(pre, 5, 1));
    creation_order = flags & 0x04;
    const size_t size_at = 6 + ((flags & 0x20) ? 16 : 0) + ((flags & 0x10) ? 4 : 0);
    const int size_bytes = 1 << (flags & 3);
    if (size_at + static_cast<size_t>(size_bytes) > 16)  // at most 34 bytes
      OPTSTATE_RETURN_IF_ERROR(
          read(header + 16, std::span(prefix + 16, size_at + static_cast<size_t>(size_bytes) - 16)).with_context(at));
    const uint64_t size = le(pre, size_at, size_bytes);
    chunks.push_back({header + size_at + static_cast<uint64_t>(size_bytes), size, false});
  } else if (le(pre, 0, 1) == 1) {
    version = 1;
    chunks.push_back({header + 16, le(pre, 8, 4), false});
  } else {
    return corrupt(fmt::format("{}: not an object header (no \"OHDR\", version {})", at, le(pre, 0, 1)));
  }
  std::set<uint64_t> seen;
  std::vector<std::byte> bytes;
  int count = 0;
  while (!chunks.empty()) {
    const Chunk c = chunks.front();
    chunks.pop_front();
    if (++count > kMaxHeaderChunks)
      return corrupt(fmt::format("{}: over {} continuation chunks", at, kMaxHeaderChunks));
    if (!seen.insert(c.address).second)
      return corrupt(fmt::format("{}: continuation chunk at {} is named twice", at, c.address));
    if (c.size > kMaxHeaderChunkBytes)
      return corrupt(fmt::format("{}: a chunk of {} bytes is over the {} MiB this reader takes", at, c.size,
                                 kMaxHeaderChunkBytes >> 20));
    bytes.resize(static_cast<size_t>(c.size));
    OPTSTATE_RETURN_IF_ERROR(read(c.address, bytes).with_context(at));
    std::span<const std::byte> area(bytes);
    if (version == 2 && c.continuation) {  // "OCHK", the messages, a checksum (u32)
      if (!starts_with(area, 0, "OCHK") || area.size() < 8)
        return corrupt(fmt::format("{}: continuation chunk at {} does not start \"OCHK\"", at, c.address));
      area = area.subspan(4, area.size() - 8);
    }
    const auto each = [&](const Message& m) -> Status {
      if (m.type != kContinuationMessage) return visit(m);
      const size_t o = static_cast<size_t>(sb.offset_size), l = static_cast<size_t>(sb.length_size);
      if (!has(m.data, 0, o + l))
        return corrupt(fmt::format("{}: a continuation message of {} bytes is cut short", at, m.data.size()));
      chunks.push_back({le(m.data, 0, sb.offset_size), le(m.data, o, sb.length_size), true});
      return Status::Ok();
    };
    OPTSTATE_RETURN_IF_ERROR(walk_messages(area, version, creation_order, each, at));
  }
  return Status::Ok();
}

}  // namespace

namespace {

// Messages libhdf5 reads from elsewhere when their header says "shared" (its shareable classes);
// it decodes the others as they are, whatever the flag says.
bool shareable(unsigned type) {
  return type == kDataspaceMessage || type == kDatatypeMessage || type == kOldFillValueMessage ||
         type == kFillValueMessage || type == kFilterPipelineMessage || type == kAttributeMessage;
}

// Where a shared message (versions 1-3) says the message is: another object's header, the only place
// this reader follows (a committed datatype's). One in a shared message heap (type 1, which libhdf5
// takes as such from version 2 on) is refused. Version 1: version, type (ignored), 6 reserved, a
// length libhdf5 skips, the address; versions 2-3: version, type, the address or an 8-byte heap ID.
Result<uint64_t> shared_message_address(std::span<const std::byte> m, const Superblock& sb, const std::string& what) {
  const size_t O = static_cast<size_t>(sb.offset_size);
  const uint64_t version = has(m, 0, 2) ? le(m, 0, 1) : 0;
  if (version >= 2 && version <= 3 && le(m, 1, 1) == 1)
    return corrupt(fmt::format("{} is kept in a shared message heap, which this reader does not read", what));
  const size_t address_at = version == 1 ? 8 + static_cast<size_t>(sb.length_size) : 2;
  if (version < 1 || version > 3 || !has(m, address_at, O))
    return corrupt(fmt::format("{}: a shared message of {} bytes (version {}) that is not one", what, m.size(), version));
  return le(m, address_at, sb.offset_size);
}

// The datatype message of the committed datatype whose object header is at `address` (libhdf5
// decodes it in place of a shared one), checked; not itself shared again.
Result<std::vector<std::byte>> committed_datatype(const ReadAt& read, const Superblock& sb, uint64_t address,
                                                  const std::string& what) {
  const std::string at = fmt::format("{}: its committed datatype's object header at {}", what, address);
  std::optional<std::vector<std::byte>> found;
  OPTSTATE_RETURN_IF_ERROR(walk_object_header(
      read, sb, address,
      [&](const Message& m) -> Status {
        if (m.type != kDatatypeMessage || found) return Status::Ok();
        if (m.flags & kSharedMessageFlag) return corrupt(fmt::format("{}: a datatype shared again", at));
        found.emplace(m.data.begin(), m.data.end());
        return Status::Ok();
      },
      at));
  if (!found) return corrupt(fmt::format("{}: no datatype message", at));
  OPTSTATE_RETURN_IF_ERROR(check_datatype_message(*found, at));
  return std::move(*found);
}

int log2_of(uint64_t n) {  // floor(log2(n)); 0 for 0
  int bits = 0;
  while (n >> bits > 1) ++bits;
  return bits;
}
// Bytes that hold `n` (libhdf5's H5VM_limit_enc_size: log2(n) / 8 + 1).
int bytes_for(uint64_t n) { return log2_of(n) / 8 + 1; }

Status walk_v2_btree(const ReadAt& read, const Superblock& sb, uint64_t address, unsigned type, const std::string& at,
                     const std::function<Status(std::span<const std::byte>)>& visit);

// A fractal heap (where dense storage keeps a group's attribute or link messages): its header and
// the objects its heap IDs name, read through its doubling table of direct and indirect blocks, or
// (huge objects, past the heap's largest managed size) where its huge object B-tree says.
class FractalHeap {
 public:
  static Result<FractalHeap> open(const ReadAt& read, const Superblock& sb, uint64_t address, const std::string& at) {
    FractalHeap h(read, sb, at);
    const size_t O = static_cast<size_t>(sb.offset_size), L = static_cast<size_t>(sb.length_size);
    // "FRHP" version(1)=0 heap ID length(2) filters length(2) flags(1) max managed size(4), then
    // 12 lengths and addresses, table width(2) starting block size(L) max direct block size(L)
    // max heap size in bits(2) starting root rows(2) root block address(O) root rows(2)
    // [filters: root direct block's filtered size(L) mask(4) the filters] checksum(4).
    std::vector<std::byte> b(22 + 12 * L + 3 * O);
    OPTSTATE_RETURN_IF_ERROR(read(address, b).with_context(at));
    if (!starts_with(b, 0, "FRHP") || le(b, 4, 1) != 0)
      return corrupt(fmt::format("{}: the fractal heap at {} is not one (\"FRHP\", version 0)", at, address));
    h.filters_ = le(b, 7, 2) != 0;
    h.checksummed_direct_ = le(b, 9, 1) & 0x02;
    h.max_managed_ = le(b, 10, 4);
    // 14: next huge object ID(L), huge object B-tree address(O). A huge object's ID holds its
    // address and length where the heap ID has room for them (libhdf5's H5HF__huge_init), else a
    // key of up to 8 bytes into that B-tree.
    const uint64_t id_length = le(b, 5, 2);
    h.huge_btree_ = le(b, 14 + L, sb.offset_size);
    h.huge_direct_ = id_length >= 1 + O + L;
    h.huge_key_bytes_ = static_cast<int>(std::clamp<uint64_t>(id_length, 1, 9) - 1);
    const size_t p = 14 + 10 * L + 2 * O;  // the table width
    h.width_ = le(b, p, 2);
    h.start_ = le(b, p + 2, sb.length_size);
    h.max_direct_ = le(b, p + 2 + L, sb.length_size);
    h.heap_bits_ = le(b, p + 2 + 2 * L, 2);
    h.root_ = le(b, p + 2 + 2 * L + 4, sb.offset_size);
    h.root_rows_ = le(b, p + 2 + 2 * L + 4 + O, 2);
    const auto power_of_2 = [](uint64_t n) { return n != 0 && (n & (n - 1)) == 0; };
    if (h.width_ == 0 || h.width_ > 65536 || !power_of_2(h.width_) || !power_of_2(h.start_) ||
        !power_of_2(h.max_direct_) || h.max_direct_ < h.start_ || h.max_direct_ > kMaxHeaderChunkBytes ||
        h.heap_bits_ == 0 || h.heap_bits_ > 64 || h.root_rows_ > 64)
      return corrupt(fmt::format("{}: the fractal heap at {} has a table of width {}, blocks of {} to {} bytes, "
                                 "{}-bit offsets and {} root rows, which libhdf5 does not write",
                                 at, address, h.width_, h.start_, h.max_direct_, h.heap_bits_, h.root_rows_));
    h.offset_bytes_ = static_cast<int>((h.heap_bits_ + 7) / 8);
    h.length_bytes_ = std::min(static_cast<int>((log2_of(h.max_direct_) + 7) / 8), bytes_for(h.max_managed_));
    h.max_direct_rows_ = static_cast<uint64_t>(log2_of(h.max_direct_) - log2_of(h.start_) + 2);
    return h;
  }

  // The object a heap ID names: a managed object's bytes (from its direct block), a tiny one's
  // (inside the ID) or a huge one's (where the ID, or the huge object B-tree, says).
  Result<std::optional<std::vector<std::byte>>> object(std::span<const std::byte> id) const {
    if (id.empty()) return corrupt(fmt::format("{}: an empty fractal heap ID", at_));
    const unsigned type = (std::to_integer<unsigned>(id[0]) >> 4) & 0x3;
    if (type == 1) return huge_object(id);
    if (type == 2) {  // tiny: the length - 1 in the low 4 bits, the bytes after
      const size_t n = (std::to_integer<size_t>(id[0]) & 0x0f) + 1;
      if (!has(id, 1, n)) return corrupt(fmt::format("{}: a tiny fractal heap object of {} bytes past its ID", at_, n));
      return std::optional<std::vector<std::byte>>(std::vector<std::byte>(id.begin() + 1, id.begin() + 1 + n));
    }
    if (type != 0 || !has(id, 1, static_cast<uint64_t>(offset_bytes_ + length_bytes_)))
      return corrupt(fmt::format("{}: a fractal heap ID of type {} in {} bytes", at_, type, id.size()));
    const uint64_t offset = le(id, 1, offset_bytes_), length = le(id, 1 + static_cast<size_t>(offset_bytes_), length_bytes_);
    if (length == 0 || length > max_managed_)
      return corrupt(fmt::format("{}: a fractal heap object of {} bytes (1 to {})", at_, length, max_managed_));
    // Down the doubling table: rows 0 and 1 of blocks of the starting size, each further row's
    // twice the last; rows below max_direct_rows_ are direct blocks, those past, indirect ones.
    uint64_t block = root_, block_offset = 0, rows = root_rows_;
    for (int depth = 0; depth < 64; ++depth) {
      if (rows == 0) return read_direct(block, block_offset, start_, offset, length);
      const std::string iblock_at = fmt::format("{}: the fractal heap's indirect block at {}", at_, block);
      uint64_t row_start = block_offset, row = 0, column = 0, size = 0;
      for (; row < rows; ++row) {
        size = row_size(row);
        if (size > UINT64_MAX / width_ || row_start > UINT64_MAX - size * width_)
          return corrupt(fmt::format("{} has rows past 2^64 bytes", iblock_at));
        if (offset >= row_start && offset - row_start < size * width_) break;
        row_start += size * width_;
      }
      if (row == rows) return corrupt(fmt::format("{}: heap offset {} lies past its {} rows", iblock_at, offset, rows));
      column = (offset - row_start) / size;
      const uint64_t entry = row * width_ + column;
      // "FHIB" version(1) heap header(O) block offset, then each entry: a direct block's address
      // (with filters, its filtered size(L) and mask(4)) or an indirect block's address.
      const uint64_t O = static_cast<uint64_t>(sb_.offset_size), L = static_cast<uint64_t>(sb_.length_size);
      const uint64_t direct_entry = O + (filters_ ? L + 4 : 0);
      const uint64_t direct_entries = std::min(row, max_direct_rows_) * width_ + (row < max_direct_rows_ ? column : 0);
      const uint64_t at = 5 + O + static_cast<uint64_t>(offset_bytes_) + direct_entries * direct_entry +
                          (entry - direct_entries) * O;
      std::byte head[5];
      OPTSTATE_RETURN_IF_ERROR(read_(block, head).with_context(iblock_at));
      if (!starts_with(head, 0, "FHIB")) return corrupt(fmt::format("{} is not one (\"FHIB\")", iblock_at));
      std::vector<std::byte> address(static_cast<size_t>(O));
      OPTSTATE_RETURN_IF_ERROR(read_(block + at, address).with_context(iblock_at));
      block = le(address, 0, sb_.offset_size);
      block_offset = row_start + column * size;
      if (row < max_direct_rows_) return read_direct(block, block_offset, size, offset, length);
      rows = static_cast<uint64_t>(log2_of(size) - log2_of(start_ * width_) + 1);
    }
    return corrupt(fmt::format("{}: the fractal heap's indirect blocks nest past 64", at_));
  }

 private:
  FractalHeap(const ReadAt& read, const Superblock& sb, std::string at) : read_(read), sb_(sb), at_(std::move(at)) {}

  uint64_t row_size(uint64_t row) const { return row < 2 ? start_ : start_ << std::min<uint64_t>(row - 1, 63); }

  // The object at heap `offset` in the direct block at `address` (of `size` bytes, starting at
  // heap offset `block_offset`): "FHDB" version(1) heap header(O) block offset [checksum(4)], then
  // objects, each at its heap offset less the block's.
  Result<std::optional<std::vector<std::byte>>> read_direct(uint64_t address, uint64_t block_offset, uint64_t size,
                                                            uint64_t offset, uint64_t length) const {
    const std::string dblock_at = fmt::format("{}: the fractal heap's direct block at {}", at_, address);
    const uint64_t header = 5 + static_cast<uint64_t>(sb_.offset_size + offset_bytes_) + (checksummed_direct_ ? 4 : 0);
    const uint64_t in_block = offset - block_offset;
    if (offset < block_offset || in_block < header || in_block > size || length > size - in_block)
      return corrupt(fmt::format("{}: an object of {} bytes at heap offset {} runs outside its {} bytes", dblock_at,
                                 length, offset, size));
    std::byte head[5];
    OPTSTATE_RETURN_IF_ERROR(read_(address, head).with_context(dblock_at));
    if (!starts_with(head, 0, "FHDB")) return corrupt(fmt::format("{} is not one (\"FHDB\")", dblock_at));
    std::vector<std::byte> bytes(static_cast<size_t>(length));
    OPTSTATE_RETURN_IF_ERROR(read_(address + in_block, bytes).with_context(dblock_at));
    return std::optional<std::vector<std::byte>>(std::move(bytes));
  }

  // A huge object: libhdf5 reads the length its ID or B-tree record gives, from the address there.
  Result<std::optional<std::vector<std::byte>>> huge_object(std::span<const std::byte> id) const {
    // libhdf5 decompresses a filtered heap's huge objects; it writes no filtered attribute or link heap.
    if (filters_)
      return corrupt(fmt::format("{}: a huge object of a filtered fractal heap (libhdf5 writes none for attributes or "
                                 "links)",
                                 at_));
    const size_t O = static_cast<size_t>(sb_.offset_size), L = static_cast<size_t>(sb_.length_size);
    uint64_t address = 0, length = 0;
    if (huge_direct_) {
      if (!has(id, 1, O + L)) return corrupt(fmt::format("{}: a huge object ID of {} bytes", at_, id.size()));
      address = le(id, 1, sb_.offset_size);
      length = le(id, 1 + O, sb_.length_size);
    } else {
      if (!has(id, 1, static_cast<uint64_t>(huge_key_bytes_)))
        return corrupt(fmt::format("{}: a huge object ID of {} bytes", at_, id.size()));
      const uint64_t key = le(id, 1, huge_key_bytes_);
      if (!huge_) {  // the B-tree's records (type 1: address(O) length(L) key(L)), read once
        if (huge_btree_ == undefined(O))
          return corrupt(fmt::format("{}: huge object {} of a heap with no huge object B-tree", at_, key));
        std::map<uint64_t, std::pair<uint64_t, uint64_t>> records;
        OPTSTATE_RETURN_IF_ERROR(walk_v2_btree(
            read_, sb_, huge_btree_, 1, at_ + ": huge objects", [&](std::span<const std::byte> r) -> Status {
              if (r.size() != O + 2 * L)
                return corrupt(fmt::format("{}: huge object records of {} bytes ({})", at_, r.size(), O + 2 * L));
              if (!records.emplace(le(r, O + L, sb_.length_size), std::pair(le(r, 0, sb_.offset_size), le(r, O, sb_.length_size)))
                       .second)
                return corrupt(fmt::format("{}: huge object {} is recorded twice", at_, le(r, O + L, sb_.length_size)));
              return Status::Ok();
            }));
        huge_ = std::move(records);
      }
      const auto it = huge_->find(key);
      if (it == huge_->end())
        return corrupt(fmt::format("{}: huge object {} is not in the heap's huge object B-tree", at_, key));
      std::tie(address, length) = it->second;
    }
    if (length == 0 || length > kMaxDenseBytes)
      return corrupt(fmt::format("{}: a huge object of {} bytes (1 to {} MiB)", at_, length, kMaxDenseBytes >> 20));
    std::vector<std::byte> bytes(static_cast<size_t>(length));
    OPTSTATE_RETURN_IF_ERROR(read_(address, bytes).with_context(fmt::format("{}: the huge object at {}", at_, address)));
    return std::optional<std::vector<std::byte>>(std::move(bytes));
  }

  ReadAt read_;
  Superblock sb_;
  std::string at_;
  uint64_t huge_btree_ = 0;
  bool huge_direct_ = false;
  int huge_key_bytes_ = 0;
  mutable std::optional<std::map<uint64_t, std::pair<uint64_t, uint64_t>>> huge_;  // key -> address, length
  bool filters_ = false, checksummed_direct_ = false;
  uint64_t max_managed_ = 0, width_ = 0, start_ = 0, max_direct_ = 0, heap_bits_ = 0, root_ = 0, root_rows_ = 0;
  uint64_t max_direct_rows_ = 0;
  int offset_bytes_ = 0, length_bytes_ = 0;
};

// Every record of the version 2 B-tree at `address` (its header: "BTHD" version(1)=0 type(1) node
// size(4) record size(2) depth(2) split(1) merge(1) root(O) root records(2) total records(L)
// checksum(4)), leaves ("BTLF" version type records checksum) and internal nodes ("BTIN" version
// type records, then each child: address(O) records (as many bytes as a leaf's most need) [below
// depth 1: total records below] checksum), in key order, to `visit`.
Status walk_v2_btree(const ReadAt& read, const Superblock& sb, uint64_t address, unsigned type, const std::string& at,
                     const std::function<Status(std::span<const std::byte>)>& visit) {
  const size_t O = static_cast<size_t>(sb.offset_size), L = static_cast<size_t>(sb.length_size);
  std::vector<std::byte> h(16 + O + 2 + L);
  OPTSTATE_RETURN_IF_ERROR(read(address, h).with_context(at));
  if (!starts_with(h, 0, "BTHD") || le(h, 4, 1) != 0 || le(h, 5, 1) != type)
    return corrupt(fmt::format("{}: the v2 B-tree at {} is not one of type {} (\"BTHD\", version 0)", at, address, type));
  const uint64_t node_size = le(h, 6, 4), record_size = le(h, 10, 2), depth = le(h, 12, 2);
  constexpr uint64_t kPrefix = 10;  // signature, version, type, checksum
  if (record_size == 0 || node_size <= kPrefix || node_size > kMaxHeaderChunkBytes || depth > 32)
    return corrupt(fmt::format("{}: the v2 B-tree at {} has nodes of {} bytes, records of {} and depth {}", at,
                               address, node_size, record_size, depth));
  // How many records a node at each depth holds, and the bytes that encode a child's counts
  // (libhdf5's H5B2__hdr_init).
  std::vector<uint64_t> max_records(depth + 1), cumulative(depth + 1);
  std::vector<int> cumulative_bytes(depth + 1);
  max_records[0] = (node_size - kPrefix) / record_size;
  cumulative[0] = max_records[0];
  cumulative_bytes[0] = bytes_for(cumulative[0]);
  const int leaf_count_bytes = bytes_for(max_records[0]);
  for (uint64_t d = 1; d <= depth; ++d) {
    const uint64_t pointer = O + static_cast<uint64_t>(leaf_count_bytes) + (d > 1 ? cumulative_bytes[d - 1] : 0);
    if (node_size < kPrefix + pointer) return corrupt(fmt::format("{}: the v2 B-tree at {}: nodes too small", at, address));
    max_records[d] = (node_size - (kPrefix + pointer)) / (record_size + pointer);
    const unsigned __int128 c = (static_cast<unsigned __int128>(max_records[d]) + 1) * cumulative[d - 1] + max_records[d];
    cumulative[d] = c > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(c);
    cumulative_bytes[d] = bytes_for(cumulative[d]);
  }
  struct Node {
    uint64_t address, records, depth;
  };
  std::deque<Node> pending{{le(h, 16, sb.offset_size), le(h, 16 + O, 2), depth}};
  std::set<uint64_t> seen;
  std::vector<std::byte> node;
  while (!pending.empty()) {
    const Node n = pending.front();
    pending.pop_front();
    if (n.records == 0) continue;
    const std::string node_at = fmt::format("{}: the v2 B-tree node at {}", at, n.address);
    if (!seen.insert(n.address).second || seen.size() > static_cast<size_t>(kMaxSymbolTableNodes))
      return corrupt(fmt::format("{} is reached twice", node_at));
    if (n.records > max_records[n.depth])
      return corrupt(fmt::format("{} holds {} records, over the {} its size allows", node_at, n.records,
                                 max_records[n.depth]));
    node.resize(static_cast<size_t>(node_size));
    OPTSTATE_RETURN_IF_ERROR(read(n.address, node).with_context(node_at));
    if (!starts_with(node, 0, n.depth == 0 ? "BTLF" : "BTIN") || le(node, 5, 1) != type)
      return corrupt(fmt::format("{} is not a {} node", node_at, n.depth == 0 ? "leaf" : "internal"));
    for (uint64_t r = 0; r < n.records; ++r)
      OPTSTATE_RETURN_IF_ERROR(visit(std::span(node).subspan(6 + static_cast<size_t>(r * record_size),
                                                             static_cast<size_t>(record_size))));
    if (n.depth == 0) continue;
    size_t p = 6 + static_cast<size_t>(n.records * record_size);
    const size_t total_bytes = n.depth > 1 ? static_cast<size_t>(cumulative_bytes[n.depth - 1]) : 0;
    for (uint64_t c = 0; c <= n.records; ++c) {
      if (!has(node, p, O + static_cast<size_t>(leaf_count_bytes) + total_bytes + 4))
        return corrupt(fmt::format("{}: child {} lies past the node's {} bytes", node_at, c, node_size));
      pending.push_back({le(node, p, sb.offset_size), le(node, p + O, leaf_count_bytes), n.depth - 1});
      p += O + static_cast<size_t>(leaf_count_bytes) + total_bytes;
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<std::vector<std::byte>>> dense_messages(const ReadAt& read, const Superblock& sb, DenseKind kind,
                                                           uint64_t heap, uint64_t name_index,
                                                           const std::string& where) {
  const bool links = kind == DenseKind::kLinks;
  const std::string at = fmt::format("{}: dense {} storage", where, links ? "link" : "attribute");
  OPTSTATE_ASSIGN_OR_RETURN(const FractalHeap h, FractalHeap::open(read, sb, heap, at));
  std::vector<std::vector<std::byte>> messages;
  uint64_t total = 0;
  // Name index records: links (type 5) name hash(4) heap ID(7); attributes (type 8) heap ID(8)
  // message flags(1) creation order(4) name hash(4).
  const size_t id_at = links ? 4 : 0, id_size = links ? 7 : 8, record_size = links ? 11 : 17;
  OPTSTATE_RETURN_IF_ERROR(walk_v2_btree(
      read, sb, name_index, links ? 5 : 8, at, [&](std::span<const std::byte> record) -> Status {
        if (record.size() != record_size)
          return corrupt(fmt::format("{}: name index records of {} bytes ({})", at, record.size(), record_size));
        if (!links && (le(record, 8, 1) & kSharedMessageFlag))  // only a shared message heap shares them
          return corrupt(fmt::format("{}: a shared attribute, kept in a shared message heap, which this reader does "
                                     "not read",
                                     at));
        OPTSTATE_ASSIGN_OR_RETURN(auto object, h.object(record.subspan(id_at, id_size)));
        if (!object) return Status::Ok();
        total += object->size();  // records may all name one large object
        if (total > kMaxDenseBytes)
          return corrupt(fmt::format("{}: messages of over {} MiB", at, kMaxDenseBytes >> 20));
        messages.push_back(std::move(*object));
        return Status::Ok();
      }));
  return messages;
}

Result<std::vector<NamedVlenRef>> find_vlen_string_attributes(const ReadAt& read, const Superblock& sb,
                                                              uint64_t header, const std::string& where) {
  const std::string at = fmt::format("{}: the object header at {}", where, header);
  std::vector<NamedVlenRef> found;
  std::optional<std::pair<uint64_t, uint64_t>> dense;  // the fractal heap, the name index
  const auto attribute = [&](std::span<const std::byte> message) -> Status {
    OPTSTATE_ASSIGN_OR_RETURN(auto a, parse_attribute(message, sb.length_size, at));
    if (!a) return Status::Ok();
    std::vector<std::byte> committed;
    if (a->datatype.empty()) {  // a committed datatype: libhdf5 decodes it, and copies the data by its size
      const std::string what = fmt::format("{}: attribute '{}'", at, a->name);
      OPTSTATE_ASSIGN_OR_RETURN(
          const uint64_t address,
          shared_message_address(a->shared_datatype, sb, fmt::format("{}: the datatype of attribute '{}'", at, a->name)));
      OPTSTATE_ASSIGN_OR_RETURN(committed, committed_datatype(read, sb, address, what));
      a->datatype = committed;
      const uint64_t element_size = le(a->datatype, 4, 4);
      if (element_size != 0 && a->elements > a->data.size() / element_size)
        return corrupt(fmt::format("{}: holds {} elements of {} bytes in {} bytes", what, a->elements, element_size,
                                   a->data.size()));
    }
    // A variable-length (class 9) string (type 1 in the low bits of the class bit field).
    if (a->datatype.size() < 2 || (le(a->datatype, 0, 1) & 0x0f) != 9 || (le(a->datatype, 1, 1) & 0x0f) != 1)
      return Status::Ok();
    // Its characters are its base type's elements (the datatype walk found that type inside the
    // message): libhdf5 reads length x their size from the heap object, where the collection check
    // expects length bytes (a size of 2^30 + 1 made it allocate and fill 13 GiB for 13 characters).
    if (le(a->datatype, 12, 4) != 1)
      return corrupt(fmt::format("{}: attribute '{}' is a variable-length string of {}-byte characters (1)", at,
                                 a->name, le(a->datatype, 12, 4)));
    const size_t need = 8 + static_cast<size_t>(sb.offset_size);
    // Each element as stored is a length, a collection address and an object index: libhdf5 keeps
    // the data by the stated element size and reads it by that one (a size of 5 made H5Aread copy
    // 16 bytes from 13, fuzz_hdf5_file).
    if (le(a->datatype, 4, 4) != need)
      return corrupt(fmt::format("{}: attribute '{}' is a variable-length string of {}-byte elements ({}: length, "
                                 "collection address, object index)",
                                 at, a->name, le(a->datatype, 4, 4), need));
    if (!has(a->data, 0, need))
      return corrupt(fmt::format("{}: attribute '{}' holds {} bytes, not a variable-length value", at, a->name,
                                 a->data.size()));
    found.push_back({std::string(a->name),
                     {le(a->data, 0, 4), le(a->data, 4, sb.offset_size),
                      static_cast<uint32_t>(le(a->data, 4 + static_cast<size_t>(sb.offset_size), 4))}});
    return Status::Ok();
  };
  const size_t O = static_cast<size_t>(sb.offset_size);
  const auto visit = [&](const Message& m) -> Status {
    if (m.type == kAttributeMessage && (m.flags & kSharedMessageFlag))  // only a shared message heap shares them
      return corrupt(fmt::format("{}: a shared attribute, kept in a shared message heap, which this reader does not "
                                 "read",
                                 at));
    if (m.type == kAttributeMessage) return attribute(m.data);
    if (m.type != kAttributeInfoMessage) return Status::Ok();
    // version(1)=0 flags(1) [flags&1: max creation index(2)] fractal heap(O) name index(O)
    // [flags&2: creation order index(O)]; an undefined heap: no dense storage.
    if (!has(m.data, 0, 2)) return corrupt(fmt::format("{}: an attribute info message is cut short", at));
    const size_t heap_at = 2 + ((le(m.data, 1, 1) & 1) ? 2 : 0);
    if (!has(m.data, heap_at, 2 * O + ((le(m.data, 1, 1) & 2) ? O : 0)))
      return corrupt(fmt::format("{}: an attribute info message of {} bytes is cut short", at, m.data.size()));
    const uint64_t heap = le(m.data, heap_at, sb.offset_size);
    if (heap != undefined(O)) dense = {heap, le(m.data, heap_at + O, sb.offset_size)};
    return Status::Ok();
  };
  OPTSTATE_RETURN_IF_ERROR(walk_object_header(read, sb, header, visit, at));
  if (dense) {  // past 8 attributes: their messages in a fractal heap, found through a name index
    OPTSTATE_ASSIGN_OR_RETURN(const auto messages,
                              dense_messages(read, sb, DenseKind::kAttributes, dense->first, dense->second, at));
    for (const auto& message : messages) OPTSTATE_RETURN_IF_ERROR(attribute(message));
  }
  return found;
}

Status read_superblock_extension(const ReadAt& read, Superblock& sb, const std::string& where) {
  if (sb.version < 2) return Status::Ok();
  sb.group_internal_k = 16;
  sb.group_leaf_k = 4;
  if (sb.extension == UINT64_MAX) return Status::Ok();
  const std::string at = fmt::format("{}: the superblock extension at {}", where, sb.extension);
  const size_t O = static_cast<size_t>(sb.offset_size), L = static_cast<size_t>(sb.length_size);
  // The messages libhdf5 1.10.8 decodes from the extension in H5Fopen, none of them bounded by the
  // message's size there (none is shareable: the shared flag changes nothing for them).
  return walk_object_header(
      read, sb, sb.extension,
      [&](const Message& m) -> Status {
        const auto refuse = [&](std::string_view what) {
          return corrupt(fmt::format("{}: a {} message of {} bytes {}", at, what, m.data.size(),
                                     "is cut short or not one libhdf5 reads"));
        };
        switch (m.type) {
          case kBtreeKMessage: {  // version(1)=0, indexed storage K, group internal K, group leaf K (u16 each)
            if (!has(m.data, 0, 7) || le(m.data, 0, 1) != 0)
              return corrupt(fmt::format(
                  "{}: a B-tree 'K' values message of {} bytes is not one (version 0, 7 bytes)", at, m.data.size()));
            if (le(m.data, 1, 2) == 0 || le(m.data, 3, 2) == 0 || le(m.data, 5, 2) == 0)
              return corrupt(fmt::format("{}: a B-tree 'K' values message with a K of 0 (B-tree nodes of no entries)",
                                         at));
            sb.group_internal_k = static_cast<unsigned>(le(m.data, 3, 2));
            sb.group_leaf_k = static_cast<unsigned>(le(m.data, 5, 2));
            return Status::Ok();
          }
          case kDriverInfoMessage:  // version(1)=0, driver name(8), size(2), that many bytes (copied)
            if (!has(m.data, 0, 11) || le(m.data, 0, 1) != 0 || !has(m.data, 11, le(m.data, 9, 2)))
              return refuse("driver info");
            return Status::Ok();
          case kFileSpaceInfoMessage: {
            // Version 0: strategy(1), threshold(L), with strategy 1 ("all persist") 6 addresses.
            // Version 1: strategy(1), persist(1), threshold(L), page size(L), page end threshold(2),
            // EOA before the free-space managers(O), with persist 12 addresses.
            if (!has(m.data, 0, 2)) return refuse("file space info");
            const uint64_t version = le(m.data, 0, 1), strategy = le(m.data, 1, 1);
            if (version == 0) {
              if (strategy < 1 || strategy > 4 || !has(m.data, 2, L + (strategy == 1 ? 6 * O : 0)))
                return refuse("file space info");
              return Status::Ok();
            }
            if (version != 1 || strategy > 3 || !has(m.data, 3, 2 * L + 2 + O)) return refuse("file space info");
            const uint64_t page_size = le(m.data, 3 + L, sb.length_size);
            // libhdf5 writes 512 B to 1 GiB (H5Pset_file_space_page_size), and divides by it.
            if (page_size < 512 || page_size > (uint64_t{1} << 30))
              return corrupt(fmt::format("{}: a file space page size of {} bytes (512 B to 1 GiB)", at, page_size));
            if (le(m.data, 2, 1) != 0 && !has(m.data, 3 + 2 * L + 2 + O, 12 * O)) return refuse("file space info");
            return Status::Ok();
          }
          case kSharedTableMessage:  // version(1)=0, the table's address(O), indexes(1)
            if (!has(m.data, 0, 2 + O) || le(m.data, 0, 1) != 0) return refuse("shared message table");
            if (le(m.data, 1 + O, 1) != 0)
              return corrupt(fmt::format("{}: the file keeps shared object header messages (a table of {} indexes): "
                                         "this reader does not read them",
                                         at, le(m.data, 1 + O, 1)));
            return Status::Ok();
          case kCacheImageMessage:
            return corrupt(fmt::format("{}: the file holds a metadata cache image, which libhdf5 would load in place "
                                       "of the metadata it describes: this reader does not read one",
                                       at));
          default:
            return Status::Ok();
        }
      },
      at);
}

Status check_driver_info_block(const ReadAt& read, const Superblock& sb, const std::string& where) {
  if (sb.version >= 2 || sb.driver_info == UINT64_MAX) return Status::Ok();
  // version(1)=0, reserved(3), size of the driver's information(4), driver name(8), information.
  const std::string at = fmt::format("{}: the driver information block at {}", where, sb.driver_info);
  std::byte head[16];
  OPTSTATE_RETURN_IF_ERROR(read(sb.driver_info, head).with_context(at));
  if (le(head, 0, 1) != 0) return corrupt(fmt::format("{}: version {} (0)", at, le(head, 0, 1)));
  // libhdf5 allocates and reads the size stated (a file read past its end gives zeros): it must lie
  // in the file.
  const uint64_t size = le(head, 4, 4);
  std::byte last[1];
  if (size > 0 && !read(sb.driver_info + 16 + size - 1, last).ok())
    return corrupt(fmt::format("{}: {} bytes of driver information run past the file's end", at, size));
  return Status::Ok();
}

Result<int> check_dataset_header(const ReadAt& read, const Superblock& sb, uint64_t header,
                                 const std::string& where) {
  const std::string at = fmt::format("{}: the object header at {}", where, header);
  int layouts = 0;
  std::optional<uint64_t> element_size;
  std::vector<int64_t> fill_sizes;
  const auto visit = [&](const Message& m) -> Status {
    if ((m.flags & kSharedMessageFlag) && shareable(m.type)) {
      // Kept elsewhere. libhdf5 writes only datatypes so (committed, in their own object header);
      // other messages are shared only through a shared message heap, which this reader refuses.
      if (m.type != kDatatypeMessage)
        return m.type == kAttributeMessage  // not decoded by H5Dopen2
                   ? Status::Ok()
                   : corrupt(fmt::format("{}: a shared message of type {:#06x}, kept where this reader does not read",
                                         at, m.type));
      OPTSTATE_ASSIGN_OR_RETURN(const uint64_t address, shared_message_address(m.data, sb, at + ": its datatype"));
      OPTSTATE_ASSIGN_OR_RETURN(const auto datatype, committed_datatype(read, sb, address, at));
      element_size = le(datatype, 4, 4);
      return Status::Ok();
    }
    switch (m.type) {
      case kDataspaceMessage: {
        const auto elements = dataspace_elements(m.data, sb.length_size);
        if (!elements.ok())
          return corrupt(fmt::format("{}: a dataspace message of {} bytes has {}", at, m.data.size(),
                                     elements.status().message()));
        return Status::Ok();
      }
      case kDatatypeMessage:
        OPTSTATE_RETURN_IF_ERROR(check_datatype_message(m.data, at));
        element_size = le(m.data, 4, 4);
        return Status::Ok();
      case kOldFillValueMessage:
      case kFillValueMessage: {
        OPTSTATE_ASSIGN_OR_RETURN(const int64_t size, fill_value_size(m.data, m.type == kOldFillValueMessage, at));
        fill_sizes.push_back(size);
        return Status::Ok();
      }
      case kExternalFilesMessage:
        return corrupt(fmt::format("{}: the dataset's data is stored in external files (an external file list "
                                   "message): this reader reads only what the file holds itself",
                                   at));
      case kLayoutMessage:
        ++layouts;
        return check_layout_message(m.data, sb, at);
      case kFilterPipelineMessage:
        return check_filter_pipeline_message(m.data, at);
      default:
        return Status::Ok();
    }
  };
  OPTSTATE_RETURN_IF_ERROR(walk_object_header(read, sb, header, visit, at));
  // libhdf5 fills unwritten elements from the fill value, element by element.
  for (const int64_t size : fill_sizes)
    if (size > 0 && element_size && static_cast<uint64_t>(size) != *element_size)
      return corrupt(fmt::format("{}: a fill value of {} bytes for elements of {} bytes", at, size, *element_size));
  return layouts;
}

Result<std::vector<Link>> check_group_header(const ReadAt& read, const Superblock& sb, uint64_t header,
                                             const std::string& where) {
  const std::string at = fmt::format("{}: the object header at {}", where, header);
  const size_t O = static_cast<size_t>(sb.offset_size);
  std::vector<Link> links;
  std::optional<std::pair<uint64_t, uint64_t>> dense;  // the fractal heap, the name index
  // None of the messages read here is shareable: libhdf5 decodes them whatever the shared flag says.
  const auto visit = [&](const Message& m) -> Status {
    const auto cut_short = [&](std::string_view what) {
      return corrupt(fmt::format("{}: a {} message of {} bytes is cut short", at, what, m.data.size()));
    };
    switch (m.type) {
      case kLinkMessage: {
        OPTSTATE_ASSIGN_OR_RETURN(auto link, parse_link_message(m.data, sb, at));
        if (link) links.push_back(std::move(*link));
        return Status::Ok();
      }
      case kLinkInfoMessage: {
        // version(0) flags [flags&1: the largest creation index (8)] the fractal heap's address,
        // the name index's [flags&2: the creation order index's]
        if (!has(m.data, 0, 2)) return cut_short("link info");
        const uint64_t flags = le(m.data, 1, 1);
        if (!has(m.data, 0, 2 + ((flags & 1) ? 8 : 0) + O * ((flags & 2) ? 3 : 2))) return cut_short("link info");
        const size_t heap_at = 2 + ((flags & 1) ? 8 : 0);
        const uint64_t heap = le(m.data, heap_at, sb.offset_size);
        if (heap != undefined(O)) dense = {heap, le(m.data, heap_at + O, sb.offset_size)};
        return Status::Ok();
      }
      case kGroupInfoMessage: {
        // version(0) flags [flags&1: link phase change values (2 x 2)] [flags&2: estimates (2 x 2)]
        if (!has(m.data, 0, 2)) return cut_short("group info");
        const uint64_t flags = le(m.data, 1, 1);
        if (!has(m.data, 0, 2 + ((flags & 1) ? 4 : 0) + ((flags & 2) ? 4 : 0))) return cut_short("group info");
        return Status::Ok();
      }
      case kSymbolTableMessage:  // the v1 B-tree's address, the local heap's
        if (!has(m.data, 0, 2 * O)) return cut_short("symbol table");
        return check_symbol_table(read, sb, le(m.data, 0, sb.offset_size), le(m.data, O, sb.offset_size), at)
            .status();
      default:
        return Status::Ok();
    }
  };
  OPTSTATE_RETURN_IF_ERROR(walk_object_header(read, sb, header, visit, at));
  if (dense) {  // past 8 links: their messages in a fractal heap, found through a name index
    OPTSTATE_ASSIGN_OR_RETURN(const auto messages,
                              dense_messages(read, sb, DenseKind::kLinks, dense->first, dense->second, at));
    const std::string in_heap = at + ": dense link storage";
    for (const auto& message : messages) {
      OPTSTATE_ASSIGN_OR_RETURN(auto link, parse_link_message(message, sb, in_heap));
      if (link) links.push_back(std::move(*link));
    }
  }
  return links;
}

Result<uint64_t> check_symbol_table(const ReadAt& read, const Superblock& sb, uint64_t btree, uint64_t heap,
                                    const std::string& where) {
  const size_t O = static_cast<size_t>(sb.offset_size), L = static_cast<size_t>(sb.length_size);
  const std::string at = fmt::format("{}: the symbol table's", where);
  // The local heap: "HEAP" version(1)=0 reserved(3) data size(L) free list head(L) data address(O).
  std::byte head_bytes[32] = {};
  const std::span<std::byte> head(head_bytes, 8 + 2 * L + O);
  OPTSTATE_RETURN_IF_ERROR(read(heap, head).with_context(fmt::format("{} local heap at {}", at, heap)));
  if (!starts_with(head, 0, "HEAP") || le(head, 4, 1) != 0)
    return corrupt(fmt::format("{} local heap at {} is not one (no \"HEAP\", version 0)", at, heap));
  const uint64_t data_size = le(head, 8, sb.length_size), free_head = le(head, 8 + L, sb.length_size);
  if (data_size > kMaxLocalHeapBytes)
    return corrupt(fmt::format("{} local heap at {} holds {} bytes, over the {} MiB this reader takes", at, heap,
                               data_size, kMaxLocalHeapBytes >> 20));
  std::vector<std::byte> names(static_cast<size_t>(data_size));
  OPTSTATE_RETURN_IF_ERROR(read(le(head, 8 + 2 * L, sb.offset_size), names)
                               .with_context(fmt::format("{} local heap at {}", at, heap)));
  // The free list: blocks of next offset(L) size(L), ended by offset 1 (libhdf5's H5HL_FREE_NULL)
  // or the undefined length.
  const uint64_t undefined_length = undefined(L);
  std::set<uint64_t> free_blocks;
  for (uint64_t block = free_head; block != 1 && block != undefined_length;) {
    if (!has(names, static_cast<size_t>(std::min<uint64_t>(block, SIZE_MAX)), 2 * L) ||
        !free_blocks.insert(block).second)
      return corrupt(fmt::format("{} local heap at {} has a free block at {} {}", at, heap, block,
                                 free_blocks.count(block) ? "twice (a loop)" : "past its data"));
    const uint64_t next = le(names, static_cast<size_t>(block), sb.length_size),
                   size = le(names, static_cast<size_t>(block) + L, sb.length_size);
    if (size > data_size - block)
      return corrupt(fmt::format("{} local heap at {} has a free block of {} bytes at {}, past its data", at, heap,
                                 size, block));
    block = next;
  }
  // `place`'s `what` names a string at heap offset `offset`, which must end inside the heap.
  const auto name_at = [&](uint64_t offset, const std::string& place, std::string_view what) -> Status {
    if (offset >= names.size() || !std::memchr(names.data() + offset, 0, names.size() - static_cast<size_t>(offset)))
      return corrupt(fmt::format("{}: {} at heap offset {} does not end inside the local heap's {} bytes", place,
                                 what, offset, names.size()));
    return Status::Ok();
  };
  // The B-tree: "TREE" type(1)=0 level(1) entries(2) left(O) right(O), then key(L) child(O) ...
  // key(L); a key is a name's heap offset; level 0's children are symbol nodes.
  struct Node {
    uint64_t address;
    int level;  // -1: the root, whose level is its own
  };
  std::deque<Node> pending{{btree, -1}};
  std::set<uint64_t> seen;
  std::vector<std::byte> bytes;
  uint64_t entries = 0;
  const uint64_t max_children = sb.group_internal_k ? 2 * uint64_t{sb.group_internal_k} : 0xffff;
  const uint64_t max_symbols = sb.group_leaf_k ? 2 * uint64_t{sb.group_leaf_k} : 0xffff;
  while (!pending.empty()) {
    const Node n = pending.front();
    pending.pop_front();
    if (!seen.insert(n.address).second)
      return corrupt(fmt::format("{} B-tree reaches the node at {} twice", at, n.address));
    if (seen.size() > static_cast<size_t>(kMaxSymbolTableNodes))
      return corrupt(fmt::format("{} B-tree has over {} nodes", at, kMaxSymbolTableNodes));
    const std::string node_at = fmt::format("{} B-tree node at {}", at, n.address);
    bytes.resize(8 + 2 * O);
    OPTSTATE_RETURN_IF_ERROR(read(n.address, bytes).with_context(node_at));
    if (!starts_with(bytes, 0, "TREE") || le(bytes, 4, 1) != 0)
      return corrupt(fmt::format("{} is not a group node (\"TREE\", type 0)", node_at));
    const int level = static_cast<int>(le(bytes, 5, 1));
    const uint64_t children = le(bytes, 6, 2);
    if (n.level >= 0 && level != n.level)
      return corrupt(fmt::format("{} is at level {}, not {} (one below its parent)", node_at, level, n.level));
    if (children > max_children)
      return corrupt(fmt::format("{} has {} children, over the {} its K allows", node_at, children, max_children));
    bytes.resize(8 + 2 * O + static_cast<size_t>(children) * (L + O) + L);
    OPTSTATE_RETURN_IF_ERROR(read(n.address, bytes).with_context(node_at));
    for (uint64_t c = 0; c <= children; ++c) {
      const size_t key_at = 8 + 2 * O + static_cast<size_t>(c) * (L + O);
      OPTSTATE_RETURN_IF_ERROR(name_at(le(bytes, key_at, sb.length_size), node_at, fmt::format("key {}", c)));
      if (c == children) break;
      const uint64_t child = le(bytes, key_at + L, sb.offset_size);
      if (level > 0) {
        pending.push_back({child, level - 1});
        continue;
      }
      // A symbol node: "SNOD" version(1)=1 reserved(1) symbols(2), then entries of name offset(O)
      // object header address(O) cache type(4) reserved(4) scratch(16); a soft link (cache type
      // 2) keeps its value's heap offset (u32) in the scratch.
      if (!seen.insert(child).second) return corrupt(fmt::format("{} B-tree reaches the node at {} twice", at, child));
      const std::string snod_at = fmt::format("{} symbol node at {}", at, child);
      std::byte snod_head[8];
      OPTSTATE_RETURN_IF_ERROR(read(child, snod_head).with_context(snod_at));
      if (!starts_with(snod_head, 0, "SNOD") || le(snod_head, 4, 1) != 1)
        return corrupt(fmt::format("{} is not one (\"SNOD\", version 1)", snod_at));
      const uint64_t symbols = le(snod_head, 6, 2);
      if (symbols > max_symbols)
        return corrupt(fmt::format("{} has {} entries, over the {} its K allows", snod_at, symbols, max_symbols));
      const size_t entry_size = 2 * O + 24;
      std::vector<std::byte> table(static_cast<size_t>(symbols) * entry_size);
      OPTSTATE_RETURN_IF_ERROR(read(child + 8, table).with_context(snod_at));
      for (uint64_t e = 0; e < symbols; ++e) {
        const size_t p = static_cast<size_t>(e) * entry_size;
        OPTSTATE_RETURN_IF_ERROR(name_at(le(table, p, sb.offset_size), snod_at, fmt::format("entry {}'s name", e)));
        if (le(table, p + 2 * O, 4) == 2)
          OPTSTATE_RETURN_IF_ERROR(
              name_at(le(table, p + 2 * O + 8, 4), snod_at, fmt::format("entry {}'s soft link value", e)));
      }
      entries += symbols;
    }
  }
  return entries;
}

Result<std::optional<Link>> parse_link_message(std::span<const std::byte> m, const Superblock& sb,
                                               const std::string& where) {
  const auto refuse = [&](std::string_view what) {
    return corrupt(fmt::format("{}: a link message of {} bytes {}", where, m.size(), what));
  };
  // version(1) flags [flags&8: type] [flags&4: creation order (8)] [flags&0x10: charset] the
  // name's length in 1 << (flags&3) bytes, the name (no NUL); then a hard link's address (O), or a
  // soft, external or user-defined link's value: length(2) bytes. libhdf5 1.10.8 copies the name
  // and the value by the lengths stated, without a bound.
  if (!has(m, 0, 2)) return refuse("is cut short");
  const uint64_t flags = le(m, 1, 1);
  if (le(m, 0, 1) != 1 || (flags & ~uint64_t{0x1f})) return std::optional<Link>();  // libhdf5 refuses these
  Link link;
  size_t p = 2;
  if (flags & 0x08) {
    if (!has(m, p, 1)) return refuse("is cut short");
    link.type = static_cast<unsigned>(le(m, p, 1));
    ++p;
  }
  if (link.type > kSoftLink && link.type < kExternalLink) return std::optional<Link>();  // refused by libhdf5
  p += (flags & 0x04) ? 8 : 0;
  p += (flags & 0x10) ? 1 : 0;
  const int length_bytes = 1 << (flags & 3);
  if (!has(m, p, static_cast<uint64_t>(length_bytes))) return refuse("is cut short of its name's length");
  const uint64_t name_length = le(m, p, length_bytes);
  p += static_cast<size_t>(length_bytes);
  if (name_length == 0) return std::optional<Link>();  // refused by libhdf5
  if (!has(m, p, name_length)) return refuse(fmt::format("holds a name of {} bytes past its end", name_length));
  link.name.assign(reinterpret_cast<const char*>(m.data() + p), static_cast<size_t>(name_length));
  p += static_cast<size_t>(name_length);
  if (link.type == kHardLink) {
    if (!has(m, p, static_cast<uint64_t>(sb.offset_size)))
      return refuse(fmt::format("to '{}' is cut short of its address", link.name));
    link.address = le(m, p, sb.offset_size);
    return std::optional<Link>(std::move(link));
  }
  if (!has(m, p, 2)) return refuse(fmt::format("to '{}' is cut short of its value's length", link.name));
  const uint64_t value_length = le(m, p, 2);
  if (!has(m, p + 2, value_length))
    return refuse(fmt::format("to '{}' holds a value of {} bytes past its end", link.name, value_length));
  return std::optional<Link>(std::move(link));
}

Status check_datatype_message(std::span<const std::byte> m, const std::string& where) {
  if (!datatype_bytes(m, 0))
    return corrupt(fmt::format("{}: a datatype message of {} bytes (class {}) has parts that run past its end", where,
                               m.size(), m.empty() ? 0 : le(m, 0, 1) & 0x0f));
  return Status::Ok();
}

Result<int64_t> fill_value_size(std::span<const std::byte> m, bool old, const std::string& where) {
  const auto refuse = [&](std::string_view what) {
    return corrupt(fmt::format("{}: a fill value message of {} bytes {}", where, m.size(), what));
  };
  // The old message: the size (u32), the value. Versions 1-2: version, allocation time, write time,
  // defined, then (version 1, or defined) the size (i32), the value; version 3: version, flags,
  // then (flags & 0x20) the size, the value. libhdf5 1.10.8 copies `size` bytes without a bound.
  size_t size_at = 0;
  if (!old) {
    if (!has(m, 0, 2)) return refuse("is cut short");
    const int version = static_cast<int>(le(m, 0, 1));
    if (version == 1 || version == 2) {
      if (!has(m, 0, 4)) return refuse("is cut short");
      if (version == 2 && le(m, 3, 1) == 0) return int64_t{-1};
      size_at = 4;
    } else if (version == 3) {
      if (!(le(m, 1, 1) & 0x20)) return int64_t{-1};
      size_at = 2;
    } else {
      return int64_t{-1};  // a version libhdf5 refuses itself
    }
  }
  if (!has(m, size_at, 4)) return refuse("is cut short");
  const auto size = static_cast<int64_t>(static_cast<int32_t>(le(m, size_at, 4)));
  if (size > 0 && !has(m, size_at + 4, static_cast<uint64_t>(size)))
    return refuse(fmt::format("holds a value of {} bytes past its end", size));
  return size;
}

Status check_filter_pipeline_message(std::span<const std::byte> m, const std::string& where) {
  const auto refuse = [&](std::string_view what) {
    return corrupt(fmt::format("{}: a filter pipeline message of {} bytes {}", where, m.size(), what));
  };
  // Version 1: version, count, 6 reserved; each filter: id, name length, flags, value count (u16
  // each), the name (its length a multiple of 8, NUL included), the values (u32), 4 bytes of
  // padding after an odd count. Version 2: version, count; each filter: id, the name length only
  // for an id of 256 and up, flags, value count, the name (unpadded), the values. libhdf5 1.10.8
  // takes the name with strlen and the values without a bound.
  if (!has(m, 0, 2)) return refuse("is cut short");
  const int version = static_cast<int>(le(m, 0, 1));
  const uint64_t filters = le(m, 1, 1);
  if (version != 1 && version != 2) return Status::Ok();  // a version libhdf5 refuses itself
  if (filters > 32) return refuse(fmt::format("has {} filters (at most 32)", filters));
  size_t p = version == 1 ? 8 : 2;
  for (uint64_t f = 0; f < filters; ++f) {
    if (!has(m, p, 2)) return refuse(fmt::format("has filter {} past its end", f));
    const uint64_t id = le(m, p, 2);
    p += 2;
    uint64_t name_length = 0;
    if (version == 1 || id >= 256) {
      if (!has(m, p, 2)) return refuse(fmt::format("has filter {} past its end", f));
      name_length = le(m, p, 2);
      p += 2;
    }
    if (!has(m, p, 4)) return refuse(fmt::format("has filter {} past its end", f));
    // N-bit and scale-offset: libhdf5 decompresses their chunks trusting the parameters stored
    // there and in the message (a heap overflow in 1.10 on a crafted file: CVE-2025-2308, fixed
    // in 2.0); optstate and h5py's defaults use neither.
    if (id == 5 || id == 6)
      return refuse(fmt::format("has filter {} ({}), whose decompression libhdf5 1.10 does not bound: not read", f,
                                id == 5 ? "N-bit" : "scale-offset"));
    const uint64_t values = le(m, p + 2, 2);
    p += 4;
    if (version == 1 && name_length % 8 != 0)
      return refuse(fmt::format("has filter {} with a name of {} bytes (a multiple of 8)", f, name_length));
    if (name_length > 0) {
      if (!has(m, p, name_length)) return refuse(fmt::format("has filter {}'s name past its end", f));
      if (!std::memchr(m.data() + p, 0, static_cast<size_t>(name_length)))
        return refuse(fmt::format("has filter {} whose name of {} bytes has no NUL", f, name_length));
      p += static_cast<size_t>(name_length);
    }
    const uint64_t value_bytes = 4 * (values + (version == 1 && values % 2 ? 1 : 0));
    if (!has(m, p, value_bytes)) return refuse(fmt::format("has filter {}'s {} values past its end", f, values));
    p += static_cast<size_t>(value_bytes);
  }
  return Status::Ok();
}

Status check_layout_message(std::span<const std::byte> m, const Superblock& sb, const std::string& where) {
  const auto refuse = [&](std::string_view what) {
    return corrupt(fmt::format("{}: a data layout message of {} bytes {}", where, m.size(), what));
  };
  if (!has(m, 0, 2)) return refuse("is cut short");
  const int version = static_cast<int>(le(m, 0, 1));
  const size_t O = static_cast<size_t>(sb.offset_size), L = static_cast<size_t>(sb.length_size);
  // Versions 1-2: version, dimensionality, class, 5 reserved, an address (not compact), the
  // dimensions (u32; a chunked layout's count the element size last), then a compact layout's size
  // (u32) and data. 3-4: version, class, then compact: size (u16), data; contiguous: address,
  // size; chunked (3): dimensionality, address, dimensions (u32); chunked (4): flags,
  // dimensionality, bytes per dimension (1-8), dimensions, the chunk index's type and fields, an
  // address; virtual (4): a global heap address and index. libhdf5 1.10.8 reads each field without
  // a bound (a compact layout's data is copied by the size it states).
  enum Class { kCompact = 0, kContiguous = 1, kChunked = 2, kVirtual = 3 };
  uint64_t count = 0, bytes = 4, cls = 0;
  size_t dims_at = 0, end = 0;
  if (version == 1 || version == 2) {
    if (!has(m, 0, 8)) return refuse("is cut short");
    count = le(m, 1, 1);
    cls = le(m, 2, 1);
    if (cls > kChunked) return Status::Ok();  // a class libhdf5 refuses itself
    dims_at = 8 + (cls == kCompact ? 0 : O);
    if (count > 33) return refuse(fmt::format("has {} dimensions (at most 33)", count));
    if (!has(m, dims_at, count * 4)) return refuse(fmt::format("holds {} dimensions past its end", count));
    end = dims_at + static_cast<size_t>(count * 4);
    if (cls == kCompact) {
      if (!has(m, end, 4)) return refuse("is cut short of its compact data's size");
      const uint64_t size = le(m, end, 4);
      if (!has(m, end + 4, size)) return refuse(fmt::format("holds {} bytes of compact data past its end", size));
      return Status::Ok();
    }
  } else if (version == 3 || version == 4) {
    cls = le(m, 1, 1);
    if (cls == kCompact) {
      if (!has(m, 2, 2)) return refuse("is cut short of its compact data's size");
      const uint64_t size = le(m, 2, 2);
      if (!has(m, 4, size)) return refuse(fmt::format("holds {} bytes of compact data past its end", size));
      return Status::Ok();
    }
    if (cls == kContiguous) return has(m, 2, O + L) ? Status::Ok() : refuse("is cut short");
    if (cls == kVirtual && version == 4)
      return refuse("is a virtual dataset's (its data lies in other files): this reader reads only what the file "
                    "holds itself");
    if (cls != kChunked) return Status::Ok();  // a class libhdf5 refuses itself
    if (version == 3) {
      if (!has(m, 0, 3)) return refuse("is cut short");
      count = le(m, 2, 1);
      dims_at = 3 + O;
    } else {
      if (!has(m, 0, 5)) return refuse("is cut short");
      count = le(m, 3, 1);
      bytes = le(m, 4, 1);
      if (bytes < 1 || bytes > 8) return refuse(fmt::format("has chunk dimensions of {} bytes (1-8)", bytes));
      dims_at = 5;
    }
    if (count > 33) return refuse(fmt::format("has {} chunk dimensions (2-33: the rank, then the element size)", count));
    if (!has(m, dims_at, count * bytes)) return refuse(fmt::format("holds {} chunk dimensions past its end", count));
    end = dims_at + static_cast<size_t>(count * bytes);
    if (version == 4) {
      // The index: 1 single chunk (with flags & 2: its filtered size and filter mask), 2 implicit,
      // 3 fixed array (page bits), 4 extensible array (5 one-byte parameters), 5 version 2 B-tree
      // (node size u32, split and merge percentages); then its address.
      if (!has(m, end, 1)) return refuse("is cut short of its chunk index");
      const uint64_t index = le(m, end, 1);
      const size_t fields[] = {0, (le(m, 2, 1) & 2) ? L + 4 : 0, 0, 1, 5, 6};
      if (index < 1 || index > 5) return Status::Ok();  // an index libhdf5 refuses itself
      end += 1 + fields[index];
    }
    if (!has(m, end, version == 4 ? O : 0)) return refuse("is cut short of its chunk index's address");
  } else {
    return Status::Ok();  // a version libhdf5 refuses itself
  }
  if (cls != kChunked) return Status::Ok();
  // libhdf5 1.10.8 divides by each chunk dimension when it opens the dataset (H5D__chunk_set_info):
  // a 0 there is SIGFPE, not an error.
  if (count < 2) return refuse(fmt::format("has {} chunk dimensions (2-33: the rank, then the element size)", count));
  for (uint64_t d = 0; d < count; ++d)
    if (le(m, dims_at + static_cast<size_t>(d * bytes), static_cast<int>(bytes)) == 0)
      return refuse(fmt::format("has a chunk dimension {} of 0", d));
  return Status::Ok();
}

Result<uint64_t> parse_collection_size(std::span<const std::byte> head, int length_size, const std::string& where) {
  if (!valid_size(static_cast<uint64_t>(length_size)) || !has(head, 0, 8 + static_cast<uint64_t>(length_size)))
    return corrupt(fmt::format("{}: a global heap collection's header is cut short", where));
  if (!starts_with(head, 0, "GCOL"))
    return corrupt(fmt::format("{}: no global heap collection there (no \"GCOL\")", where));
  if (le(head, 4, 1) != 1)
    return corrupt(fmt::format("{}: global heap collection version {} (1 is known)", where, le(head, 4, 1)));
  const uint64_t size = le(head, 8, length_size);
  if (size < kMinCollectionBytes || size > kMaxCollectionBytes)
    return corrupt(fmt::format("{}: a global heap collection of {} bytes is outside [{}, {} MiB]", where, size,
                               kMinCollectionBytes, kMaxCollectionBytes >> 20));
  return size;
}

Status check_collection(std::span<const std::byte> c, int length_size, const VlenRef& ref, const std::string& where) {
  OPTSTATE_ASSIGN_OR_RETURN(const uint64_t size, parse_collection_size(c, length_size, where));
  if (size != c.size())
    return corrupt(fmt::format("{}: the global heap collection says {} bytes, {} given", where, size, c.size()));
  const uint64_t L = static_cast<uint64_t>(length_size);
  const uint64_t object_header = 8 + L;  // index u16, reference count u16, 4 reserved, size
  uint64_t p = align8(8 + L);            // "GCOL", version, 3 reserved, size
  std::vector<bool> seen(65536, false);
  bool found = false;
  while (p < size) {
    if (size - p < object_header) break;  // too small for an object: free space, as libhdf5 takes it
    const auto index = static_cast<unsigned>(le(c, static_cast<size_t>(p), 2));
    const uint64_t object_size = le(c, static_cast<size_t>(p + 8), length_size);
    // A stored object takes its header and its bytes padded to 8; the free-space object (index 0)
    // takes its size, which counts its header.
    uint64_t need = object_size;
    if (index > 0) need = object_size > size ? size + 1 : object_header + align8(object_size);
    if (need == 0)
      return corrupt(fmt::format("{}: the global heap collection's object at offset {} (index 0, free space) has size "
                                 "0, on which libhdf5's loader would loop without end",
                                 where, p));
    if (need > size - p)
      return corrupt(fmt::format("{}: the global heap collection's object {} at offset {} of {} bytes runs past the "
                                 "collection's {} bytes",
                                 where, index, p, object_size, size));
    if (index > 0) {
      if (seen[index]) return corrupt(fmt::format("{}: the global heap collection holds object {} twice", where, index));
      seen[index] = true;
      if (index == ref.index) {
        if (object_size != ref.length)
          return corrupt(fmt::format("{}: global heap object {} holds {} bytes, the value says {}", where, index,
                                     object_size, ref.length));
        found = true;
      }
    }
    p += need;
  }
  if (!found)
    return corrupt(fmt::format("{}: the global heap collection holds no object {}", where, ref.index));
  return Status::Ok();
}

}  // namespace optstate::hdf5
