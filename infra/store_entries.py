"""What each entry under an artifact store is, by its name (the layout infra/artifacts.py's docstring
draws): the patterns by which `ArtifactStore.survey` accounts for every entry and `committed` finds
the committed outputs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

KEY_LENGTH = 12  # hex chars of sha256: 48 bits, ample for one project's artifacts
EntryKind = Literal["committed", "partial", "set aside", "download", "lock", "gates", "corpus", "unknown"]


@dataclass(frozen=True)
class Entry:
    """One entry under the store, named for what the layout says it is; for a committed output,
    `problems` (rel path -> what is wrong) keep it from counting."""
    kind: EntryKind
    path: Path
    stage: str = ""
    key: str = ""
    problems: dict[str, str] = field(default_factory=dict)


KEY_PATTERN = rf"(?P<key>[0-9a-f]{{{KEY_LENGTH}}})"
ASIDE = r".+\.corrupt-\d{8}T\d{6}(?:-\d+)?"  # set_aside's names, of anything set aside
# What a name in the folder of stage {s} is: (kind, pattern, whether it is a folder; None: either).
IN_STAGE: tuple[tuple[EntryKind, str, bool | None], ...] = (
    ("committed", r"{s}-{key}", True), ("partial", r"{s}-{key}\.partial", True),
    ("set aside", ASIDE, None), ("download", r"\.{s}-{key}\.download-.+", True),
    ("lock", r"{s}-{key}\.lock", False), ("gates", r"{s}-{key}\.gates\.jsonl", False))
IN_CORPUS: tuple[tuple[EntryKind, str, bool | None], ...] = (
    ("corpus", r"versions\.(jsonl|tmp)", False), ("lock", r"corpus-[\w.-]+\.lock", False), ("set aside", ASIDE, None))


def listing(folder: Path) -> list[Path]:
    """The entries of `folder`, sorted; none when it is not a folder."""
    return sorted(folder.iterdir()) if folder.is_dir() else []


def kind_of(path: Path, names: tuple[tuple[EntryKind, str, bool | None], ...], stage: str) -> tuple[EntryKind, str]:
    """(what the entry `path` is by the first of `names` its name matches, the key it carries)."""
    folder = path.is_dir() and not path.is_symlink()
    for kind, pattern, is_folder in names:
        found = re.fullmatch(pattern.replace("{s}", re.escape(stage)).replace("{key}", KEY_PATTERN), path.name)
        if found and is_folder in (None, folder):
            return kind, found.groupdict().get("key") or ""
    return "unknown", ""
