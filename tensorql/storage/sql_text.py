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
    """``name`` as a DuckDB identifier: double quotes, inner quotes doubled; StorageError for
    a name DuckDB cannot hold (a NUL, a lone surrogate that is no UTF-8).

    >>> quote_ident('a"b')
    '"a""b"'
    """
    if "\x00" in name:
        raise StorageError(f"name {name!r} contains a NUL character")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as err:
        raise StorageError(f"name {name!r} is not valid text: {err.reason} at position "
                           f"{err.start}") from None
    return '"' + name.replace('"', '""') + '"'


def check_tensor_name(name: object) -> str:
    """``name`` when it can name a stored tensor (a non-empty string DuckDB can quote), else
    a StorageError saying why.

    >>> check_tensor_name("weights")
    'weights'
    >>> check_tensor_name("")
    Traceback (most recent call last):
    ...
    tensorql.errors.StorageError: tensor name must be a non-empty string, got ''
    """
    if not isinstance(name, str) or not name:
        raise StorageError(f"tensor name must be a non-empty string, got {name!r:.60}")
    quote_ident(name)
    return name


def ddl(file: str) -> str:
    """The text of ``sql/<file>``; StorageError if the file is missing."""
    path = SQL_DIR / file
    try:
        return path.read_text()
    except OSError as err:
        raise StorageError(f"cannot read DDL file {path}: {err}") from err
