// KILN_TORCH_AT_LEAST(major, minor): compile-time libtorch version test, for APIs newer than 1.13.
#pragma once
#include <torch/version.h>

#define KILN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
