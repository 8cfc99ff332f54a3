"""minivllm's attention kernels, installed as the package ``minivllm_kernels``.

- `numba_cpu`: paged attention as a parallel numba CPU kernel (backend "numba-cpu");
- `numba_cuda`: one numba.cuda kernel for GPU or simulator (backend "numba-cuda");
- `random_batch`: random paged batches for the benchmarks and GPU checks.

Import the backends through `minivllm.attention.get_backend`, which finds them through the
``minivllm.attention_backends`` entry points (pyproject.toml) and loads these modules only
when their name is asked for (numba is an optional dependency). The checks that need a
real GPU are `benchmarks/gpu_check.py` (``make gpu-check``).
"""
