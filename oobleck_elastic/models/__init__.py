"""Adapters from models users have to the layer list the runtime runs (runtime.model)."""
