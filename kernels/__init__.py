"""minivllm's attention kernels, installed as the package ``minivllm_kernels``.

- `numba_cpu`: paged attention as a parallel numba CPU kernel (backend "numba-cpu");
- `numba_cuda`: one numba.cuda kernel for GPU or simulator (backend "numba-cuda");
- `gpu_check`: the checks that need a real GPU (``make gpu-check``).

Import the backends through `minivllm.attention.get_backend`, which loads these modules
only when their name is asked for (numba is an optional dependency).
"""
