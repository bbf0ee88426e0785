"""A GGUF file as the target: de-quantized once into a cached HF folder that every loader reads.

`--target` (and `--tokenizer`) take a `.gguf` file, or a folder holding exactly one `.gguf` and
no config.json. transformers reads the file (with the `gguf` package) and de-quantizes it to
floats; `resolve_target` saves that as an ordinary HF folder (config.json, model.safetensors,
generation_config.json, tokenizer files), so FrozenTarget, split mode's embedding reader and
vLLM take it unchanged. The folder records the GGUF's size and modification time: a changed
file is converted again, an unchanged one never; a training run's own folder hard-links the
files of the tools' folder when that one is complete. A conversion is built in a hidden staging
folder and renamed into place when complete, so a killed one is never reused.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dflash.target.frozen import TargetError
from dflash.util.files import replace_dir, staging_dir, storage_error

logger = logging.getLogger(__name__)

SOURCE_RECORD = "gguf_source.json"  # in a complete conversion: which GGUF it came from
# Small models are saved in float32: the de-quantized values stay exact and the disk cost is small
# (SmolLM2-135M: 0.5 GB). From 1B parameters on, bfloat16 halves the disk and the load (8B: 16 GB,
# not 32); training computes in bf16 on a GPU anyway, and the float32 lossless check compares two
# decodings of the same weights, which bf16 storage does not change.
FLOAT32_BELOW_PARAMS = 1_000_000_000


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: itself, or the single `.gguf` in a folder without a config.json;
    None for anything else (an HF folder, a missing path). A folder with several is an error."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise TargetError(f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); pass the "
                          "path of the one to use")
    return found[0] if found else None


def is_model_path(path: str | Path) -> bool:
    """A folder (an HF model or tokenizer, or one holding a GGUF), or a `.gguf` file."""
    return Path(path).is_dir() or gguf_file(path) is not None


def from_pretrained_args(path: str | Path) -> tuple[str, dict]:
    """(name_or_path, kwargs) for a transformers `from_pretrained` of a tokenizer or config at
    `path`: a GGUF's complete conversion when there is one (the same files: Qwen2.5-Coder-0.5B's
    tokenizer loads in 0.5 s from it, 10 s from the file on a 2-core VM), else the GGUF through
    `gguf_file=` (metadata, read without de-quantizing anything)."""
    source = gguf_file(path)
    if source is None:
        return str(path), {}
    converted = default_cache_dir(source)
    if _is_conversion_of(converted, source):
        return str(converted), {}
    require_gguf_package(source)
    return str(source.parent), {"gguf_file": source.name}


def require_gguf_package(source: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise TargetError(f"{source}: reading a GGUF file needs the `gguf` package, which transformers' GGUF "
                          "loader uses; pip install gguf (or pip install -r requirements-real.txt)")


def default_cache_dir(source: Path) -> Path:
    """`<file>.hf` beside the GGUF when that folder is writable (or already holds the conversion),
    else one under ~/.cache/dflash/ named after the file and a hash of its absolute path."""
    beside = source.with_name(source.name + ".hf")
    if os.access(source.parent, os.W_OK) or _is_conversion_of(beside, source):
        return beside
    digest = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "dflash" / f"{source.stem}-{digest}.hf"


def run_target_dir(output_dir: str | Path) -> Path:
    """Where a training run (and `python -m dflash.tools.data prepare` ahead of it) keeps its GGUF
    target's conversion: beside the run, reused by its resumes and by later runs there."""
    return Path(output_dir) / "target-hf"


def resolve_target(path: str | Path, cache_dir: str | Path | None = None) -> str:
    """An HF folder for `path`: `path` itself unless it names a GGUF; a GGUF's de-quantized copy in
    `cache_dir` (default: `default_cache_dir`), made on the first call (hard links to a complete
    conversion in the default folder, else a conversion) and reused after."""
    source = gguf_file(path)
    if source is None:
        return str(path)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(source)
    if _is_conversion_of(cache, source):
        return str(cache)
    shared = default_cache_dir(source)
    if shared != cache and _is_conversion_of(shared, source):
        # a run's own folder, while the tools' conversion (regenerate, eval) is already made
        try:
            _stage(cache, lambda staging: _link_files(shared, staging), f"linked {shared} into {cache}")
        except TargetError as err:  # e.g. the shared one was replaced meanwhile: convert instead
            logger.warning("could not reuse %s (%s); de-quantizing %s again", shared, err, source.name)
    if not _is_conversion_of(cache, source):  # also where the shared one changed while being linked
        require_gguf_package(source)
        _convert(source, cache)
    return str(cache)


