"""SQL text helpers for the DuckDB store: quoting and the DDL files in ``sql/``.

>>> quote_ident('we"ird; name')
'"we""ird; name"'
"""

from __future__ import annotations

from pathlib import Path

from tensorql.errors import StorageError

# a wheel ships sql/ as tensorql/storage/ddl (pyproject.toml maps it); a checkout reads sql/
_INSTALLED = Path(__file__).resolve().parent / "ddl"
SQL_DIR = _INSTALLED if _INSTALLED.is_dir() else Path(__file__).resolve().parents[2] / "sql"


def quote_ident(name: str) -> str:
    """``name`` as a DuckDB identifier: double quotes, inner quotes doubled."""
    if "\x00" in name:
        raise StorageError(f"name {name!r} contains a NUL character")
    return '"' + name.replace('"', '""') + '"'


def ddl(file: str) -> str:
    """The text of ``sql/<file>``; StorageError if the file is missing."""
    path = SQL_DIR / file
    try:
        return path.read_text()
    except OSError as err:
        raise StorageError(f"cannot read DDL file {path}: {err}") from err
