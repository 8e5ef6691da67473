"""Stage 4, SFT: chat-template fine-tuning with the loss on assistant tokens only, optional LoRA
and packing. `conversations` reads the supported conversation formats."""
from tasks.sft.stage import VERSION, Config, fingerprint, run

__all__ = ["Config", "VERSION", "fingerprint", "run"]
