// launch_forward: checks the arguments and hands over to the launcher of the weight dtype
// (forward_fp32.cu, forward_fp16.cu, forward_bf16.cu; the kernel is in forward_kernels.cuh).
#include "cuda/forward_kernels.cuh"
#include "cuda/posenc.h"

namespace posenc {

cudaError_t launch_forward(const ForwardArgs& args, cudaStream_t stream) {
  if (args.num_tokens < 0 || args.seq_len < 1 || args.token_width < 0 || args.pe_width < 0 || args.num_turns < 0 ||
      args.num_embeddings < 0 || (!args.concat && args.pe_width != args.token_width)) {
    return cudaErrorInvalidValue;
  }
  if (args.num_tokens == 0) return cudaSuccess;
  switch (args.dtype) {
    case DType::kFloat32: return forward_detail::launch_fp32(args, stream);
    case DType::kFloat16: return forward_detail::launch_fp16(args, stream);
    case DType::kBFloat16: return forward_detail::launch_bf16(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace posenc
