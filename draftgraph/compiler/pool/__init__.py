"""The compile pool: worker processes that compile unique pieces while tracing goes on (compile_pool.py,
compile_worker.py), their lifetime across engine builds (pool_lifetime.py) and our Triton kernels compiled
ahead in threads (kernels_ahead.py). It imports from the compiler core only its data formats (fx_serialize,
inductor_options, piece_inputs) and ops/; the core submits work to it."""
