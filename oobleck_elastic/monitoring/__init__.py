"""Metrics sinks (JSONL, TensorBoard), layout pictures and progress lines."""
