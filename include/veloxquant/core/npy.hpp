// Reading and writing numpy .npy files of rank-4 float32 / float16 arrays.
//
// Accepted: format versions 1.0, 2.0 and 3.0; descr '<f4' or '<f2' (little-endian; '=' is taken
// as little-endian too since veloxquant only runs on little-endian hosts); C order; shape of
// rank 4, or lower ranks when the caller allows it (padded with leading 1s). The data length must
// match the shape exactly: a short or overlong file is an error, never silently accepted.
#pragma once
#include <string>

#include "veloxquant/core/tensor.hpp"

namespace vq {

// Throws IoError when the file cannot be opened, FormatError when it is not a valid .npy of the
// accepted kinds (the message names the file and what is wrong).
Tensor read_npy(const std::string& path);

// Write a float32 or float16 tensor as a .npy (version 1.0, C order). bfloat16 has no numpy
// dtype: throws InvalidArgument. Writes to a temporary file then renames, so an interrupted write
// never leaves a half file under `path`.
void write_npy(const std::string& path, const Tensor& tensor);

}  // namespace vq
