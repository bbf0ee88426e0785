"""The chat template's thinking switch (`enable_thinking`, as in Qwen3's), one --thinking flag for
regeneration, training and evaluation, resolved once against the tokenizer.

A drafter drafts what it was trained on: trained on replies to prompts rendered with thinking off,
it is lost on a thinking continuation. So the mode is resolved to "on", "off" or "none" (the
template has no switch) and recorded where the data, the run and the drafter are written; a run
whose mode differs from the one its data or drafter records stops (mismatch_error).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import jinja2

from dflash.data.chat_formats import THINKING_MODES, DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

THINKING_FLAG_VALUES = ("auto", "on", "off")
THINKING_HELP = ("auto (the default: the chat template's own choice, such as Qwen3's thinking on) | on | off: "
                 "enable_thinking for chat templates that have it. Resolved once to on, off or none (the template "
                 "has no switch) and recorded in the regenerated data, the run and the exported drafter; "
                 "training, evaluation and serving must use the same mode")

_PROBE = [{"role": "user", "content": "Hi"}]


def resolve_thinking(tokenizer: PreTrainedTokenizerBase, requested: str) -> str:
    """The mode prompts are rendered in: "on" / "off" as requested, or for "auto" the one the
    template renders by default; "none" when enable_thinking changes nothing. Found by rendering
    one generation prompt with, without and in each mode."""
    if requested not in THINKING_FLAG_VALUES:
        raise DataError(f"--thinking {requested}: use one of {', '.join(THINKING_FLAG_VALUES)}")
    renders = {mode: _generation_prompt(tokenizer, thinking_kwargs(mode)) for mode in THINKING_MODES}
    if renders["on"] == renders["off"]:
        if requested != "auto":
            logger.warning("--thinking %s: the chat template of %s has no enable_thinking switch; prompts render "
                           "as it writes them (recorded as thinking none)", requested, tokenizer.name_or_path)
        return "none"
    if requested != "auto":
        return requested
    for mode in ("on", "off"):
        if renders["none"] == renders[mode]:
            return mode
    raise DataError(f"--thinking auto: the chat template of {tokenizer.name_or_path} renders a prompt without "
                    "enable_thinking unlike with it on or off; pass --thinking on or --thinking off")


def thinking_kwargs(mode: str) -> dict[str, Any]:
    """The chat-template arguments of a resolved mode (none: the template's own render)."""
    return {} if mode == "none" else {"enable_thinking": mode == "on"}


def mismatch_error(recorded: str, where: str, used: str, what: str) -> DataError:
    """A mode recorded at `where` (with the data or the drafter, `what`) that is not `used`: the
    error names both values and the flag to change."""
    if "none" in (recorded, used):
        fix = (f"one chat template has a thinking switch and the other has none: pass the --tokenizer that {what} "
               "was made with")
    else:
        fix = f"pass --thinking {recorded} to use {what} as it was made, or remake it with --thinking {used}"
    return DataError(f"{where} records thinking {recorded!r}, but this run renders prompts with thinking {used!r} "
                     f"(--thinking, resolved against the chat template); {fix}")


def _generation_prompt(tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any]) -> str:
    try:
        return tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True, **kwargs)
    except (jinja2.TemplateError, ValueError) as err:
        raise DataError(f"the chat template of {tokenizer.name_or_path} cannot render a one-turn prompt ({err}); "
                        "pass a --tokenizer with a working chat template") from err
