"""Hugging Face integration: plans, tensor-parallel modules, sharded loading."""
