#!/usr/bin/env bash
# The GPU checks in one go, for a host with one NVIDIA GPU and the project's packages importable:
#   1. decode at Qwen2.5-7B's shapes, concurrency 1, 64 and 256, the XLA paged attention and the
#      Pallas kernel side by side in one process (accelerator.py; each row says what ran and how
#      far the kernel's greedy answers agree with the XLA path's);
#   2. 7B decode with the layer weights stacked (sliced out each step) against split, at 1 and 64;
#   (with RUN_1_5B=1, the first part again at Qwen2.5-1.5B's shapes;)
#   3. the kernel's bfloat16 numerics against float32 beside the XLA path's (kernel_numerics.py), on
#      the bench's trained tiny model and at Qwen2.5-1.5B's shapes;
#   4. the quick-start demo with the rollout engine in the trainer's process (rollout.backend=local).
# Each part has its own time limit so one slow part cannot lose the others' figures.
#
#   bash benchmarks/gpu_checks.sh OUT_DIR [DEMO_STEPS]
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR [DEMO_STEPS]}
demo_steps=${2:-40}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root:$root/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$root"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" 2>&1 \
  | tee -a "$out/gpu.txt"

run() {  # run LIMIT_S NAME CMD...: CMD's output to OUT/NAME.log, cut at LIMIT_S
  local limit=$1 name=$2; shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0)) s"
  grep -E '^(decode|train|bf16|NVIDIA|packed|\{"seed)|Error' "$out/$name.log" | tail -20
}

run "${LIMIT_7B:-270}" decode_7b python3 benchmarks/accelerator.py --model qwen2.5-7b --parts ceilings,decode \
  --concurrency 1 64 256 --new-tokens 128 --attention-backend native fa --out "$out/decode_7b.json"
run "${LIMIT_LAYOUT:-130}" layout_7b python3 benchmarks/accelerator.py --model qwen2.5-7b --parts ceilings,decode \
  --concurrency 1 64 --new-tokens 128 --attention-backend native --layer-layout stacked split \
  --out "$out/layout_7b.json"
if [ -n "${RUN_1_5B:-}" ]; then
  run "${LIMIT_1_5B:-130}" decode_1_5b python3 benchmarks/accelerator.py --model qwen2.5-1.5b --parts ceilings,decode \
    --concurrency 1 64 256 --new-tokens 128 --attention-backend native fa --out "$out/decode_1_5b.json"
fi
run "${LIMIT_NUMERICS:-120}" kernel_numerics sh -c "python3 benchmarks/kernel_numerics.py --model long_tail \
  --out $out/kernel_numerics_long_tail.json && python3 benchmarks/kernel_numerics.py --shape qwen2.5-1.5b --steps 100 \
  --out $out/kernel_numerics_1_5b.json"
run "${LIMIT_DEMO:-180}" demo python3 -c 'from areal_jax.cli import main; main()' train --config configs/demo.yaml \
  rollout.backend=local "steps=$demo_steps" eval.every=20 "run_dir=$out/demo_run"
tail -5 "$out/demo.log"
cp "$out/demo_run/metrics.jsonl" "$out/demo_metrics.jsonl" 2>/dev/null
rm -rf "$out/demo_run"
