"""Sample seeding: the bundled user guide goes into the shared document library once per data
dir, so a new user can ask about llmweb at once.

It must not index anything else, nor index the guide twice (a marker file remembers it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from llmweb.config import SAMPLE_DIR, Settings

log = logging.getLogger(__name__)

SAMPLE_MARKER = ".sample-seeded-shared"  # in data_dir/index: the bundled guide is in the shared library


def seed_sample(settings: Settings, library, progress: Callable[[str], None]) -> None:
    """Index the bundled user guide into the shared library, once. (The previous version's marker,
    ".sample-seeded", marked the guide in the old "docs" index, which `Library` moves to the local
    owner's private library.)"""
    marker = settings.data_dir / "index" / SAMPLE_MARKER
    if marker.exists() or not SAMPLE_DIR.is_dir():
        return
    progress("Indexing the sample user guide…")
    for r in library.ingest_shared([SAMPLE_DIR]):
        if not r.ok:
            log.warning("sample corpus: %s", r.describe())
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("indexed into the shared library\n")
