"""Several ranks: compile_model with tensor_parallel_size x data_parallel_size N > 1 starts N worker processes
(worker.py), each building its own engine on its device, and returns a driver (driver.py) that sends each call
to the ranks it concerns and spreads requests over data-parallel replicas (router.py). Sources cross the
process boundary as paths (sources.py), inside the `BuildRequest` each rank builds from. Sits beside api.py:
both call build/engine.py's build_engine, the one path to an engine."""
