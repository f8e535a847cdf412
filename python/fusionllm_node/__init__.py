"""fusionllm-node: a fusionllm compute node in Python (NumPy or PyTorch kernels)."""
