"""FP8 (e4m3): quantized linear layers, FP8 checkpoints and quantization at load, the FP8 KV cache."""
