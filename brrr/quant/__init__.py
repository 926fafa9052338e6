"""Weight quantization: formats (int8, int4, nf4, fp8), methods (RTN, GPTQ, AWQ), the QuantLinear seam, quantized
checkpoints and perplexity evaluation. See docs/quantization.md."""
