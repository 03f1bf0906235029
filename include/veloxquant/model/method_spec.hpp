// Where method specs used to live. A method is not part of the model: MethodSpec and make_caches
// are in methods/method_spec.hpp (the table of methods in methods/method_table.hpp), Fp16KVCache in
// cache/fp16_cache.hpp, the vq layer models a checkpoint gives in model/vq_layer_models.hpp. This
// header includes the three, so code written against it keeps compiling.
#pragma once
#include "veloxquant/cache/fp16_cache.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/vq_layer_models.hpp"