def _source_record(source: Path) -> dict:
    stat = source.stat()
    return {"gguf": str(source.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _is_conversion_of(cache: Path, source: Path) -> bool:
    try:
        return json.loads((cache / SOURCE_RECORD).read_text()) == _source_record(source)
    except (OSError, ValueError):
        return False


def _convert(source: Path, cache: Path) -> None:
    logger.info("de-quantizing %s into %s (once: later runs reuse it while the file is unchanged)", source, cache)

    def save(staging: Path) -> None:
        model, tokenizer = _load_dequantized(source)
        logger.info("%s: %s weights", source.name, model.dtype)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / SOURCE_RECORD).write_text(json.dumps(_source_record(source)) + "\n")

    _stage(cache, save, f"de-quantized {source.name}")


def _link_files(folder: Path, staging: Path) -> None:
    """Hard links to `folder`'s files (safe: a conversion is replaced by a rename, never rewritten
    in place), or copies where the two folders are on different filesystems."""
    for file in folder.iterdir():
        try:
            os.link(file, staging / file.name)
        except OSError:
            shutil.copy2(file, staging / file.name)


def _stage(cache: Path, fill, done: str) -> None:
    """Build `cache` by fill(staging) in a staging folder, then rename it into place (replacing a
    stale one), so a killed build is never reused."""
    started = time.perf_counter()
    try:
        staging = staging_dir(cache)
    except OSError as err:
        raise TargetError(str(storage_error(err, cache, "the GGUF file is untouched"))) from err
    try:
        fill(staging)
        _make_readable_like(staging)
        replace_dir(staging, cache)
    except OSError as err:
        raise TargetError(str(storage_error(err, cache, "the GGUF file is untouched"))) from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful rename
    logger.info("%s in %.1f s", done, time.perf_counter() - started)


def _make_readable_like(folder: Path) -> None:
    """Give the files the folder's read bits (staging_dir: 0755 less umask): safetensors writes
    0600, and a conversion beside a shared GGUF is read by other users too."""
    mode = folder.stat().st_mode & 0o666
    for file in folder.iterdir():
        file.chmod(mode)


@contextmanager
def _one_reader_per_file() -> Iterator[None]:
    """Inside, gguf.GGUFReader gives one reader per file: transformers reads a GGUF for the config
    (twice), the tokenizer and the tensors, and each new reader parses every metadata field again
    (Qwen2.5's 151,936 token strings, one numpy view at a time): sharing one took the 0.5B's
    conversion from 54.5 to 32.0 s on a 2-core VM. A reader only reads its memory-mapped file."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared(path, *args, **kwargs):
        key = (str(Path(path).resolve()), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _load_dequantized(source: Path):
    """(model, tokenizer) read from the GGUF, the model as a plain float HF model that can be saved."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, kwargs = str(source.parent), {"gguf_file": source.name}
    try:
        with _one_reader_per_file():
            config = AutoConfig.from_pretrained(folder, **kwargs)
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
            dtype = torch.float32 if skeleton.num_parameters() < FLOAT32_BELOW_PARAMS else torch.bfloat16
            loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as err:  # the gguf reader and transformers raise many kinds for a bad file
        raise TargetError(f"--target {source}: cannot read it as a GGUF causal LM ({type(err).__name__}: {err}); "
                          "the file is truncated or corrupt (copy it again), or transformers cannot read its "
                          "architecture from GGUF") from err
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; its weights are
    # plain floats already, so they move (no copy) into a model built from the same config less
    # the quantization entry.
    del loaded.config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(loaded.config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.generation_config = loaded.generation_config
    return model, tokenizer
