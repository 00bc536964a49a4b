"""The tensorql SQL dialect: DuckDB's, plus ``EINSUM``, ``CREATE/DROP TENSOR`` and ``EXPLAIN``.

Parsing is sqlglot's DuckDB parser with a few additions, never a hand-written parser:

- ``EINSUM('spec', operand, ... [, join := '...'] [, agg := '...'])`` parses as
  :class:`Einsum` (a table function in ``FROM``); ``join := (a, b) -> a * exp(b)`` holds a
  DuckDB lambda (``exp.Lambda``);
- ``CREATE [OR REPLACE] TENSOR name AS <query>`` as :class:`CreateTensor`,
  ``DROP TENSOR [IF EXISTS] name`` as :class:`DropTensor`;
- ``EXPLAIN [ANALYZE] <statement>`` as :class:`Explain` (sqlglot's DuckDB dialect keeps it as
  an opaque command).

:func:`parse_script` splits a script on ``;`` and keeps each statement's text and offset, so
that statements without EINSUM go to DuckDB verbatim and errors point into the script.

>>> [type(s.expression).__name__ for s in parse_script(
...     "CREATE TENSOR C AS SELECT * FROM EINSUM('ij,jk->ik', A, B); DROP TENSOR C")]
['CreateTensor', 'DropTensor']
>>> parse_script("SELECT * FROM EINSUM('ij->j', A, agg := 'max')")[0].expression.sql(TensorQL)
"SELECT * FROM EINSUM('ij->j', A, agg := 'max')"
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import sqlglot
from sqlglot import exp
from sqlglot.dialects.duckdb import DuckDB
from sqlglot.errors import ParseError as SqlglotParseError
from sqlglot.errors import TokenError
from sqlglot.tokens import Token, TokenType

from tensorql.errors import ParseError

__all__ = [
    "CreateTensor", "DropTensor", "Einsum", "Explain", "Statement", "TensorQL", "has_einsum",
    "parse_script", "position_of", "split_script",
]


class Einsum(exp.Expression, exp.Func):
    """``EINSUM('spec', operands..., name := value ...)``: ``this`` is the spec literal,
    ``expressions`` the operands and named arguments (``PropertyEQ``) in written order."""

    arg_types = {"this": True, "expressions": False}
    is_var_len_args = True
    _sql_names = ["EINSUM"]


class CreateTensor(exp.Expression):
    """``CREATE [OR REPLACE] TENSOR this AS expression``."""

    arg_types = {"this": True, "expression": True, "replace": False}


class DropTensor(exp.Expression):
    """``DROP TENSOR [IF EXISTS] this``."""

    arg_types = {"this": True, "exists": False}


class Explain(exp.Expression):
    """``EXPLAIN [ANALYZE] this``."""

    arg_types = {"this": True, "analyze": False}


def _build_einsum(args: list[exp.Expr]) -> Einsum:
    if not args:
        return Einsum(this=exp.Null())
    return Einsum(this=args[0], expressions=args[1:])


class _Parser(DuckDB.Parser):
    FUNCTIONS = {**DuckDB.Parser.FUNCTIONS, "EINSUM": _build_einsum}

    def _parse_function_args(self, alias: bool = False) -> list[exp.Expr]:
        # every argument remembers where it starts (errors about an operand point at it)
        def argument() -> exp.Expr | None:
            token = self._curr
            arg = self._parse_named_lambda() or self._parse_lambda(alias=alias)
            if arg is not None and token is not None:
                arg.meta["arg_start"] = token.start
            return arg

        return self._parse_csv(argument)

    def _parse_named_lambda(self) -> exp.Expr | None:
        """``name := (a, b) -> body`` (or ``=>``, or one parameter ``a -> body``, or DuckDB's
        newer ``lambda a, b: body``) as a named argument holding a Lambda; DuckDB's parser
        would read the right side as a JSON arrow over a tuple. None (nothing consumed) for
        any other argument."""
        tokens, i = self._tokens, self._index
        if i + 3 >= len(tokens) or tokens[i + 1].token_type not in (TokenType.COLON_EQ,
                                                                     TokenType.FARROW):
            return None
        if tokens[i + 2].text.upper() == "LAMBDA":  # DuckDB's own: lambda a, b: body
            name = exp.Identifier(this=self._curr.text, quoted=False)
            self._advance(2)
            value = self._parse_lambda()
            if not isinstance(value, exp.Lambda):
                self._retreat(i)
                return None
            return self.expression(exp.PropertyEQ(this=name, expression=value))
        j = i + 2
        if tokens[j].token_type == TokenType.L_PAREN:  # a parenthesised parameter list
            j += 1
            while j < len(tokens) and tokens[j].token_type not in (TokenType.R_PAREN,
                                                                   TokenType.L_PAREN):
                j += 1
        j += 1
        if j >= len(tokens) or tokens[j].token_type != TokenType.ARROW:
            return None
        name = exp.Identifier(this=self._curr.text, quoted=False)
        self._advance(2)
        value = self._parse_lambda()
        return self.expression(exp.PropertyEQ(this=name, expression=value))

    def _parse_statement(self) -> exp.Expr | None:
        if self._curr and self._curr.token_type == TokenType.VAR \
                and self._curr.text.upper() == "EXPLAIN":
            self._advance()
            analyze = self._match(TokenType.ANALYZE)
            inner = super()._parse_statement()
            if inner is None:
                self.raise_error("EXPLAIN needs a statement")
            return self.expression(Explain(this=inner, analyze=bool(analyze)))
        return super()._parse_statement()

    def _parse_create(self) -> exp.Expr:
        start = self._index
        replace = self._match_pair(TokenType.OR, TokenType.REPLACE)
        if self._match_text_seq("TENSOR"):
            name = self._parse_id_var(any_token=False)
            if name is None:
                self.raise_error("CREATE TENSOR needs a tensor name")
            self._match(TokenType.ALIAS) or self.raise_error("Expecting AS")
            query = self._parse_select(nested=True)
            if query is None:
                self.raise_error("CREATE TENSOR ... AS needs a query")
            return self.expression(CreateTensor(this=name, expression=query,
                                                replace=bool(replace)))
        self._retreat(start)
        return super()._parse_create()

    def _parse_drop(self, exists: bool = False, kind: str | None = None) -> exp.Expr:
        start = self._index
        if kind is None and self._match_text_seq("TENSOR"):
            if_exists = self._match_text_seq("IF", "EXISTS")
            name = self._parse_id_var(any_token=False)
            if name is None:
                self.raise_error("DROP TENSOR needs a tensor name")
            return self.expression(DropTensor(this=name, exists=bool(if_exists)))
        self._retreat(start)
        return super()._parse_drop(exists=exists, kind=kind)


class _Tokenizer(DuckDB.Tokenizer):
    # without '?::' (Databricks' try-cast token, not DuckDB's): '?::DOUBLE' is a placeholder
    # and a cast, as DuckDB reads it
    KEYWORDS = {**{k: v for k, v in DuckDB.Tokenizer.KEYWORDS.items() if k != "?::"},
                "EXPLAIN": TokenType.VAR}


def _einsum_sql(gen, e: Einsum) -> str:
    return gen.func("EINSUM", e.this, *e.expressions)


def _create_tensor_sql(gen, e: CreateTensor) -> str:
    replace = "OR REPLACE " if e.args.get("replace") else ""
    return f"CREATE {replace}TENSOR {gen.sql(e, 'this')} AS {gen.sql(e, 'expression')}"


def _drop_tensor_sql(gen, e: DropTensor) -> str:
    exists = "IF EXISTS " if e.args.get("exists") else ""
    return f"DROP TENSOR {exists}{gen.sql(e, 'this')}"


def _explain_sql(gen, e: Explain) -> str:
    return f"EXPLAIN {'ANALYZE ' if e.args.get('analyze') else ''}{gen.sql(e, 'this')}"


class _Generator(DuckDB.Generator):
    TRANSFORMS = {
        **DuckDB.Generator.TRANSFORMS,
        Einsum: _einsum_sql,
        CreateTensor: _create_tensor_sql,
        DropTensor: _drop_tensor_sql,
        Explain: _explain_sql,
    }


class TensorQL(DuckDB):
    """DuckDB's dialect plus EINSUM, CREATE/DROP TENSOR and EXPLAIN [ANALYZE].

    >>> import sqlglot
    >>> sqlglot.parse_one("EXPLAIN ANALYZE SELECT 1", read=TensorQL).args["analyze"]
    True
    """

    Parser = _Parser
    Tokenizer = _Tokenizer
    Generator = _Generator


@dataclass(frozen=True)
class Statement:
    """One statement of a script: its parsed form, its own text and where that text starts.
    From :func:`split_script`, a statement without EINSUM or tensorql DDL is not parsed:
    ``expression`` is None and DuckDB runs ``text`` as written (``explain``: it is an
    EXPLAIN, whose plan comes back as text; ``created``: the name -- its parts, qualifiers
    first -- and offset of the table or view a ``CREATE`` makes or an ``ALTER ... RENAME TO``
    renames to; ``altered``: those a ``DROP`` or ``ALTER`` of a table or view names; all of
    these seen through an ``EXPLAIN [ANALYZE]`` head, which runs the statement under ANALYZE).
    ``transaction`` and ``written`` (see :func:`_transaction`, :func:`_written`) are found
    for every statement, parsed or not, from its tokens -- comments are none.

    >>> s = parse_script("SELECT 1;  SELECT 2")[1]
    >>> s.text, s.offset
    ('SELECT 2', 11)
    """

    expression: exp.Expr | None
    text: str
    offset: int
    script: str
    explain: bool = False
    created: tuple[tuple[str, ...], int] | None = None
    altered: tuple[tuple[tuple[str, ...], int], ...] = ()
    transaction: str | None = None  # "begin" (BEGIN, START TRANSACTION) or "end" (COMMIT, ...)
    written: tuple[tuple[tuple[str, ...], int], ...] = ()  # see _written


_MISSING = re.compile(r"Required keyword: '(\w+)' missing for <class '[\w.]*\.(\w+)'>")


def _plain(message: str) -> str:
    """sqlglot's message with its class names said in SQL's words (a lambda without
    parameters, ...).

    >>> _plain("Required keyword: 'expressions' missing for "
    ...        "<class 'sqlglot.expressions.query.Lambda'>")
    'a lambda needs its parameters, as in (a, b) -> a * b'
    >>> _plain("Expecting )")
    'Expecting )'
    """
    def said(m: re.Match[str]) -> str:
        if m[2] == "Lambda":
            return "a lambda needs its parameters, as in (a, b) -> a * b"
        return f"{m[2]} needs its {m[1]}"

    return _MISSING.sub(said, message)


def _parse_error(err: Exception, script: str, offset: int) -> ParseError:
    errors = getattr(err, "errors", None) or []
    if errors:
        first = errors[0]
        line, col = first.get("line"), first.get("col")
        highlight = first.get("highlight") or ""
        message = _plain(first.get("description") or str(err))
        if line is not None and col is not None:
            # sqlglot reports the column where the offending token ends; point at its start
            piece = script[offset:]
            lines = piece.split("\n")
            start = sum(len(x) + 1 for x in lines[: line - 1]) + max(0, col - len(highlight))
            return ParseError(f"SQL syntax error: {message}", text=script,
                              position=min(offset + start, len(script)))
    return ParseError(f"SQL syntax error: {err}", text=script, position=offset)


def _split(script: str) -> list[tuple[str, int]]:
    """Statement texts and offsets, split at top-level ``;`` tokens (strings and comments are
    the tokenizer's business, so a ``;`` inside them does not split)."""
    try:
        tokens: list[Token] = TensorQL().tokenize(script)
    except TokenError as err:
        raise ParseError(f"SQL syntax error: {err}", text=script, position=0) from None
    return [(text, offset) for text, offset, _ in _pieces(script, tokens)]


def _pieces(script: str, tokens: list[Token]) -> list[tuple[str, int, list[Token]]]:
    """Each statement's text, offset and tokens (their positions are the script's)."""
    pieces: list[tuple[str, int, list[Token]]] = []
    start, mine = 0, []
    for tok in tokens:
        if tok.token_type == TokenType.SEMICOLON:
            pieces.append((script[start:tok.start], start, mine))
            start, mine = tok.end + 1, []
        else:
            mine.append(tok)
    pieces.append((script[start:], start, mine))
    out = []
    for text, offset, mine in pieces:
        stripped = text.lstrip()
        offset += len(text) - len(stripped)
        text = stripped.rstrip()
        if text:
            out.append((text, offset, mine))
    return out


# EINSUM calls may nest this deep inside one another (deeper: name the inner ones in WITH),
# and a statement tensorql parses may nest parentheses this deep (sqlglot's parser recurses)
MAX_EINSUM_NESTING = 16
MAX_PAREN_NESTING = 64


def _is_einsum(tokens: list[Token], k: int) -> bool:
    tok = tokens[k]
    return tok.token_type == TokenType.VAR and tok.text.upper() == "EINSUM" \
        and k + 1 < len(tokens) and tokens[k + 1].token_type == TokenType.L_PAREN


def _is_text(tok: Token | None, *words: str) -> bool:
    return tok is not None and tok.token_type != TokenType.IDENTIFIER \
        and tok.text.upper() in words


def _needs_tensorql(tokens: list[Token]) -> tuple[bool, bool]:
    """``(tensorql's, an EXPLAIN)``: whether the statement uses EINSUM (an unquoted
    ``EINSUM(``; strings and comments are tokens of their own or none) or is ``CREATE
    TENSOR`` / ``DROP TENSOR`` (after an optional ``EXPLAIN [ANALYZE]``).

    >>> _needs_tensorql(TensorQL().tokenize("SELECT 'EINSUM(' -- EINSUM(A)"))
    (False, False)
    >>> _needs_tensorql(TensorQL().tokenize("EXPLAIN SELECT * FROM einsum('i', A)"))
    (True, True)
    """
    at = 0
    explain = _is_text(tokens[0] if tokens else None, "EXPLAIN")
    if explain:
        at = 1 + (len(tokens) > 1 and tokens[1].token_type == TokenType.ANALYZE)
    head = tokens[at:at + 4]
    ddl = bool(head) and (
        (head[0].token_type == TokenType.CREATE and (
            _is_text(head[1] if len(head) > 1 else None, "TENSOR")
            or (len(head) > 3 and head[1].token_type == TokenType.OR
                and _is_text(head[3], "TENSOR"))))
        or (head[0].token_type == TokenType.DROP
            and _is_text(head[1] if len(head) > 1 else None, "TENSOR")))
    return ddl or any(_is_einsum(tokens, k) for k in range(len(tokens))), explain


def _check_nesting(tokens: list[Token], script: str) -> None:
    """ParseError past :data:`MAX_EINSUM_NESTING` EINSUM calls inside one another or
    :data:`MAX_PAREN_NESTING` parentheses, before sqlglot's recursive parser sees them (one
    walk: the EINSUM error names the deepest nesting and points at the first call too deep)."""
    depth, deepest, calls = 0, (0, 0), []  # calls: paren depth inside each open EINSUM
    einsum_deepest, too_deep_at = 0, None
    for k, tok in enumerate(tokens):
        if tok.token_type == TokenType.L_PAREN:
            depth += 1
            if depth > deepest[0]:
                deepest = (depth, tok.start)
        elif tok.token_type == TokenType.R_PAREN:
            depth -= 1
            while calls and calls[-1] > depth:
                calls.pop()
        elif _is_einsum(tokens, k):
            calls.append(depth + 1)
            einsum_deepest = max(einsum_deepest, len(calls))
            if len(calls) > MAX_EINSUM_NESTING and too_deep_at is None:
                too_deep_at = tok.start
    if too_deep_at is not None:
        raise ParseError(
            f"EINSUM calls nest {einsum_deepest} deep, more than the {MAX_EINSUM_NESTING} "
            "tensorql takes: name the inner calls with WITH (a CTE each), e.g. "
            "WITH t1 AS (SELECT * FROM EINSUM(...)) SELECT * FROM EINSUM('...', t1)",
            text=script, position=too_deep_at)
    if deepest[0] > MAX_PAREN_NESTING:
        raise ParseError(
            f"parentheses nest {deepest[0]} deep in a statement with EINSUM, more than the "
            f"{MAX_PAREN_NESTING} tensorql parses: name inner queries with WITH (CTEs)",
            text=script, position=deepest[1])


def _check_empty_arguments(tokens: list[Token], script: str) -> None:
    """ParseError at a ``,`` right after ``(`` or another ``,`` -- an empty argument, which
    DuckDB refuses and sqlglot's parser would silently drop (``EINSUM('ij->i',, A)``).

    >>> try:
    ...     _check_empty_arguments(TensorQL().tokenize("SELECT f(1,, 2)"), "SELECT f(1,, 2)")
    ... except ParseError as err:
    ...     print(err.position)
    11
    """
    for before, tok in zip(tokens, tokens[1:]):
        if tok.token_type == TokenType.COMMA and before.token_type in (TokenType.COMMA,
                                                                       TokenType.L_PAREN):
            raise ParseError("an empty argument (two commas, or a comma after '(')",
                             text=script, position=tok.start)


def _created(tokens: list[Token]) -> tuple[tuple[str, ...], int] | None:
    """The name (its parts, qualifiers first) and offset of the table or view a ``CREATE [OR
    REPLACE] [TEMP] TABLE|VIEW [IF NOT EXISTS] name`` statement makes.

    >>> _created(TensorQL().tokenize('CREATE OR REPLACE TEMP TABLE IF NOT EXISTS "T" (a INT)'))
    (('T',), 43)
    >>> _created(TensorQL().tokenize("CREATE TABLE s.t AS SELECT 1"))
    (('s', 't'), 15)
    """
    if not tokens or tokens[0].token_type != TokenType.CREATE:
        return None
    k = 1
    if k + 1 < len(tokens) and tokens[k].token_type == TokenType.OR:
        k += 2
    if k < len(tokens) and tokens[k].token_type == TokenType.TEMPORARY:
        k += 1
    if k >= len(tokens) or tokens[k].token_type not in (TokenType.TABLE, TokenType.VIEW):
        return None
    k += 1
    if k + 2 < len(tokens) and _is_text(tokens[k], "IF") \
            and tokens[k + 1].token_type == TokenType.NOT:
        k += 3
    if k >= len(tokens):
        return None
    parts, start, _ = _qualified_name(tokens, k)
    return parts, start


def _renamed(tokens: list[Token]) -> tuple[tuple[str, ...], int] | None:
    """The new name (in the old one's schema) and offset of the table or view an ``ALTER
    TABLE|VIEW [IF EXISTS] name RENAME TO new`` statement renames.

    >>> _renamed(TensorQL().tokenize("ALTER TABLE IF EXISTS s.e RENAME TO a"))
    (('s', 'a'), 36)
    >>> _renamed(TensorQL().tokenize("ALTER TABLE t RENAME COLUMN x TO a")) is None
    True
    """
    if len(tokens) < 3 or tokens[0].token_type != TokenType.ALTER \
            or tokens[1].token_type not in (TokenType.TABLE, TokenType.VIEW):
        return None
    k = 2
    if k + 1 < len(tokens) and _is_text(tokens[k], "IF") and _is_text(tokens[k + 1], "EXISTS"):
        k += 2
    if k >= len(tokens):
        return None
    parts, _, k = _qualified_name(tokens, k)
    if k + 2 < len(tokens) and tokens[k].token_type == TokenType.RENAME \
            and _is_text(tokens[k + 1], "TO"):
        return (*parts[:-1], tokens[k + 2].text), tokens[k + 2].start
    return None


def _qualified_name(tokens: list[Token], k: int) -> tuple[tuple[str, ...], int, int]:
    """The dotted name starting at token ``k``: its parts, the offset of its last part and
    the index of the token after it."""
    parts = [tokens[k].text]
    start = tokens[k].start
    k += 1
    while k + 1 < len(tokens) and tokens[k].token_type == TokenType.DOT:
        parts.append(tokens[k + 1].text)
        start = tokens[k + 1].start
        k += 2
    return tuple(parts), start, k


def _altered(tokens: list[Token]) -> tuple[tuple[tuple[str, ...], int], ...]:
    """The names (their parts, qualifiers first) and offsets of the tables or views a ``DROP
    TABLE|VIEW [IF EXISTS] name, ...`` or ``ALTER TABLE|VIEW [IF EXISTS] name ...`` statement
    changes.

    >>> _altered(TensorQL().tokenize('DROP VIEW IF EXISTS a, "B"'))
    ((('a',), 20), (('B',), 23))
    >>> _altered(TensorQL().tokenize("ALTER TABLE t RENAME TO u")), _altered(
    ...     TensorQL().tokenize("DROP TABLE main.t"))
    (((('t',), 12),), ((('main', 't'), 16),))
    """
    if len(tokens) < 3 or tokens[0].token_type not in (TokenType.DROP, TokenType.ALTER) \
            or tokens[1].token_type not in (TokenType.TABLE, TokenType.VIEW):
        return ()
    k = 2
    if k + 1 < len(tokens) and _is_text(tokens[k], "IF") and _is_text(tokens[k + 1], "EXISTS"):
        k += 2
    names = []
    while k < len(tokens):
        parts, start, k = _qualified_name(tokens, k)
        names.append((parts, start))
        if tokens[0].token_type == TokenType.ALTER or k >= len(tokens) \
                or tokens[k].token_type != TokenType.COMMA:
            break
        k += 1
    return tuple(names)


def _explained(tokens: list[Token]) -> list[Token]:
    """The tokens of what DuckDB runs: under ``EXPLAIN ANALYZE`` or ``EXPLAIN (..., ANALYZE)``
    the statement explained (it runs, its DDL included, so the guards on names look at it as
    at the statement itself); under a plain ``EXPLAIN``, which only plans, none.

    >>> [t.text for t in _explained(TensorQL().tokenize("EXPLAIN (ANALYZE) DROP VIEW a"))]
    ['DROP', 'VIEW', 'a']
    >>> _explained(TensorQL().tokenize("EXPLAIN DROP VIEW a"))
    []
    """
    if not tokens or not _is_text(tokens[0], "EXPLAIN"):
        return tokens
    if len(tokens) > 1 and tokens[1].token_type == TokenType.ANALYZE:
        return tokens[2:]
    if len(tokens) > 1 and tokens[1].token_type == TokenType.L_PAREN:
        after = _after_parens(tokens, 1)
        if any(tok.token_type == TokenType.ANALYZE for tok in tokens[2:after - 1]):
            return tokens[after:]
    return []


def _after_parens(tokens: list[Token], k: int) -> int:
    """The index of the token after the parenthesised group that opens at token ``k``."""
    depth = 0
    while k < len(tokens):
        depth += {TokenType.L_PAREN: 1, TokenType.R_PAREN: -1}.get(tokens[k].token_type, 0)
        k += 1
        if depth == 0:
            break
    return k


def _transaction(tokens: list[Token]) -> str | None:
    """``"begin"`` for a statement that opens a transaction (``BEGIN``, ``START
    TRANSACTION``), ``"end"`` for one that ends it (``COMMIT``, ``ROLLBACK``, ``ABORT``,
    ``END``), else None; read from the tokens, so a comment before the keyword is no part.

    >>> [_transaction(TensorQL().tokenize(s)) for s in ("-- x\\nBEGIN", "start transaction",
    ...                                                  "/* y */ ROLLBACK", '"BEGIN"')]
    ['begin', 'begin', 'end', None]
    """
    first = tokens[0] if tokens else None
    if _is_text(first, "BEGIN") or (_is_text(first, "START") and len(tokens) > 1
                                    and _is_text(tokens[1], "TRANSACTION")):
        return "begin"
    if _is_text(first, "COMMIT", "ROLLBACK", "ABORT", "END"):
        return "end"
    return None


_OBJECT_KINDS = ("TABLE", "VIEW", "SCHEMA", "INDEX", "SEQUENCE", "MACRO", "FUNCTION", "TYPE")
_CREATE_WORDS = ("OR", "REPLACE", "TEMP", "TEMPORARY", "UNIQUE", "PERSISTENT")


def _written(tokens: list[Token]) -> tuple[tuple[tuple[str, ...], int], ...]:
    """The names (their parts, qualifiers first) and offsets of what a statement writes or
    changes: the table of ``INSERT INTO`` / ``UPDATE`` / ``DELETE FROM`` (after an optional
    ``WITH``) / ``TRUNCATE`` / ``COPY t FROM``, the object a ``CREATE``, ``DROP`` or
    ``ALTER`` names (a schema -- ``DROP SCHEMA s`` -- as its parts then ``"*"``: all in
    ``s``), the table a ``CREATE INDEX ... ON`` indexes. Tables a statement only reads are
    not among them.

    >>> _written(TensorQL().tokenize("WITH c AS (SELECT 1) DELETE FROM s.t"))
    ((('s', 't'), 35),)
    >>> _written(TensorQL().tokenize("INSERT OR REPLACE INTO t SELECT * FROM s.u"))
    ((('t',), 23),)
    >>> _written(TensorQL().tokenize("CREATE TABLE x AS SELECT * FROM s.u"))
    ((('x',), 13),)
    >>> _written(TensorQL().tokenize("DROP TABLE IF EXISTS a, s.b CASCADE"))
    ((('a',), 21), (('s', 'b'), 26))
    >>> _written(TensorQL().tokenize("DROP SCHEMA IF EXISTS db.s CASCADE"))
    ((('db', 's', '*'), 25),)
    >>> _written(TensorQL().tokenize("COPY s.t FROM 'f.csv'")), _written(
    ...     TensorQL().tokenize("COPY s.t TO 'f.csv'"))
    (((('s', 't'), 7),), ())
    """
    n, k = len(tokens), 0
    if n and tokens[0].token_type == TokenType.WITH:  # on to the statement after the CTEs
        depth = 0
        while k < n and (depth or tokens[k].token_type not in (
                TokenType.INSERT, TokenType.UPDATE, TokenType.DELETE, TokenType.SELECT)):
            depth += {TokenType.L_PAREN: 1,
                      TokenType.R_PAREN: -1}.get(tokens[k].token_type, 0)
            k += 1

    def at(i: int, *words: str) -> bool:
        return i < n and _is_text(tokens[i], *words)

    kind = tokens[k].text.upper() if at(k, "DELETE", "UPDATE", "TRUNCATE", "INSERT", "COPY",
                                        "CREATE", "DROP", "ALTER") else ""
    if kind == "DELETE" and at(k + 1, "FROM"):
        k += 2
    elif kind == "UPDATE":
        k += 1
    elif kind == "TRUNCATE":
        k += 2 if at(k + 1, "TABLE") else 1
    elif kind == "INSERT":
        k += 3 if at(k + 1, "OR") else 1
        if not at(k, "INTO"):
            return ()
        k += 1
    elif kind == "COPY":
        if k + 1 >= n or tokens[k + 1].token_type == TokenType.L_PAREN:
            return ()  # COPY (query) TO ...: it reads
        parts, start, after = _qualified_name(tokens, k + 1)
        if after < n and tokens[after].token_type == TokenType.L_PAREN:  # a column list
            after = _after_parens(tokens, after)
        return ((parts, start),) if at(after, "FROM") else ()
    elif kind in ("CREATE", "DROP", "ALTER"):
        k += 1
        while k < n and not at(k, *_OBJECT_KINDS):  # OR REPLACE, TEMP, UNIQUE
            if not at(k, *_CREATE_WORDS):
                return ()
            k += 1
        if k >= n:
            return ()
        index, schema = at(k, "INDEX"), at(k, "SCHEMA")
        k += 1
        if at(k, "IF") and at(k + 1, "EXISTS"):
            k += 2
        elif at(k, "IF") and at(k + 1, "NOT") and at(k + 2, "EXISTS"):
            k += 3
        if index and kind == "CREATE":  # CREATE INDEX [name] ON table
            while k < n and not at(k, "ON"):
                k += 1
            k += 1
    else:
        return ()
    if kind not in ("CREATE", "DROP", "ALTER"):
        schema = False
    names = []
    while k < n and tokens[k].token_type not in (TokenType.L_PAREN, TokenType.COMMA):
        parts, start, k = _qualified_name(tokens, k)
        names.append(((*parts, "*") if schema else parts, start))
        if kind != "DROP" or k >= n or tokens[k].token_type != TokenType.COMMA:
            break
        k += 1
    return tuple(names)


def split_script(script: str) -> list[Statement]:
    """The statements of ``script``, parsed only where tensorql has work: a statement with
    EINSUM or tensorql DDL is parsed (sqlglot, within the nesting limits); any other keeps
    ``expression=None`` and reaches DuckDB as written (parameters, DuckDB-only syntax and
    any depth of nesting included). A script the tokenizer cannot read goes to DuckDB whole
    unless it mentions EINSUM or TENSOR.

    >>> [(s.expression is None, s.explain) for s in split_script(
    ...     "SELECT ?::INT; EXPLAIN (FORMAT JSON) SELECT 1; SELECT * FROM EINSUM('i', A)")]
    [(True, False), (True, True), (False, False)]
    """
    if not isinstance(script, str):
        raise ParseError(f"SQL must be a string, got {type(script).__name__}")
    try:
        tokens: list[Token] = TensorQL().tokenize(script)
    except TokenError as err:
        upper = script.upper()
        if "EINSUM" in upper or "TENSOR" in upper:
            raise ParseError(f"SQL syntax error: {err}", text=script, position=0) from None
        text = script.strip()
        # DuckDB runs it whole: any BEGIN in it may open a transaction (asked about later)
        begins = re.search(r"\b(BEGIN|START\s+TRANSACTION)\b", text, re.I) is not None
        return [Statement(None, text, script.index(text), script,
                          transaction="begin" if begins else None)] if text else []
    statements = []
    for text, offset, mine in _pieces(script, tokens):
        if not mine:  # only comments
            continue
        tensorql, explain = _needs_tensorql(mine)
        body = _explained(mine)  # what runs: EXPLAIN ANALYZE runs its statement
        found = {"created": _created(body) or _renamed(body), "altered": _altered(body),
                 "transaction": _transaction(mine), "written": _written(body)}
        if not tensorql:
            statements.append(Statement(None, text, offset, script, explain=explain, **found))
            continue
        _check_nesting(mine, script)
        _check_empty_arguments(mine, script)
        statements.append(dataclasses.replace(_parse_one(script, text, offset), **found))
    return statements


def _parse_one(script: str, text: str, offset: int) -> Statement:
    try:
        parsed = sqlglot.parse(text, read=TensorQL)
    except (SqlglotParseError, TokenError) as err:
        raise _parse_error(err, script, offset) from None
    except RecursionError:
        raise ParseError("this statement with EINSUM nests too deep for tensorql's parser: "
                         "name inner queries with WITH (CTEs)", text=script,
                         position=offset) from None
    parsed = [p for p in parsed if p is not None]
    if len(parsed) != 1:
        raise ParseError("expected one statement", text=script, position=offset)
    return Statement(parsed[0], text, offset, script)


def parse_script(script: str) -> list[Statement]:
    """Every statement of ``script``; ParseError (with line and column) on a syntax error."""
    if not isinstance(script, str):
        raise ParseError(f"SQL must be a string, got {type(script).__name__}")
    statements = []
    for text, offset in _split(script):
        try:
            parsed = sqlglot.parse(text, read=TensorQL)
        except (SqlglotParseError, TokenError) as err:
            raise _parse_error(err, script, offset) from None
        parsed = [p for p in parsed if p is not None]
        if not parsed:  # only comments (e.g. after the last ';')
            continue
        if len(parsed) != 1:
            raise ParseError("expected one statement", text=script, position=offset)
        statements.append(Statement(parsed[0], text, offset, script))
    return statements


def has_einsum(expression: exp.Expr) -> bool:
    """True when ``expression`` uses EINSUM anywhere (or is a tensorql statement)."""
    if isinstance(expression, (CreateTensor, DropTensor)):
        return True
    return expression.find(Einsum) is not None


def position_of(node: exp.Expr | None) -> int | None:
    """The character offset (within its statement) where ``node`` starts, if known."""
    if node is None:
        return None
    if node.meta_get("arg_start") is not None:
        return node.meta_get("arg_start")
    starts = [sub.meta_get("start") for sub in node.walk()]
    starts = [s for s in starts if s is not None]
    return min(starts) if starts else None
