// kiln_test_cuda's main: gtest's flags, and --nvfp4-gemm=NAME / --bitwise-gemm=NAME, which put that
// GEMM choice in place for the whole run as a recipe's kernels: section would (the ctests that run
// the NVFP4 serving and bitwise suites again under each forced kernel pass them).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "core/error.h"
#include "kernels/kernel_choice.h"
#include "kernels/nvfp4_dispatch.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);  // takes gtest's own flags out of argv
  kiln::kernels::KernelChoice choice;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      const std::string nvfp4 = "--nvfp4-gemm=", bitwise = "--bitwise-gemm=";
      if (arg.rfind(nvfp4, 0) == 0) choice.nvfp4_gemm = kiln::kernels::parse_nvfp4_gemm(arg.substr(nvfp4.size()));
      else if (arg.rfind(bitwise, 0) == 0)
        choice.bitwise_gemm = kiln::kernels::parse_bitwise_gemm(arg.substr(bitwise.size()));
      else KILN_FAIL("unknown argument '", arg, "' (expected gtest flags, --nvfp4-gemm=NAME, --bitwise-gemm=NAME)");
    }
    kiln::kernels::select_kernels(choice);
  } catch (const kiln::Error& e) {
    std::fprintf(stderr, "kiln_test_cuda: %s\n", e.what());
    return 2;
  }
  return RUN_ALL_TESTS();
}
