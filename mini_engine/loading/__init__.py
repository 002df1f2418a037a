"""Loading checkpoints: the GGUF file, HF folders, and the tokenizer."""
