#!/bin/bash
# Everything docs/benchmarks.md reports, in one device call on one H200 (~9 minutes): the GPU tests, the
# per-launch breakdown, the operator table, the decoding step, the host overhead and the whole models. Files
# land in $OUT under the names docs/bench/ keeps (the device returns 8 files). Needs the carried .whl/
# (diffusers; fla for the causal rows).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch,triton;print(torch.__version__,triton.__version__)"; } > $OUT/gpu_tests.txt
timeout 240 python3 -m pytest -q -n 8 -rf -p no:cacheprovider tests/test_kernels.py tests/test_layer.py >> $OUT/gpu_tests.txt 2>&1
echo "tests rc=$?" >> $OUT/gpu_tests.txt
timeout 200 python3 benchmarks/kernel_breakdown.py > $OUT/kernel_breakdown.txt 2>&1
timeout 240 python3 benchmarks/attention_op.py --out $OUT/attention_op > $OUT/attention_op.log 2>&1
timeout 60 python3 benchmarks/decode_step.py > $OUT/decode_step.txt 2>&1
timeout 60 python3 benchmarks/host_overhead.py > $OUT/host_overhead.txt 2>&1
for m in wan-layer sana wan; do timeout 150 python3 benchmarks/wan_forward.py --model $m; done > $OUT/whole_models.txt 2>&1
head -2 $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt; cat $OUT/kernel_breakdown.txt; tail -14 $OUT/attention_op.log
tail -4 $OUT/decode_step.txt; cat $OUT/host_overhead.txt; grep "|\|Error\|H200" $OUT/whole_models.txt
