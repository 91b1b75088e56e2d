"""A small GPT-style model in oobleck_elastic's layer-list form, with a synthetic dataset."""
