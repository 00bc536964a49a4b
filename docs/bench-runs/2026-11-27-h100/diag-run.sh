# diagnostics run on the GPU machine (session 6): profiles + the CPU suite's failures by name
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .diag/*.whl || exit 3
mkdir -p /tmp/shim && ln -sfn "$PWD/kernels" /tmp/shim/tensorql_kernels
export PYTHONPATH=$PWD:/tmp/shim:/tmp/site:$PWD/bench
SPY=/tmp/site/bin/py-spy; chmod +x $SPY
nproc; free -g | head -2
timeout 75 python3 bench/gpu_profile.py matmul > $OUT/profile_matmul.txt 2>&1; tail -40 $OUT/profile_matmul.txt
timeout 90 $SPY record -r 200 --gil -f raw -o $OUT/spy_offload.txt -- python3 bench/gpu_profile.py offload > $OUT/profile_offload.txt 2>&1; tail -30 $OUT/profile_offload.txt
timeout 90 $SPY record -r 200 --gil -f raw -o $OUT/spy_llama.txt -- python3 bench/gpu_llama_layer.py --repeat 5 > $OUT/llama.txt 2>&1; tail -8 $OUT/llama.txt
ls -la $OUT
timeout 185 python3 -m pytest -n 16 -v -p no:cacheprovider -p no:benchmark --tb=line -rf > $OUT/suite.txt 2>&1
grep -E "FAILED|ERROR|[0-9]+ (passed|failed)" $OUT/suite.txt | tail -40
