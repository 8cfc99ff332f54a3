"""``minivllm simulate``: the real schedulers on a roofline cost model instead of a model.

models.py and hardware.py hold the presets (bench/hardware_probe.py measures this machine's
matmul and memory rates), cost_model.py times one step, memory.py
sizes the KV pool, clock.py is simulated time, executor.py plugs the cost model in
behind the engine's executor seam, cluster.py runs a workload on one or more replicas
(and searches for how many a traffic needs), workloads.py draws chat-like lengths,
calibrate.py checks the cost model against real runs on this CPU, and command.py is
the CLI.
"""
