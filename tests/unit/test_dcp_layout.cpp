// Tensor strides in torch.save / DCP items (formats/dcp/dcp_layout.cpp): C-contiguous tensors, and
// dense tensors stored permuted (channels_last, transposed), which are read in logical order;
// overlapping, holey or out-of-storage strides are refused.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "dcp/dcp_layout.h"
#include "dcp/pickle.h"
#include "dcp/zip.h"

using namespace optstate;

namespace {

// The data.pkl of torch.save(t) for a float32 tensor with these sizes, strides and offset.
Result<dcp::Payload> tensor_item(const std::vector<int64_t>& shape, const std::vector<int64_t>& stride,
                                 int64_t storage_numel, int64_t offset = 0) {
  pickle::Writer w;
  dcp::encode_tensor_view(w, DType::kF32, shape, stride, offset, storage_numel, "0");
  const std::string bytes = w.finish();
  OPTSTATE_ASSIGN_OR_RETURN(pickle::Pickle p, pickle::unpickle(std::as_bytes(std::span(bytes)), "test"));
  return dcp::interpret_payload(p, "item");
}

// The tensor's elements in logical order, where storage element i holds the value i.
std::vector<int32_t> logical(const dcp::TensorRef& t) {
  const int64_t numel = std::accumulate(t.shape.begin(), t.shape.end(), int64_t{1}, std::multiplies<>());
  std::vector<int32_t> stored(static_cast<size_t>(numel)), out(stored.size());
  std::iota(stored.begin(), stored.end(), 0);
  dcp::to_logical_order(t, 4, std::as_bytes(std::span(stored)), std::as_writable_bytes(std::span(out)));
  return out;
}

// A writers-corpus file's bytes (tests/data/writers/<rel>).
std::string corpus_file(const char* rel) {
  std::ifstream in(std::filesystem::path(OPTSTATE_SOURCE_DIR) / "tests/data/writers" / rel, std::ios::binary);
  REQUIRE(in);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

Result<dcp::Metadata> read_metadata(const std::string& b) {
  OPTSTATE_ASSIGN_OR_RETURN(pickle::Pickle p, pickle::unpickle(std::as_bytes(std::span(b)), ".metadata"));
  return dcp::interpret_metadata(p, ".metadata");
}

}  // namespace

TEST_CASE("dcp layout: tensors stored permuted are read in logical order; other strides are refused") {
  // channels_last [N=2, C=3, H=2, W=2]: strides (C*H*W, 1, W*C, C)
  auto cl = tensor_item({2, 3, 2, 2}, {12, 1, 6, 3}, 24);
  REQUIRE_MESSAGE(cl.ok(), cl.status().message());
  REQUIRE(cl->tensor.permuted());
  std::vector<int32_t> want;
  for (int n = 0; n < 2; ++n)
    for (int c = 0; c < 3; ++c)
      for (int h = 0; h < 2; ++h)
        for (int w = 0; w < 2; ++w) want.push_back(n * 12 + c + h * 6 + w * 3);
  CHECK(logical(cl->tensor) == want);
  // a transposed [3, 4]: element (i, j) at i + 3 j
  auto tr = tensor_item({3, 4}, {1, 3}, 12);
  REQUIRE(tr.ok());
  CHECK(logical(tr->tensor) == std::vector<int32_t>{0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11});
  // size-1 dims take any stride; an empty tensor holds nothing to order: both C-contiguous
  auto one = tensor_item({1, 4, 1}, {99, 1, 7}, 4);
  REQUIRE(one.ok());
  CHECK(!one->tensor.permuted());
  auto empty = tensor_item({0, 3}, {1, 5}, 0);
  REQUIRE(empty.ok());
  CHECK(!empty->tensor.permuted());
  // a permuted [2, 3] with size-1 dims between: the size-1 dims are never stepped over
  auto mixed = tensor_item({2, 1, 3}, {1, 50, 2}, 6);
  REQUIRE(mixed.ok());
  CHECK(logical(mixed->tensor) == std::vector<int32_t>{0, 2, 4, 1, 3, 5});
  // overlapping (an expanded dim, two dims on one stride), holes, past the storage: refused
  for (const auto& [shape, stride_in, numel] :
       std::vector<std::tuple<std::vector<int64_t>, std::vector<int64_t>, int64_t>>{
           {{3, 4}, {0, 1}, 4}, {{2, 2}, {1, 1}, 4}, {{2, 2}, {4, 1}, 8}, {{2, 2}, {1, 3}, 8}}) {
    const std::vector<int64_t> stride = stride_in;  // CAPTURE can't take a structured binding in clang 14
    auto r = tensor_item(shape, stride, numel);
    CAPTURE(stride[0]);
    CAPTURE(stride[1]);
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("neither C-contiguous nor a permutation of a dense layout") != std::string::npos);
  }
  auto past = tensor_item({3, 4}, {1, 3}, 12, /*offset=*/1);
  REQUIRE(!past.ok());
  CHECK(past.status().message().find("overruns its storage") != std::string::npos);
  // where only C-contiguous data is read (8-bit codes, scales, maps), a permuted tensor is named
  const Status st = dcp::require_contiguous(cl->tensor, "x codes");
  CHECK(st.message().find("x codes: tensor of shape [2, 3, 2, 2] stored with strides [12, 1, 6, 3]") != std::string::npos);
}

