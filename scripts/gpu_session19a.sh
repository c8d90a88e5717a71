set -x
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
python3 scripts/bench_gemv.py --sweep 2>&1 | tee $OUT/bench_gemv.txt
python3 -m pytest -q -p no:cacheprovider tests/test_race_sample.py tests/test_sampling.py tests/gpu/test_norm_cuda.py tests/test_argmax.py 2>&1 | tail -15
