#!/usr/bin/env bash
# Throughput and MFU of the ~125M preset on one GPU, bf16 autocast, with and without
# torch.compile: our training loop next to a plain PyTorch loop (bench/pretrain.py). About 3-5
# minutes on an H100/H200, most of it compilation. Usage, from the repository root:
#     bash bench/gpu_pretrain.sh            # env: BATCH (16), SEQ (2048), STEPS (40)
set -euo pipefail
cd "$(dirname "$0")/.."
BATCH=${BATCH:-16} SEQ=${SEQ:-2048} STEPS=${STEPS:-40}
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
common=(--preset 125m --vocab-size 32000 --device cuda --seq-len "$SEQ" --batch-size "$BATCH"
        --steps "$STEPS" --warmup-steps 10 --repeats 2 --threads 8)
echo "== eager, bf16"
python -m bench pretrain "${common[@]}"
echo "== torch.compile, bf16"
python -m bench pretrain "${common[@]}" --compile
