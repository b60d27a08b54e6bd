"""ProfileDB: measured times kept on disk so that a second plan of the same model measures nothing.

One JSON file (default ``~/.cache/autopar/profile.json``; ``AUTOPAR_CACHE_DIR`` moves the
directory) holds records grouped by *machine key* (the device name, e.g. "cpu AMD EPYC x1
thread" or "NVIDIA H100 80GB HBM3", and the torch version, since kernels change between
releases) and by section:

    {"format": 1,
     "machines": {"<device> | torch <version>": {
         "ops":    {"<op signature>": {"fwd_seconds": ..., "bwd_seconds": ..., "repeats": ...}},
         "device": {"<curve name>": {...}},
         "links":  {"<backend> x<ranks>": {...}}}}}

Every measured number carries its unit in its field name (``_seconds``, ``_bytes``,
``_flops_per_second``). The "device" and "links" records carry the conditions they were measured
under (``"conditions"``: other processes' load, the spread of repeats; autopar/conditions.py). Writes go to a temporary file that replaces the old one, so a crash
never leaves half a file; a corrupt or foreign file is reported, never silently dropped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import ConfigError
from ..files import write_atomic

FORMAT = 1
SECTIONS = ("ops", "device", "links")


def default_path() -> Path:
    """``$AUTOPAR_CACHE_DIR/profile.json``, else ``~/.cache/autopar/profile.json``."""
    base = os.environ.get("AUTOPAR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "autopar")
    return Path(base) / "profile.json"


def machine_key(device_name: str) -> str:
    """The key records of this device under this torch version live under."""
    return f"{device_name} | torch {torch.__version__}"


class ProfileDB:
    """Measured records by (device, torch version, section, key); ``save()`` writes them back."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        self._data: dict[str, Any] = {"format": FORMAT, "machines": {}}
        self._dirty = False
        if self.path.exists():
            self._data = self._read()

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"profile database {self.path} cannot be read ({exc}): delete it to profile "
                              "again, or pass another path") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("machines"), dict):
            raise ConfigError(f"{self.path} is not an autopar profile database of format {FORMAT}: delete it "
                              "to profile again, or pass another path")
        return data

    def _section(self, device_name: str, section: str, create: bool) -> dict[str, Any] | None:
        if section not in SECTIONS:
            raise ConfigError(f"unknown profile section {section!r}; known: {list(SECTIONS)}")
        machines = self._data["machines"]
        key = machine_key(device_name)
        if key not in machines:
            if not create:
                return None
            machines[key] = {}
        return machines[key].setdefault(section, {}) if create else machines[key].get(section)

    def get(self, device_name: str, section: str, key: str) -> dict[str, Any] | None:
        """The record saved under ``key``, or None."""
        records = self._section(device_name, section, create=False)
        return None if records is None else records.get(key)

    def put(self, device_name: str, section: str, key: str, record: Mapping[str, Any]) -> None:
        """Keep ``record`` (JSON-serialisable) under ``key``; written by :meth:`save`."""
        self._section(device_name, section, create=True)[key] = dict(record)
        self._dirty = True

    def count(self, device_name: str, section: str) -> int:
        records = self._section(device_name, section, create=False)
        return 0 if records is None else len(records)

    def save(self) -> None:
        """Write the database if anything changed (atomically: a temporary file renamed over it)."""
        if not self._dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(self._data, indent=1, sort_keys=True))
        self._dirty = False
