#!/usr/bin/env bash
# Run the GPU tests and every benchmark script in turn, writing their outputs to docs/bench/ or to the
# directory given as the first argument. Needs a CUDA GPU and the package with its "triton" and "bench"
# extras (pip install -e ".[triton,bench]"); `PYTHON` picks the interpreter (default: python).
# Exits non-zero if any step failed; the other steps still run.
set -u
mkdir -p "${1:-docs/bench}"
out=$(cd "${1:-docs/bench}" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python}
failed=0

step() {  # step FILE COMMAND...: run COMMAND, its stdout and stderr to FILE
    local file=$1
    shift
    echo "== $* > $file"
    "$@" > "$out/$file" 2>&1 || { echo "   failed (exit $?)"; failed=1; }
}

"$py" -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)" \
    > "$out/gpu_tests.txt" 2>&1 || failed=1
workers=()
"$py" -c "import xdist" > /dev/null 2>&1 && workers=(-n 8)
gpu_tests=(tests/test_kernels.py tests/test_exact_triton.py tests/test_exact_blocks_triton.py tests/test_layer.py
    tests/test_llama.py tests/test_gemma3.py tests/test_lm_cache.py tests/test_decode_triton.py tests/test_compile.py
    tests/test_launch.py tests/test_joint_triton.py)
echo "== pytest ${gpu_tests[*]} >> gpu_tests.txt"
"$py" -m pytest -q ${workers[@]+"${workers[@]}"} -rf -p no:cacheprovider "${gpu_tests[@]}" >> "$out/gpu_tests.txt" 2>&1 \
    || { echo "   failed"; failed=1; }

step kernel_breakdown.txt "$py" benchmarks/kernel_breakdown.py
step attention_op.log "$py" benchmarks/attention_op.py --out "$out/attention_op"
step exact_blocks_tiles.log "$py" benchmarks/exact_blocks_tiles.py --out "$out/exact_blocks_tiles.txt"
step exact_prefill.txt "$py" benchmarks/exact_prefill.py
step host_overhead.txt "$py" benchmarks/host_overhead.py
: > "$out/whole_models.txt"
for model in wan-layer sana wan; do
    echo "== $py benchmarks/wan_forward.py --model $model >> whole_models.txt"
    "$py" benchmarks/wan_forward.py --model "$model" >> "$out/whole_models.txt" 2>&1 || { echo "   failed"; failed=1; }
done
: > "$out/whole_models_compiled.txt"
for model in dit sana wan; do
    echo "== $py benchmarks/wan_forward.py --model $model --compile >> whole_models_compiled.txt"
    "$py" benchmarks/wan_forward.py --model "$model" --compile >> "$out/whole_models_compiled.txt" 2>&1 \
        || { echo "   failed"; failed=1; }
done
for model in dit sana; do
    echo "== $py benchmarks/wan_forward.py --model $model --compile --mode reduce-overhead >> whole_models_compiled.txt"
    "$py" benchmarks/wan_forward.py --model "$model" --compile --mode reduce-overhead \
        >> "$out/whole_models_compiled.txt" 2>&1 || { echo "   failed"; failed=1; }
done
: > "$out/joint_models.txt"
for model in wan2.2-ti2v flux qwen-image hunyuanvideo; do
    echo "== $py benchmarks/wan_forward.py --model $model >> joint_models.txt"
    "$py" benchmarks/wan_forward.py --model "$model" >> "$out/joint_models.txt" 2>&1 || { echo "   failed"; failed=1; }
done
step whole_models_kernels.txt "$py" benchmarks/wan_forward.py --model dit --compile --mode reduce-overhead --kernels 8
for model in llama qwen3; do  # both into lm_generate.json and .md
    step "lm_generate_$model.txt" "$py" benchmarks/lm_generate.py --models "$model" --out "$out"
done
runs_ok=1  # fidelity-runs/ (the trained models) stays for a look when either of the two fails
echo "== $py benchmarks/fidelity.py > fidelity.txt"
if "$py" benchmarks/fidelity.py --jobs 15 --out "$out/fidelity-runs" > "$out/fidelity.txt" 2>&1; then
    cp "$out"/fidelity-runs/fidelity{,_summary}.json "$out"/fidelity-runs/fidelity.{md,png} "$out"/
else
    echo "   failed"; failed=1; runs_ok=0
fi
# into fidelity's directory: the frontier's hybrids train from the originals fidelity.py trained there
echo "== $py benchmarks/frontier.py > frontier.txt"
if "$py" benchmarks/frontier.py --jobs 8 --out "$out/fidelity-runs" > "$out/frontier.txt" 2>&1; then
    cp "$out"/fidelity-runs/frontier.{json,md,png} "$out"/
else
    echo "   failed"; failed=1; runs_ok=0
fi
[ $runs_ok = 1 ] && rm -rf "$out/fidelity-runs"
echo "results in $out"
exit $failed
