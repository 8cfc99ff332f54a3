"""``minivllm simulate``: the real schedulers on a roofline cost model instead of a model.

models.py and hardware.py hold the presets, cost_model.py times one step, memory.py
sizes the KV pool, executor.py plugs the cost model in behind the engine's executor
seam, driver.py runs a workload on a simulated clock, cluster.py routes it over
replicas, calibrate.py checks the cost model against real runs on this CPU, and
command.py is the CLI.
"""
