#!/usr/bin/env bash
# Issue 19's GPU measurements, in parts that each end well inside one
# 10-minute call of the project's device tool (times from the H100 runs of
# 2026-11-22; the parts together need about 20 minutes of device time).
#
# Here, on a machine with pip and ../shared beside the checkout, once:
#     bash benchmarks/gpu.sh prepare
# downloads the wheels the GPU image lacks (keras and two of its needs) into
# .whl/ and copies MNIST into .data/, both ignored by git. Then, on the GPU
# machine, one call per part, carrying .whl and .data:
#     bash benchmarks/gpu.sh convnet    # bench.py: resident, host-fed, Keras, guide, bound, Keras's scan; K 1,4,16; ~4 min
#     bash benchmarks/gpu.sh evaluate   # evaluate_steps.py: evaluate/predict K 1,4,16 against K=1; ~2 min
#     bash benchmarks/gpu.sh resnet     # resnet.py: ResNet-18 float32 and mixed_bfloat16, keras_dp and Keras; ~4 min
#     bash benchmarks/gpu.sh flags      # resnet.py (keras_dp) under each XLA flag below; ~6 min
#     bash benchmarks/gpu.sh model_axis # model_axis.py: a 1e9-parameter Gemma on 1xN and Nx1 meshes; ~8 min (estimated, not yet run)
# Results (JSON, and each part's log) go to $OUT when set (the device
# tool's folder that comes back), else to benchmarks/.
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: bash benchmarks/gpu.sh prepare|convnet|evaluate|resnet|flags|model_axis}
out=${OUT:-benchmarks}

if [ "$part" = prepare ]; then
  mkdir -p .git/info .data
  for dir in /.whl/ /.data/; do
    grep -qxF "$dir" .git/info/exclude 2>/dev/null || echo "$dir" >> .git/info/exclude
  done
  cp ../shared/data/mnist.npz .data/
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl keras==3.15.1 namex optree \
      keras-hub==0.32.0 regex tokenizers  # keras-hub without its TensorFlow (model_axis)
  exit
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 KERAS_BACKEND=jax \
    KERAS_DP_DATA_DIR="$PWD/.data"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu-$part.log"

case "$part" in
  convnet)
    python3 benchmarks/bench.py --platform gpu --systems keras_dp,host,keras,guide,bound,scan \
        --batch-sizes 64,256 --ks 1,4,16 --reps 5 --samples 49152 \
        --out "$out/results-gpu-targets.json" 2>&1 | tee -a "$out/gpu-$part.log" ;;
  evaluate)
    python3 benchmarks/evaluate_steps.py --platform gpu \
        --out "$out/results-evaluate-gpu.json" 2>&1 | tee -a "$out/gpu-$part.log" ;;
  resnet)
    python3 benchmarks/resnet.py --platform gpu \
        --out "$out/results-resnet18-gpu-targets.json" 2>&1 | tee -a "$out/gpu-$part.log" ;;
  flags)
    # The flags that matter for convolutions on one GPU: how hard XLA
    # autotunes (0 = off; 4 is the default), the latency-hiding scheduler
    # (overlaps collectives with compute; one GPU has none, so expect no
    # change), and command buffers (CUDA graphs; empty = off), which cut
    # kernel launch overhead for small kernels.
    index=0
    for flags in "--xla_gpu_autotune_level=0" "--xla_gpu_enable_latency_hiding_scheduler=true" \
                 "--xla_gpu_enable_command_buffer="; do
      index=$((index + 1))
      echo "XLA_FLAGS=$flags" | tee -a "$out/gpu-$part.log"
      XLA_FLAGS="$flags" python3 benchmarks/resnet.py --platform gpu --systems keras_dp --epochs 3 \
          --out "$out/results-resnet18-gpu-flags-$index.json" 2>&1 | tee -a "$out/gpu-$part.log"
    done ;;
  model_axis)
    # A Gemma-shaped model of 1.06e9 parameters from a config (random weights),
    # mixed_bfloat16: keras_dp on a (1, N) ("batch", "model") mesh under
    # GemmaBackbone.get_layout_map, and as pure data parallelism on N devices;
    # Keras's own ModelParallel fit on the (1, N) mesh where N > 1. Tokens/s
    # and model FLOP/s per device (6 x parameters + attention, per token).
    python3 benchmarks/model_axis.py --platform gpu --config 1b --meshes 1xN,Nx1 \
        --systems keras_dp,keras --batch-size 8 --sequence-length 1024 --steps 10 --rounds 3 \
        --out "$out/results-model-axis-gpu.json" 2>&1 | tee -a "$out/gpu-$part.log" ;;
  *)
    echo "unknown part $part: prepare, convnet, evaluate, resnet, flags or model_axis" >&2
    exit 2 ;;
esac
