"""Serving many LoRA adapters over one base model: loading PEFT folders (adapter.py), the
resident set (registry.py) and the per-step, grouped application (batching.py)."""
