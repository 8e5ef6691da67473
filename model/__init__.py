"""Model code shared by the training stages: presets (stock transformers architectures), the LR
schedule, the Accelerate training loop with checkpoints and exact resume, and HF export."""
