"""Text filters for prompts, shared by the prompt builders: mostly-ASCII text, requests that
look like code, and exact and near-duplicates.

Near-duplicates: two prompts are near-duplicates when the Jaccard similarity of their character
5-gram sets, after normalise(), reaches a threshold. It is estimated with MinHash (128 values
per prompt) and found through locality-sensitive hashing: the 128 values form 32 bands of 4, and
prompts that agree on a whole band share its bucket, so a new prompt is compared only with the
prompts of its 32 buckets. At a similarity of 0.6 two prompts share a bucket with probability
0.99, at 0.3 with 0.23, and a bucket keeps at most BUCKET_CAP prompts, so one check costs O(1)
and N prompts O(N).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash.data.chat_formats import DataError, load_chat_jsonl

MIN_ASCII_SHARE = 0.8
NGRAM = 5  # characters per shingle
PERMUTATIONS = 128  # MinHash values per prompt
ROWS_PER_BAND = 4  # 32 bands
BUCKET_CAP = 64  # prompts kept per LSH bucket (a bucket this full is a family of similar prompts)

NON_WORD = re.compile(r"[\W_]+")

# looks_like_code: a fenced block or a line of code syntax; or a language, tool or format that
# only programming talks of; or two different words of programming vocabulary ("a class at
# school" is one word, "a function that sorts an array" is two; names that are also common
# words, such as pandas, react or rust, count as vocabulary).
CODE_SYNTAX = re.compile(  # case-sensitive: "Select the best option from ..." and "Import duties" are prose
    r"```|^\s*(def |class \w+[:(]|import \w|from [\w.]+ import|#include|public (static |class |void )|"
    r"function \w*\(|(const|let|var) \w+ =|for \(|while \()|[;{]\s*$|=>|</?[a-z]+[ >]|\bSELECT .+ FROM |"
    r"\w+\([^()\n]*\)\s*[:{]", re.MULTILINE)
CODE_NAMES = re.compile(
    r"(?<![\w.])(python|javascript|typescript|java|kotlin|golang|c\+\+|c#|php|perl|scala|haskell|elixir|"
    r"sql|mysql|postgres(ql)?|sqlite|mongodb|bash|powershell|html|css|reactjs|vue\.?js|node\.?js|django|flask|"
    r"fastapi|spring boot|numpy|pytorch|tensorflow|matlab|regex|json|yaml|xml|docker|kubernetes|git|github|"
    r"linux|api|sdk|cli|npm|jupyter|leetcode)(?![\w+#])", re.IGNORECASE)
CODE_WORDS = re.compile(
    r"\b(code|coding|program|programming|programmer|function|functions|method|class|classes|script|algorithm|"
    r"array|loop|recursion|recursive|compile|compiler|debug|debugging|bug|exception|variable|database|query|"
    r"implement|implementation|refactor|unit tests?|library|framework|syntax|string|integer|data structure|"
    r"binary tree|linked list|hash map|runtime|complexity|parse|parser|server|backend|frontend|endpoint|"
    r"react|pandas|angular|rust|ruby|swift)\b",
    re.IGNORECASE)


def mostly_ascii(text: str, share: float = MIN_ASCII_SHARE) -> bool:
    """At least `share` of the characters are ASCII: text in other scripts, which an English
    target answers poorly, is left out."""
    return len(text.encode("ascii", "ignore")) >= share * len(text)


def looks_like_code(text: str) -> bool:
    """A request for code or about code, by a cheap heuristic (CODE_SYNTAX, CODE_NAMES, CODE_WORDS)."""
    if CODE_SYNTAX.search(text) or CODE_NAMES.search(text):
        return True
    return len({word.lower() for word in CODE_WORDS.findall(text)}) >= 2


def normalise(text: str) -> str:
    """Case-folded, NFKC, every run of non-word characters one space: prompts that differ only in
    case, punctuation or spacing normalise to the same text (an exact duplicate)."""
    return NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


_POWERS = np.uint64(1_000_003) ** np.arange(NGRAM, dtype=np.uint64)  # wraps mod 2^64: a hash
_SEEDS = np.random.default_rng(20_240_601).integers(1, 2**63, size=(2, PERMUTATIONS), dtype=np.uint64)
_MULTIPLIERS, _OFFSETS = _SEEDS[0] | np.uint64(1), _SEEDS[1]
_BAND_POWERS = np.uint64(0x100000001B3) ** np.arange(ROWS_PER_BAND, dtype=np.uint64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every bit of a shingle's hash reaches every bit of the result."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def minhash(normalised: str) -> np.ndarray:
    """The MinHash signature [PERMUTATIONS] uint64 of a normalised text's character 5-grams (a
    text shorter than 5 characters is one shingle)."""
    data = np.frombuffer(normalised.encode("utf-8"), dtype=np.uint8).astype(np.uint64)
    if len(data) < NGRAM:
        data = np.concatenate([data, np.zeros(NGRAM - len(data), dtype=np.uint64)])
    shingles = _mix(np.unique(np.lib.stride_tricks.sliding_window_view(data, NGRAM) @ _POWERS))
    return (np.multiply.outer(_MULTIPLIERS, shingles) + _OFFSETS[:, None]).min(axis=1)


@dataclass(frozen=True)
class Fingerprint:
    digest: bytes  # of the normalised text: exact duplicates
    signature: np.ndarray  # MinHash: near-duplicates
    bands: list[int]  # the LSH bucket of each band

    @staticmethod
    def of(text: str) -> "Fingerprint":
        normalised = normalise(text)
        signature = minhash(normalised)
        bands = (signature.reshape(-1, ROWS_PER_BAND) @ _BAND_POWERS).tolist()
        return Fingerprint(hashlib.blake2b(normalised.encode("utf-8"), digest_size=16).digest(), signature, bands)


@dataclass(frozen=True)
class Match:
    index: int  # the earlier prompt's index (the order of NearDuplicates.add)
    exact: bool  # the same text after normalise(); else a near-duplicate


class NearDuplicates:
    """The prompts added so far, and which of them a new prompt repeats."""

    def __init__(self, threshold: float) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"near-duplicate threshold {threshold}: use a similarity in (0, 1]")
        self.threshold = threshold
        self._exact: dict[bytes, int] = {}
        self._buckets: list[dict[int, list[int]]] = [{} for _ in range(PERMUTATIONS // ROWS_PER_BAND)]
        self._signatures = np.empty((1024, PERMUTATIONS), dtype=np.uint64)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def match(self, fingerprint: Fingerprint) -> Match | None:
        """The first added prompt that `fingerprint`'s text repeats: exactly, else the most similar
        candidate whose estimated similarity reaches the threshold; None when it repeats none."""
        if fingerprint.digest in self._exact:
            return Match(self._exact[fingerprint.digest], exact=True)
        candidates = {i for bucket, key in zip(self._buckets, fingerprint.bands) for i in bucket.get(key, ())}
        if not candidates:
            return None
        indices = np.fromiter(candidates, dtype=np.int64, count=len(candidates))
        similarity = (self._signatures[indices] == fingerprint.signature).mean(axis=1)
        best = int(similarity.argmax())
        return Match(int(indices[best]), exact=False) if similarity[best] >= self.threshold else None

    def add(self, fingerprint: Fingerprint) -> int:
        """Index `fingerprint`'s prompt; returns its index (0, 1, ... in the order added)."""
        index = self._count
        if index == len(self._signatures):
            self._signatures = np.concatenate([self._signatures, np.empty_like(self._signatures)])
        self._signatures[index] = fingerprint.signature
        self._exact.setdefault(fingerprint.digest, index)
        for bucket, key in zip(self._buckets, fingerprint.bands):
            members = bucket.setdefault(key, [])
            if len(members) < BUCKET_CAP:
                members.append(index)
        self._count += 1
        return index


def heldout_index(paths: list[str], threshold: float) -> NearDuplicates:
    """The user turns of the chat JSONL files `paths` (--heldout), indexed: a prompt that matches
    one repeats a held-out turn, exactly or as a near-duplicate at `threshold`."""
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"--heldout {path}: no such file; pass a chat JSONL file")
    if not 0 < threshold <= 1:
        raise DataError(f"--near-dup {threshold}: use a similarity in (0, 1]")
    index = NearDuplicates(threshold)
    for text in user_turns(paths):
        index.add(Fingerprint.of(text))
    return index


def user_turns(paths: list[str]) -> list[str]:
    """The text of every user turn of the chat JSONL files (held-out conversations: no prompt
    built for training may repeat one of them)."""
    return [m["content"] for path in paths for messages in load_chat_jsonl(Path(path), require_reply=False)
            for m in messages if m["role"] == "user"]
