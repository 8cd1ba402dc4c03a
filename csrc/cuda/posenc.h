// The framework-free interface of the CUDA kernels: the argument blocks of common/kernel_args.h in, a
// cudaError_t out; binding.cpp is one caller.  Design: docs/cuda_backend.md; dropout mask: common/philox.cuh.
// The dropout seed is read on the device, never on the host, so launches stay asynchronous and CUDA-graph safe.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/kernel_args.h"

namespace posenc {

// Launches the forward kernel on `stream`; returns the launch status (cudaSuccess for 0 tokens).
cudaError_t launch_forward(const ForwardArgs& args, cudaStream_t stream);

// Launches both stages of the weight gradient (WeightGradArgs) on `stream`; returns the launch status.
// Rows that no token hits, padding_idx and the sentinel are never written, so grad_weight must come
// zero-filled.  `partials`: [ceil(num_tokens / chunk), 2, token_width] fp32 scratch (no initial value
// needed); `chunk`: sorted tokens per stage-1 work item, >= 1.
cudaError_t launch_weight_grad(const WeightGradArgs& args, float* partials, int64_t chunk, cudaStream_t stream);

}  // namespace posenc
