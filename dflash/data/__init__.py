"""Chat data -> tokenized shards -> padded batches, and the data made ahead of training.

  chat_formats  chat JSONL records (OpenAI, ShareGPT, prompt/response) -> template messages
  tokenization  tokenizers, chat-template ids and the loss mask on assistant tokens
  prepare       a tokenized shard directory, in parallel, with progress
  shards        the shard's files and manifest
  dataset       TokenDataset and collate
  sampler       length-bucketed micro-batches for all data-parallel ranks
  sharegpt      ShareGPT -> prompt-only chat JSONL (python -m dflash.data.sharegpt)
  regenerate    the target rewrites the replies (python -m dflash.regenerate), sharded over a launch's ranks
  partials      regeneration's per-rank partial files (resume) and its output
  __main__      python -m dflash.data prepare|stats (a command: it reads the run's flags, dflash.config)

May import: dflash.util, dflash.target (a GGUF target's tokenizer, generation for regeneration).
"""
