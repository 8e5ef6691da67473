"""Model code shared by the training stages: their typed configs (`config`, importable without
torch, so stage configs validate without it), presets (stock transformers architectures), the LR
schedule, the Accelerate training loop with checkpoints and exact resume, and HF export."""
