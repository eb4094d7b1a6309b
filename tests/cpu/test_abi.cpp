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

// Every constant bindings mirror, by name: the value the header gives it (tests/python/test_abi.py
// also checks that no numeric constant of the header is missing from the library's table).
TEST(Abi, ConstantsByName) {
  struct Named {
    const char* name;
    int64_t value;
  };
#define NAMED(c) Named{#c, static_cast<int64_t>(c)}
  const Named all[] = {
      NAMED(FLASHMSA_VERSION_MAJOR), NAMED(FLASHMSA_VERSION_MINOR), NAMED(FLASHMSA_VERSION_PATCH),
      NAMED(FLASHMSA_BLOCK_SIZE), NAMED(FLASHMSA_MAX_TOPK), NAMED(FLASHMSA_MAX_DIMS),
      NAMED(FLASHMSA_SUCCESS), NAMED(FLASHMSA_ERROR_INVALID_ARGUMENT), NAMED(FLASHMSA_ERROR_NOT_SUPPORTED),
      NAMED(FLASHMSA_ERROR_DEVICE), NAMED(FLASHMSA_ERROR_WORKSPACE), NAMED(FLASHMSA_ERROR_INTERNAL),
      NAMED(FLASHMSA_DTYPE_BF16), NAMED(FLASHMSA_DTYPE_FP16), NAMED(FLASHMSA_DTYPE_FP32), NAMED(FLASHMSA_DTYPE_FP64),
      NAMED(FLASHMSA_DTYPE_INT32), NAMED(FLASHMSA_DEVICE_CPU), NAMED(FLASHMSA_DEVICE_CUDA),
      NAMED(FLASHMSA_MODE_SPARSE), NAMED(FLASHMSA_MODE_DENSE), NAMED(FLASHMSA_MODE_GIVEN),
      NAMED(FLASHMSA_NUMERICS_TRAIN), NAMED(FLASHMSA_NUMERICS_INFER), NAMED(FLASHMSA_STATUS_WORDS),
      NAMED(FLASHMSA_FAULT_FIRST_NOT_ZERO), NAMED(FLASHMSA_FAULT_NEGATIVE), NAMED(FLASHMSA_FAULT_DECREASING),
      NAMED(FLASHMSA_FAULT_ABOVE_TOTAL), NAMED(FLASHMSA_FAULT_LAST_NOT_TOTAL), NAMED(FLASHMSA_FAULT_ABOVE_MAX_SEQLEN), NAMED(FLASHMSA_FAULT_SEGMENTS),
      NAMED(FLASHMSA_FAULT_OP_SELECT), NAMED(FLASHMSA_FAULT_OP_FWD), NAMED(FLASHMSA_FAULT_OP_BWD),
      NAMED(FLASHMSA_CHECK_SYNC), NAMED(FLASHMSA_CHECK_RESET), NAMED(FLASHMSA_ABI_VERSION),
      NAMED(FLASHMSA_STRUCT_TENSOR), NAMED(FLASHMSA_STRUCT_SELECT_ARGS), NAMED(FLASHMSA_STRUCT_FWD_ARGS),
      NAMED(FLASHMSA_STRUCT_BWD_ARGS),
  };
#undef NAMED
  for (const Named& c : all) {
    int64_t got = -12345;
    EXPECT_EQ(flashmsa_abi_constant(c.name, &got), 1) << c.name;
    EXPECT_EQ(got, c.value) << c.name;
    EXPECT_EQ(flashmsa_abi_constant(c.name, nullptr), 1) << c.name << ": value may be NULL";
  }
  // the one floating-point macro, reported as the integer it is
  int64_t scale = 0;
  ASSERT_EQ(flashmsa_abi_constant("FLASHMSA_MAX_SCALE", &scale), 1);
  EXPECT_EQ(double(scale), FLASHMSA_MAX_SCALE);
}

TEST(Abi, UnknownConstant) {
  for (const char* name : {"FLASHMSA_NO_SUCH_CONSTANT", "", "flashmsa_mode_given", "FLASHMSA_MODE_GIVEN ",
                           "MODE_GIVEN", "FLASHMSA_API", "FLASHMSA_FLASHMSA_H_"}) {
    int64_t v = 77;
    EXPECT_EQ(flashmsa_abi_constant(name, &v), 0) << "'" << name << "'";
    EXPECT_EQ(v, 77) << "an unknown name must leave the value alone";
  }
  int64_t v = 77;
  EXPECT_EQ(flashmsa_abi_constant(nullptr, &v), 0);
  EXPECT_EQ(v, 77);
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
