"""The bundled tiny Qwen3 checkpoint (package data), built by `python -m workers.tiny_model.build`."""