TEST_CASE("dcp layout: torchao float8 training's weight wrapper reads as the weight it holds") {
  // formats/dcp/testdata/item_float8_weight.zip: the DCP item of a 32x32 Linear weight under
  // torchao's convert_to_float8_training with FSDP2's float8 all-gather (torchao 0.17, torch 2.13):
  // _rebuild_from_type_v2(_rebuild_wrapper_subclass, WeightWithDynamicFloat8CastTensor, (cls,
  // float32, (32, 32), ...), {"_tensor": <the weight>, "_linear_mm_config", "_dtype", ...}).
  const auto path = std::filesystem::path(OPTSTATE_SOURCE_DIR) / "formats/dcp/testdata/item_float8_weight.zip";
  std::ifstream f(path, std::ios::binary);
  const std::string item{std::istreambuf_iterator<char>(f), {}};
  REQUIRE(!item.empty());
  const auto b = std::as_bytes(std::span(item));
  auto cd = zip::find_central_directory(b, b.size(), "item");
  REQUIRE(cd.ok());
  auto entries = zip::parse_central_directory(b.subspan(cd->offset, cd->size), *cd, "item");
  REQUIRE(entries.ok());
  std::string pkl;
  for (const zip::Entry& e : *entries)
    if (e.name.ends_with("data.pkl")) {
      auto at = zip::data_offset(b.subspan(e.local_header_offset, 30), e, cd->offset, "item");
      REQUIRE(at.ok());
      pkl = item.substr(static_cast<size_t>(*at), static_cast<size_t>(e.size));
    }
  REQUIRE(pkl.find("WeightWithDynamicFloat8CastTensor") != std::string::npos);
  auto interpret = [](const std::string& bytes) -> Result<dcp::Payload> {
    OPTSTATE_ASSIGN_OR_RETURN(pickle::Pickle p, pickle::unpickle(std::as_bytes(std::span(bytes)), "item"));
    return dcp::interpret_payload(p, "item");
  };
  auto payload = interpret(pkl);
  REQUIRE_MESSAGE(payload.ok(), payload.status().message());
  CHECK(payload->kind == dcp::Payload::Kind::kTensor);
  CHECK(payload->tensor.dtype == DType::kF32);
  CHECK(payload->tensor.shape == std::vector<int64_t>{32, 32});
  CHECK(payload->tensor.storage_key == "0");
  // A wrapper that claims another size than its tensor's is refused (the claimed (32, 32) is the
  // first pair of BININT1 32s in the pickle; the tensor's own is the second).
  std::string lying = pkl;
  const std::string pair = std::string("K\x20K\x20\x86", 5);
  const auto at = lying.find(pair);
  REQUIRE(at != std::string::npos);
  REQUIRE(lying.find(pair, at + 1) != std::string::npos);
  lying[at + 1] = '\x21';
  auto refused = interpret(lying);
  REQUIRE(!refused.ok());
  CHECK(refused.status().message().find("its '_tensor' is not of the dtype and size the subclass claims") != std::string::npos);
}

