"""Hugging Face interop: names and config.json both ways (adapter), safetensors import/export in any
layout (io)."""
