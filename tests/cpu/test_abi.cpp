// The ABI queries bindings use, and empty tensors as frameworks hand them over.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "flashmsa/flashmsa.hpp"

namespace {

TEST(Abi, VersionAndStructSizes) {
  EXPECT_EQ(flashmsa_abi_version(), FLASHMSA_ABI_VERSION);
  EXPECT_EQ(flashmsa_struct_size(FLASHMSA_STRUCT_TENSOR), sizeof(flashmsa_tensor_t));
  EXPECT_EQ(flashmsa_struct_size(FLASHMSA_STRUCT_SELECT_ARGS), sizeof(flashmsa_select_args_t));
  EXPECT_EQ(flashmsa_struct_size(FLASHMSA_STRUCT_FWD_ARGS), sizeof(flashmsa_fwd_args_t));
  EXPECT_EQ(flashmsa_struct_size(FLASHMSA_STRUCT_BWD_ARGS), sizeof(flashmsa_bwd_args_t));
  EXPECT_EQ(flashmsa_struct_size(static_cast<flashmsa_struct_t>(99)), 0u);
}

// torch gives zero-element tensors arbitrary strides (often all 0): they must be accepted.
TEST(Abi, EmptyTensorsWithZeroStrides) {
  auto empty = [](std::initializer_list<int64_t> shape) {
    flashmsa_tensor_t t = flashmsa::view(nullptr, FLASHMSA_DTYPE_FP64, shape);
    for (int d = 0; d < t.ndim; ++d) t.strides[d] = 0;
    return t;
  };
  std::vector<int32_t> cu{0, 0};
  std::vector<double> kl(1, NAN);
  flashmsa::FwdArgs f;
  f.q = empty({0, 4, 8});
  f.k = empty({0, 2, 8});
  f.v = empty({0, 2, 8});
  f.qp = empty({0, 2, 8});
  f.kp = empty({0, 1, 8});
  f.cu_seqlens = flashmsa::view(cu.data(), FLASHMSA_DTYPE_INT32, {2});
  f.topk = 2;
  f.compute_kl = 1;
  f.out = empty({0, 4, 8});
  f.lse = empty({4, 0});
  f.kl = flashmsa::view(kl.data(), FLASHMSA_DTYPE_FP64, {});
  ASSERT_EQ(flashmsa_fwd(&f, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
  EXPECT_EQ(kl[0], 0.0);
}

}  // namespace
