// The forward kernels for fp16 weights (a translation unit of its own, to compile in parallel).
#include "cuda/forward_kernels.cuh"

namespace posenc {
namespace forward_detail {

cudaError_t launch_fp16(const ForwardArgs& args, cudaStream_t stream) { return launch_for_dtype<__half>(args, stream); }

}  // namespace forward_detail
}  // namespace posenc
