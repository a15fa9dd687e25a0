"""Hugging Face interop: export moetrain checkpoints as OlmoeForCausalLM directories and import them
back. `hf` holds the pure config and weight mappings; `io` reads and writes the files."""
