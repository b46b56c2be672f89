// param_views is metadata only; the CUDA registration reuses the shared implementation.
#include <torch/library.h>

#include "../common/param_views.h"

TORCH_LIBRARY_IMPL(megatron_fsdp, CUDA, m) { m.impl("param_views", &megatron_fsdp::param_views); }
