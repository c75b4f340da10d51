"""Hand-written Triton kernels (fabriclite.kernels). Filled in by the kernels work; importing this is cheap."""
