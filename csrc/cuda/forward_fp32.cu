// The forward kernels for fp32 weights (a translation unit of its own, to compile in parallel).
#include "cuda/forward_kernels.cuh"

namespace posenc {
namespace forward_detail {

cudaError_t launch_fp32(const ForwardArgs& args, cudaStream_t stream) { return launch_for_dtype<float>(args, stream); }

}  // namespace forward_detail
}  // namespace posenc
