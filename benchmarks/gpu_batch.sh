#!/bin/bash
# One device call: GPU tests on GPU 1 (then the whole-model runs there, previous launch path and
# current), operator table (with the previous launch path in the same process) and the host-overhead
# probe on GPU 0. Everything lands in $OUT (docs/bench/ keeps copies). Needs the carried .whl/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" | tee -a $OUT/env.txt
(
  CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -q -rf -p no:cacheprovider tests/test_kernels.py > $OUT/tests.log 2>&1
  echo "tests rc=$?" >> $OUT/tests.log
  for m in sana wan; do
    for flag in --old-launch ""; do
      CUDA_VISIBLE_DEVICES=1 timeout 120 python3 benchmarks/wan_forward.py --model $m $flag 2>&1 | grep -v Warning
    done
  done > $OUT/whole.log 2>&1
) &
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/host_overhead.py > $OUT/host.log 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/attention_op.py --baseline --out $OUT/attention_op > $OUT/attention_op.log 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/kernel_breakdown.py --fwd-sweep > $OUT/sweep.log 2>&1 &
wait
tail -3 $OUT/tests.log; cat $OUT/host.log; tail -14 $OUT/attention_op.log; grep "|\|FWD\|Error" $OUT/whole.log; grep "wan\|best" $OUT/sweep.log
