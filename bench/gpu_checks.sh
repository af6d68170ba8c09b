#!/usr/bin/env bash
# The checks that need a CUDA device, in one run that ends within DEADLINE seconds (default 540):
# the gpu-marked tests, bench.lora_kernels (with its decode attention table), the prefill attention
# table, and bench.gpu_serving on the Llama-3.2-3B shape. Each stage writes $OUT/<stage>.log
# (default: gpu-checks/) and is cut at its limit or at the deadline; the logs' ends print last.
# Run from the repository root; PYTHON (default python3) must hold torch with CUDA and Triton.
#   bench/gpu_checks.sh
#   SERVING_ARGS='--shapes 3b 8b --repeats 3' DEADLINE=3600 bench/gpu_checks.sh
export PYTHONUNBUFFERED=1
out=${OUT:-gpu-checks}
python=${PYTHON:-python3}
deadline=${DEADLINE:-540}
mkdir -p "$out"

stage() {  # stage NAME LIMIT COMMAND...: runs COMMAND into $out/NAME.log for at most LIMIT seconds
  local name=$1 limit=$2 left=$((deadline - SECONDS))
  shift 2
  ((limit > left)) && limit=$left
  if ((limit < 10)); then echo "== $name: skipped, the deadline is near"; return; fi
  echo "== $name (at most ${limit} s, from ${SECONDS} s)"
  timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit status $? at ${SECONDS} s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# only the files holding gpu tests: the others may import what a GPU machine lacks (boto3, moto)
stage tests 200 "$python" -m pytest -m gpu -p no:cacheprovider -q --continue-on-collection-errors \
  $(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests)
stage lora 120 "$python" -m bench.lora_kernels
stage prefill 40 "$python" -c "import torch; from bench.attention_kernels import prefill_attention_table
with torch.inference_mode(): print('\n'.join(prefill_attention_table()))"
# shm: the 3B model's 6.4 GB of random weights are written and read back at start
TMPDIR=$( [ -d /dev/shm ] && echo /dev/shm || echo "${TMPDIR:-/tmp}" ) \
  stage serving 3600 "$python" -m bench.gpu_serving ${SERVING_ARGS:---shapes 3b --repeats 1}
for name in tests lora prefill serving; do
  echo "######## $name"
  tail -c 2000 "$out/$name.log" 2>/dev/null
done
