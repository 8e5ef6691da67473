#!/usr/bin/env bash
# The GPU preset through the DAG: `gristmill run configs/gpu.yaml --until pretrain` (a ~125M Llama,
# bf16, fused AdamW, torch.compile, FSDP over every GPU of the machine, one process per GPU, launched
# and supervised by the pretrain stage), then tokens/s per GPU and MFU against the GPU's bf16 peak,
# read from the stage's metrics (the median of the step reports after the first, which holds the
# compilation). Without a GPU it runs the same path on the CPU (a tiny model, 2 processes over gloo,
# no MFU), so the script itself is checked anywhere. Usage, from the repository root:
#     bash bench/gpu_pretrain.sh            # env: STEPS (300), GRISTMILL_HOME (a fresh temporary one)
set -euo pipefail
cd "$(dirname "$0")/.."
export GRISTMILL_HOME=${GRISTMILL_HOME:-$(mktemp -d)/home}
STEPS=${STEPS:-300}
if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  gpus=$(python -c "import torch; print(torch.cuda.device_count())")
  python -c "import torch; print(torch.cuda.get_device_name())"
  overrides=("pretrain.launch.processes=$gpus" "pretrain.max_steps=$STEPS")
else
  echo "no CUDA device: the CPU fallback (tiny model, 2 processes over gloo)"
  overrides=("pretrain.model={hidden_size: 128, num_layers: 2, num_heads: 4, intermediate_size: 512, max_seq_len: 256}"
             pretrain.seq_len=256 pretrain.batch_size=8 pretrain.tokens_per_step=4096 pretrain.max_steps=20
             pretrain.eval_every=10 pretrain.log_every=5 pretrain.device=cpu pretrain.compile=false
             pretrain.launch.processes=2 pretrain.launch.accelerate_config=infra/accelerate/ddp_cpu.yaml
             tokenize.vocab_size=4096)
fi
gristmill run configs/gpu.yaml "${overrides[@]}" --until pretrain
python - "$GRISTMILL_HOME" <<'EOF'
import json, statistics, sys
from pathlib import Path

[manifest] = Path(sys.argv[1], "artifacts", "pretrain").glob("*/manifest.json")
stats = json.loads(manifest.read_text())["stats"]
rows = [json.loads(line) for line in (manifest.parent / "metrics.jsonl").read_text().splitlines()]
reports = [r for r in rows if "tokens_per_s" in r][1:]  # the first report holds the compilation
world = stats["world_size"]
tokens_per_s = statistics.median(r["tokens_per_s"] for r in reports)
mfu = statistics.median(r["mfu"] for r in reports) if all("mfu" in r for r in reports) else None
print(json.dumps({"bench": "gpu_pretrain", "world_size": world, "params": stats["params"],
                  "tokens_per_s": round(tokens_per_s, 1), "tokens_per_s_per_gpu": round(tokens_per_s / world, 1),
                  "mfu": None if mfu is None else round(mfu, 4), "final_train_loss": stats["final_train_loss"]}))
EOF
