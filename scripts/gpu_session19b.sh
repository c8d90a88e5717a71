# Session 19, call B: the GEMV kernels' sweep (one row; 2-16 rows on tensor cores) and the op's tests on CUDA.
set -x
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
python3 -m pytest -q -p no:cacheprovider tests/test_linear_op.py tests/gpu/test_models_cuda.py tests/gpu/test_engine_cuda.py 2>&1 | tail -8
python3 scripts/bench_gemv.py --rows 1,2,5,16 --replays 50 --sweep 2>&1 | tee $OUT/bench_gemv.txt | grep -v "^         "
