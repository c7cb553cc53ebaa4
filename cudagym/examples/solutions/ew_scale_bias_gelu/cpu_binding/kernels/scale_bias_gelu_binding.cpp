// Thin torch binding around the extern "C" C++ kernel in scale_bias_gelu.cpp: argument checks,
// output allocation, one call.
#include <torch/extension.h>

extern "C" void scale_bias_gelu(const float* x, const float* bias, float* out, int64_t rows, int64_t cols,
                                float scale);

torch::Tensor scale_bias_gelu_forward(const torch::Tensor& x, const torch::Tensor& bias, double scale) {
    TORCH_CHECK(x.device().is_cpu() && bias.device().is_cpu(), "scale_bias_gelu: tensors must be on the CPU");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && bias.scalar_type() == torch::kFloat32,
                "scale_bias_gelu: tensors must be float32");
    TORCH_CHECK(x.is_contiguous() && bias.is_contiguous(), "scale_bias_gelu: tensors must be contiguous");
    const int64_t cols = x.size(-1);
    TORCH_CHECK(bias.numel() == cols, "scale_bias_gelu: bias must have x.size(-1) elements");
    torch::Tensor out = torch::empty_like(x);
    scale_bias_gelu(x.data_ptr<float>(), bias.data_ptr<float>(), out.data_ptr<float>(), x.numel() / cols, cols,
                    static_cast<float>(scale));
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("scale_bias_gelu", &scale_bias_gelu_forward, "gelu(x * scale + bias) (CPU)");
}
