// Precompiled header shared by every kiln C++ target: the heavy ATen/autograd and std headers.
#pragma once
#include <ATen/ATen.h>
#include <torch/types.h>
#include <torch/csrc/autograd/autograd.h>
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>
