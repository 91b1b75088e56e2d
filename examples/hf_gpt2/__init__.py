"""The Hugging Face path end to end: a local corpus, tokenizer and tiny GPT-2, trained by
`python -m oobleck_elastic.train` through a node failure, exported and loaded back with
transformers (`python -m examples.hf_gpt2.run`)."""
