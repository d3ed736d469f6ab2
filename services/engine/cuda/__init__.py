"""The CUDA engine's glue: the Triton paged-attention backend and the decode CUDA graphs."""
