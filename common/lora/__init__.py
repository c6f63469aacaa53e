"""Many fine-tunes on one engine: LoRA adapters served beside the base model (ch10)."""
