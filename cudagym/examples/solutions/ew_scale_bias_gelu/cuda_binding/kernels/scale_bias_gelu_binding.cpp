// Thin torch binding around the extern "C" launcher in scale_bias_gelu.cu. It checks its
// arguments, allocates the output and launches on the stream handle passed in from Python (the
// caller's current CUDA stream), so it needs no torch CUDA header.
#include <torch/extension.h>

typedef struct CUstream_st* cudaStream_t;  // as in CUDA's driver_types.h

extern "C" int scale_bias_gelu(const float* x, const float* bias, float* out, int64_t rows, int64_t cols, float scale,
                               cudaStream_t stream);

torch::Tensor scale_bias_gelu_forward(const torch::Tensor& x, const torch::Tensor& bias, double scale,
                                      int64_t stream) {
    TORCH_CHECK(x.is_cuda() && bias.is_cuda(), "scale_bias_gelu: tensors must be on the GPU");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && bias.scalar_type() == torch::kFloat32,
                "scale_bias_gelu: tensors must be float32");
    TORCH_CHECK(x.is_contiguous() && bias.is_contiguous(), "scale_bias_gelu: tensors must be contiguous");
    const int64_t cols = x.size(-1);
    TORCH_CHECK(bias.numel() == cols, "scale_bias_gelu: bias must have x.size(-1) elements");
    torch::Tensor out = torch::empty_like(x);
    const int err = scale_bias_gelu(x.data_ptr<float>(), bias.data_ptr<float>(), out.data_ptr<float>(),
                                    x.numel() / cols, cols, static_cast<float>(scale),
                                    reinterpret_cast<cudaStream_t>(stream));
    TORCH_CHECK(err == 0, "scale_bias_gelu: kernel launch failed with CUDA error ", err);
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("scale_bias_gelu", &scale_bias_gelu_forward, "gelu(x * scale + bias) (CUDA)");
}
