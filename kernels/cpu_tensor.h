// The part of torch's C++ API the kernels use: at::Tensor, the factories they call,
// at::parallel_for. Not <torch/extension.h>: that brings torch's whole C++ frontend and
// pybind11, and parsing it was most of each file's compile time, paid at every first start.
// Only cpu_extension.cpp, which binds the kernels to Python, includes it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
