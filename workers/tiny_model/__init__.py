"""The bundled tiny Qwen3 checkpoint (package data), trained by `python -m workers.tiny_model.train`."""
