// Prints the root hash of a checkpoint through the installed optstate libraries (any format).
#include <cstdio>

#include "optstate/formats/registry.h"
#include "optstate/hash.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  auto reader = optstate::open_checkpoint(argv[1]);
  if (!reader.ok()) {
    std::fprintf(stderr, "%s\n", reader.status().message().c_str());
    return 2;
  }
  auto h = optstate::hash_checkpoint(**reader);
  if (!h.ok()) {
    std::fprintf(stderr, "%s\n", h.status().message().c_str());
    return 2;
  }
  std::printf("%s  (root)\n", h->root.c_str());
  return 0;
}
