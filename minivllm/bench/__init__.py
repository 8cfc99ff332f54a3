"""`minivllm bench`: the same workload through both scheduling policies, measured.

workloads.py builds seeded request lists, runner.py drives an `LLMEngine` with them
(offline or with Poisson arrivals), hf_baselines.py runs transformers on the same
requests, report.py prints the side-by-side table and plots.py draws the pictures.
Notebooks can import all of it.
"""

from minivllm.bench.runner import BenchRun, run_engine
from minivllm.bench.workloads import BenchRequest, LengthDistribution, Workload

__all__ = ["BenchRequest", "BenchRun", "LengthDistribution", "Workload", "run_engine"]
