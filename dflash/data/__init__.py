"""Chat data -> tokenized shards -> padded batches, and the data made ahead of training.

  chat_formats  chat JSONL records (OpenAI, ShareGPT, prompt/response) -> template messages
  tokenization  tokenizers, chat-template ids and the loss mask on assistant tokens
  thinking      the chat template's thinking switch, resolved once (--thinking)
  tokenizer_match  whether a tokenizer belongs to the target (size, special ids, vocabulary)
  prepare       a tokenized shard directory, in parallel, with progress
  shards        the shard's files and manifest
  dataset       TokenDataset and collate
  sampler       length-bucketed micro-batches for all data-parallel ranks
  sharegpt      ShareGPT -> prompt-only chat JSONL (python -m dflash.data.sharegpt)
  magpie        prompts the target writes itself (python -m dflash.data.magpie)
  leetcode      LeetCode problems -> coding prompts (python -m dflash.data.leetcode)
  chatterbot    ChatterBot's coding requests -> prompts (python -m dflash.data.chatterbot)
  prompts       N prompts in one command: the registry's, then the target's (python -m dflash.data.prompts)
  prompt_filters  mostly-ASCII text, code requests, exact and near-duplicate prompts
  regenerate    the target rewrites the replies (python -m dflash.regenerate), sharded over a launch's ranks
  partials      regeneration's per-rank partial files (resume) and its output

May import: dflash.util, dflash.target (a GGUF target's tokenizer, generation for regeneration).
"""
