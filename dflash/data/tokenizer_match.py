"""Whether a tokenizer belongs to the target, checked wherever the two are taken together (training,
the data tools, evaluation, regeneration). Another model's tokenizer runs without any error: its ids
index rows of the target's embedding all the same, and the drafter learns from text the target
never saw. Three checks, each named in the error:

  size        the tokenizer's ids fit the target's embedding rows (config vocab_size)
  special ids its end-of-sequence, beginning-of-sequence and padding ids are among the ones the
              target's config and generation config name (where both name one)
  vocabulary  on the ids both have, it names the tokens the target's own tokenizer names, where the
              target ships one (an HF folder's tokenizer files, the tokenizer inside a GGUF file)

Tokens past the target's own vocabulary (an added mask token, a GGUF's padding rows) are not
compared: a tokenizer may extend the target's, within the embedding rows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.data.tokenization import TOKENIZER_FILES
from dflash.target.frozen import TargetError, load_target_config
from dflash.target.gguf import from_pretrained_args, gguf_file
from dflash.util.cli import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

OVERRIDE_FLAG = "--allow-tokenizer-mismatch"
SPECIAL_ROLES = {"eos": "end-of-sequence", "bos": "beginning-of-sequence", "pad": "padding"}


def check_tokenizer_matches_target(tokenizer: PreTrainedTokenizerBase, target: str, tokenizer_path: str,
                                   allow_mismatch: bool = False, warn: bool = True) -> None:
    """Raise a ConfigError naming every failed check, with both values and what to do; with
    `allow_mismatch` (the OVERRIDE_FLAG), log them as a warning instead (when `warn`). A tokenizer
    whose ids exceed the embedding rows is refused whatever the flag: such an id has no row."""
    if _same_gguf(target, tokenizer_path):
        return  # the file's tokenizer and config are one set of metadata
    config, generation = _target_configs(target)
    problems = []
    rows = config.vocab_size
    too_large = len(tokenizer) > rows
    if too_large:
        problems.append(f"size: --tokenizer has {len(tokenizer)} tokens, more than the target's {rows} embedding rows "
                        "(its config's vocab_size)")
    problems += _special_id_problems(tokenizer, config, generation)
    own = None if _same_folder(target, tokenizer_path) else _own_tokenizer(target)
    if own is not None:
        problems += _vocabulary_problems(tokenizer, own)
    if not problems:
        return
    where = f"--tokenizer {tokenizer_path} and --target {target}"
    fix = "pass the target's own tokenizer (leave --tokenizer out to use --target's)"
    if too_large:
        raise ConfigError(f"{where} do not belong together: {'; '.join(problems)}. {fix.capitalize()}; no flag "
                          f"overrides the size check ({OVERRIDE_FLAG} covers only the others)")
    if not allow_mismatch:
        raise ConfigError(f"{where} do not belong together: {'; '.join(problems)}. {fix.capitalize()}, or pass "
                          f"{OVERRIDE_FLAG} if the difference is deliberate")
    if warn:
        logger.warning("%s differ (%s): %s", where, OVERRIDE_FLAG, "; ".join(problems))


def _same_gguf(target: str, tokenizer_path: str) -> bool:
    source = gguf_file(target)
    return source is not None and source == gguf_file(tokenizer_path)


def _same_folder(target: str, tokenizer_path: str) -> bool:
    return Path(target).resolve() == Path(tokenizer_path).resolve()


def _target_configs(target: str):
    """(config, generation config or None) of an HF folder or a GGUF file, read without weights."""
    from transformers import AutoConfig, GenerationConfig

    if gguf_file(target) is None:
        generation_file = Path(target) / "generation_config.json"
        generation = GenerationConfig.from_pretrained(target) if generation_file.is_file() else None
        return load_target_config(target), generation
    name, kwargs = from_pretrained_args(target)  # the GGUF's conversion, or its metadata
    try:
        config = AutoConfig.from_pretrained(name, **kwargs)
    except Exception as err:  # the gguf reader and transformers raise many kinds for a bad file
        raise TargetError(f"--target {target}: cannot read its config from the GGUF metadata "
                          f"({type(err).__name__}: {err})") from err
    return (config.get_text_config() if hasattr(config, "get_text_config") else config), None


def _named_ids(*configs, role: str) -> set[int]:
    """The ids the configs name for `role` (each field an id, a list of ids, or None)."""
    named: set[int] = set()
    for config in configs:
        value = getattr(config, f"{role}_token_id", None) if config is not None else None
        named |= set(value) if isinstance(value, (list, tuple)) else ({value} if value is not None else set())
    return named


def _special_id_problems(tokenizer, config, generation) -> list[str]:
    problems = []
    for role, meaning in SPECIAL_ROLES.items():
        mine = getattr(tokenizer, f"{role}_token_id", None)
        named = _named_ids(config, generation, role=role)
        if mine is not None and named and mine not in named:
            token = tokenizer.convert_ids_to_tokens(mine)
            configs = "config and generation config name" if generation is not None else "config names"
            problems.append(f"special ids: --tokenizer's {meaning} token {token!r} is id {mine}, but the target's "
                            f"{configs} {role}_token_id {sorted(named)}")
    return problems


def _own_tokenizer(target: str):
    """The tokenizer the target ships (a GGUF's, or an HF folder's tokenizer files), or None."""
    from transformers import AutoTokenizer

    name, kwargs = from_pretrained_args(target)
    if not kwargs and not any((Path(name) / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as err:
        raise TargetError(f"--target {target}: cannot load the tokenizer it ships ({err}); its tokenizer files "
                          "are incomplete: copy them again") from err


def _vocabulary_problems(tokenizer, own) -> list[str]:
    mine = {i: token for token, i in tokenizer.get_vocab().items()}
    theirs = {i: token for token, i in own.get_vocab().items()}
    shared = min(len(mine), len(theirs))
    differ = [i for i in range(shared) if mine.get(i) != theirs.get(i)]
    if not differ:
        return []
    first = differ[0]
    return [f"vocabulary: {len(differ)} of the first {shared} ids name other tokens than in the tokenizer the target "
            f"ships (e.g. id {first}: {mine.get(first)!r} in --tokenizer, {theirs.get(first)!r} in the target's)"]
