"""The rollout service: an inference engine (vLLM on GPU, transformers on CPU or GPU) behind Generate."""
