#!/bin/bash
# One device call on one H200: the GPU kernel tests, then the timings (per-launch breakdown per knob,
# operator table, one Wan layer piece by piece, whole SANA and whole Wan). Everything lands in $OUT
# (docs/bench/ keeps copies). Needs the carried .whl/ (diffusers; fla for the causal rows).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" | tee -a $OUT/env.txt
timeout 240 python3 -m pytest -q -n 8 -rf -p no:cacheprovider tests/test_kernels.py > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log
{ timeout 150 python3 benchmarks/kernel_breakdown.py; [ -n "$SWEEP" ] && timeout 200 python3 benchmarks/kernel_breakdown.py --fwd-sweep; } > $OUT/breakdown.log 2>&1
timeout 150 python3 benchmarks/attention_op.py --shapes ${SHAPES:-wan,dit,sana} --out $OUT/attention_op > $OUT/attention_op.log 2>&1
for m in ${MODELS:-wan-layer sana wan}; do timeout 150 python3 benchmarks/wan_forward.py --model $m; done > $OUT/models.log 2>&1
tail -4 $OUT/tests.log; cat $OUT/breakdown.log; tail -8 $OUT/attention_op.log; grep "|\|Error" $OUT/models.log
