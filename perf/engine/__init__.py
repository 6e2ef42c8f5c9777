"""The engine in-process: offline throughput, closed-loop ceilings, features (LoRA, speculative, TP), perplexity."""