TEST_CASE("dcp metadata: OLMo-core's own _StorageInfo class is read as torch's, another module's is refused") {
  // OLMo-core's RemoteFileSystemWriter pickles olmo_core.distributed.checkpoint.filesystem._StorageInfo
  // (the same three fields) for every item (tests/data/writers/make_olmo_core.py).
  const std::string bytes = corpus_file("olmo-core-3.0.0_torch-2.13.0/model_and_optim/.metadata");
  auto md = read_metadata(bytes);
  REQUIRE_MESSAGE(md.ok(), md.status().message());
  CHECK(md->storage.size() > 20);
  for (const auto& [key, loc] : md->storage) CHECK(loc.relative_path.starts_with("__"));
  // the same class in another module (a name of the same length, so the pickle stays well formed)
  const std::string olmo = "olmo_core.distributed.checkpoint.filesystem";
  const auto at = bytes.find(olmo);
  REQUIRE(at != std::string::npos);
  std::string other = bytes;
  other.replace(at, olmo.size(), std::string("xlmo") + olmo.substr(4));
  auto refused = read_metadata(other);
  REQUIRE(!refused.ok());
  CHECK(refused.status().message().find("is not a _StorageInfo") != std::string::npos);
}

TEST_CASE("dcp metadata: Megatron-Core 0.13's mcore_data gives its N-D flattened items their tensors' shapes") {
  // MCoreSavePlanner's Metadata.mcore_data: {key: {'nd_reformulated_orig_global_shape': shape}}
  // for the distributed optimizer's fully_sharded_model_space items (make_megatron.py).
  const std::string bytes = corpus_file("megatron-core-0.13.1_torch-2.13.0/dp2_distopt/.metadata");
  auto md = read_metadata(bytes);
  REQUIRE_MESSAGE(md.ok(), md.status().message());
  const auto& state = md->items.at("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight");
  CHECK(state.size == std::vector<int64_t>{3, 1, 1, 1024});
  CHECK(state.nd_shape == std::vector<int64_t>{3, 64, 16});
  CHECK(dcp::tensor_shape(state) == std::vector<int64_t>{3, 64, 16});
  const auto& weight = md->items.at("decoder.layers.mlp.linear_fc1.weight");  // the model's: plain
  CHECK(weight.nd_shape.empty());
  CHECK(dcp::tensor_shape(weight) == std::vector<int64_t>{3, 64, 16});
  size_t nd_count = 0;
  for (const auto& [k, im] : md->items) nd_count += !im.nd_shape.empty();
  CHECK(nd_count == 51);  // 17 params x (fp32_param, exp_avg, exp_avg_sq)
  // mcore_data's entry (its key's last spelling in the pickle, after the items' and storage
  // records') renamed to a key of no item: refused by name.
  const std::string fc1 = "optimizer.state.fp32_param.decoder.layers.mlp.linear_fc1.weight";
  std::string renamed = bytes;
  const size_t at = renamed.rfind(fc1);
  REQUIRE(at != std::string::npos);
  REQUIRE(renamed.find(fc1) < at);
  renamed[at + fc1.size() - 6] = 'W';  // "weight" -> "Weight"
  auto missing = read_metadata(renamed);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().message().find("linear_fc1.Weight': mcore_data gives its N-D shape, and the metadata holds "
                                        "no such tensor") != std::string::npos);
}

TEST_CASE("dcp metadata: Megatron-Core 0.15's MCoreMetadata is read as torch's Metadata, another class is not") {
  const std::string bytes = corpus_file("megatron-core-0.15.3_torch-2.13.0/dp2_distopt_pre_mcore_014/.metadata");
  auto md = read_metadata(bytes);
  REQUIRE_MESSAGE(md.ok(), md.status().message());
  CHECK(md->items.at("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight").nd_shape ==
        std::vector<int64_t>{2, 32, 8});
  // the same class name in another module (same length: the pickle stays well formed)
  const std::string module = "megatron.core.dist_checkpointing.strategies.torch";
  const auto at = bytes.find(module);
  REQUIRE(at != std::string::npos);
  std::string other = bytes;
  other[at] = 'n';  // "negatron..."
  auto refused = read_metadata(other);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message().find("not a DCP Metadata object") != std::string::npos);
}
