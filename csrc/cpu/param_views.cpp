#include <torch/library.h>

#include "../common/param_views.h"

TORCH_LIBRARY_IMPL(megatron_fsdp, CPU, m) { m.impl("param_views", &megatron_fsdp::param_views); }
