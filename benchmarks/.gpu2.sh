python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD/benchmarks KEDRO_DISABLE_TELEMETRY=true
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 45 python3 benchmarks/decode_attention.py --out $OUT/da --spans 256 1024 2048 2560 --repeats 20 > $OUT/da.log 2>&1; tail -12 $OUT/da.log
timeout 50 python3 -m pytest -o addopts="" -q -m gpu tests/model/test_generate.py -k "folded" > $OUT/pytest.log 2>&1; tail -2 $OUT/pytest.log
for f in --unfolded ""; do timeout 90 python3 benchmarks/rollout_lengths.py --out $OUT/rl$f --work /tmp/rlw --uniform-only --repeats 1 $f > $OUT/rl$f.log 2>&1; tail -1 $OUT/rl$f.log; done
timeout 190 python3 benchmarks/rl_iteration.py --out $OUT/rli --work /tmp/rliw --lengths uniform > $OUT/rli.log 2>&1; tail -4 $OUT/rli.log
