"""Rewriting helpers over sqlglot trees: finding bare EINSUMs, CTE scopes, pruning CTEs.

>>> from tensorql.sql.dialect import parse_script
>>> tree = parse_script("SELECT * FROM EINSUM('ij->i', A)")[0].expression
>>> pure_einsum(tree).this.this
'ij->i'
>>> operand_labels("ij,j->i")
[['i', 'j'], ['j']]
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator

from sqlglot import exp

from tensorql.einsum.spec import operand_labels as spec_operand_labels
from tensorql.errors import ParseError
from tensorql.sql.dialect import Einsum

__all__ = ["ancestors", "operand_labels", "prune_ctes", "pure_einsum", "references", "scope_of",
           "temp_name", "with_ctes"]

# a random tag per process in the names of a statement's temporary tables and views: a counter
# alone restarts in each process, so a stored table, view or tensor could hold its name
_TEMP_TAG = secrets.token_hex(4)
_TEMP = itertools.count()


def temp_name(kind: str) -> str:
    """A new name for a temporary table or view of one statement, ``__tq_<kind>_<tag>_<n>``.

    >>> temp_name("einsum").startswith("__tq_einsum_")
    True
    """
    return f"__tq_{kind}_{_TEMP_TAG}_{next(_TEMP)}"


def operand_labels(equation: str) -> list[list[str]] | None:
    """Each operand's labels as written ('...' kept as one item); None if unreadable."""
    try:
        return [labels for labels, _, _ in spec_operand_labels(equation)]
    except ParseError:
        return None


def ancestors(node: exp.Expr) -> Iterator[exp.Expr]:
    parent = node.parent
    while parent is not None:
        yield parent
        parent = parent.parent


def scope_of(node: exp.Expr) -> dict[str, exp.CTE | None]:
    """The CTEs visible at ``node``, by lower-cased name, bound as DuckDB binds them.

    A WITH clause of an ancestor shows all its CTEs to its query but, to one of its own CTEs,
    only the CTEs written BEFORE that one: not later ones, and not itself (its own name is a
    table or tensor), except in a WITH RECURSIVE, where a CTE sees itself (DuckDB: only after
    its UNION [ALL]; an EINSUM reading its own CTE is refused either way). An inner WITH
    shadows an outer one. Every other CTE name of the statement maps to None (a stored tensor
    or a table of that name), so that ``{**outer, **scope_of(inner)}`` is the scope at
    ``inner`` whatever ``outer`` showed.

    >>> from tensorql.sql.dialect import parse_script
    >>> tree = parse_script("WITH c AS (SELECT * FROM EINSUM('i->i', A)), a AS (SELECT 1 AS "
    ...                     "val) SELECT * FROM c")[0].expression
    >>> scope_of(tree.find(Einsum))  # the tensor A, not the later CTE a: DuckDB's binding
    {'c': None, 'a': None}
    >>> sorted(scope_of(tree.expressions[0]))  # the query sees both
    ['a', 'c']
    """
    out: dict[str, exp.CTE | None] = {}
    chain = [node]  # node and the ancestors met so far, innermost first
    for anc in ancestors(node):
        with_ = anc.args.get("with_")
        if isinstance(with_, exp.With):
            ctes = list(with_.expressions)
            if chain[-1] is with_ and len(chain) >= 2:  # node is in one of these CTEs
                k = next((k for k, cte in enumerate(ctes) if cte is chain[-2]), len(ctes))
                ctes = ctes[:k + 1] if with_.args.get("recursive") else ctes[:k]
            for cte in ctes:
                out.setdefault(cte.alias_or_name.lower(), cte)  # inner ones shadow outer
        chain.append(anc)
    for cte in chain[-1].find_all(exp.CTE):
        out.setdefault(cte.alias_or_name.lower(), None)
    return out


def pure_einsum(query: exp.Expr | None) -> Einsum | None:
    """The EINSUM of ``SELECT * FROM EINSUM(...) [AS t]`` with nothing else; else None."""
    if not isinstance(query, exp.Select):
        return None
    exprs = query.expressions
    if len(exprs) != 1 or not isinstance(exprs[0], exp.Star) or exprs[0].args.get("except") \
            or exprs[0].args.get("replace"):
        return None
    for key, value in query.args.items():
        if key in ("expressions", "from_", "with_", "kind") or not value:
            continue
        return None
    table = query.args["from_"].this if query.args.get("from_") else None
    if not isinstance(table, exp.Table) or not isinstance(table.this, Einsum):
        return None
    alias = table.args.get("alias")
    if alias is not None and alias.columns:
        return None
    for key, value in table.args.items():
        if key not in ("this", "alias") and value:
            return None
    return table.this


def references(tree: exp.Expr, skip: exp.Expr | None = None) -> set[str]:
    """Lower-cased names that tables and EINSUM operands in ``tree`` refer to."""
    names: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if node is skip:
            continue
        if isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier):
            names.add(node.name.lower())
        if isinstance(node, Einsum):
            for arg in node.expressions:
                if isinstance(arg, exp.Column) and not arg.table:
                    names.add(arg.name.lower())
        stack.extend(node.iter_expressions())
    return names


def prune_ctes(tree: exp.Expr) -> None:
    """Drop CTEs holding an EINSUM that nothing reads any more (they would run for nothing);
    CTEs without EINSUM stay as written."""
    with_ = tree.args.get("with_")
    if not isinstance(with_, exp.With):
        return
    changed = True
    while changed:
        changed = False
        for cte in list(with_.expressions):
            if cte.find(Einsum) is None:
                continue
            if cte.alias_or_name.lower() not in references(tree, skip=cte):
                cte.pop()
                changed = True
    if not with_.expressions:
        tree.set("with_", None)


def _named(tree: exp.Expr) -> list[exp.Expr]:
    """The nodes of ``tree`` that name a CTE, table, view or tensor by a bare name: tables
    read (without a schema) and EINSUM operands."""
    out: list[exp.Expr] = []
    for node in tree.walk():
        if isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier) \
                and not node.args.get("db") and not node.args.get("catalog"):
            out.append(node)
        elif isinstance(node, Einsum):
            out.extend(arg for arg in node.expressions
                       if isinstance(arg, exp.Column) and not arg.table)
    return out


def _rename(node: exp.Expr, name: str) -> None:
    """Make ``node`` (from :func:`_named`) read ``name``; a table keeps its old name as its
    alias, so that columns qualified by it still bind."""
    old = node.this
    node.set("this", exp.to_identifier(name, quoted=True))
    if isinstance(node, exp.Table) and not node.args.get("alias"):
        node.set("alias", exp.TableAlias(this=old))


class _Ref:
    """A name read by the query or by a CTE hoisted into it: the node, and what it means where
    it was written (a CTE of the original statement, or None: a table or tensor)."""

    __slots__ = ("node", "name", "target", "own_part")

    def __init__(self, node: exp.Expr, target: exp.CTE | None, own_part: bool) -> None:
        self.node = node
        self.name = node.name.lower()
        self.target = target
        self.own_part = own_part  # in the recursive part of the hoisted CTE it lies in


def with_ctes(query: exp.Expr, scope: dict[str, exp.CTE | None]) -> exp.Expr:
    """``query`` with the CTEs of ``scope`` it needs (transitively) prepended to its WITH.

    ``query`` stands apart from the statement the CTEs of ``scope`` come from; ``scope`` is
    :func:`scope_of` the place where it was written. Each hoisted CTE keeps the binding DuckDB
    gave its names where it was written (:func:`scope_of` of it): a CTE whose name would, in
    the one flat WITH, hide or take the place of another meaning of that name (a CTE it
    shadowed in a nested WITH, a later CTE of the same name, a table) gets a new name, and what
    reads it the new name (a table keeping the old one as its alias).

    >>> from tensorql.sql.dialect import parse_script
    >>> tree = parse_script("WITH x AS (SELECT 1 AS v), y AS (SELECT v FROM x) SELECT * FROM "
    ...                     "(WITH x AS (SELECT v FROM y) SELECT * FROM x)")[0].expression
    >>> inner = tree.find(exp.Subquery).this.args["from_"].this  # the inner x read
    >>> sql = with_ctes(exp.select("*").from_("x"), scope_of(inner)).sql()
    >>> sql.startswith('WITH "__tq_cte_') and sql.endswith(
    ...     ' AS x), x AS (SELECT v FROM y) SELECT * FROM x')  # the outer x renamed
    True
    """
    if not isinstance(query, exp.Query):
        return query
    own = query.args.get("with_")
    own_ctes = list(own.expressions) if isinstance(own, exp.With) else []
    top: list[_Ref] = []  # what query reads from outside itself
    for node in _named(query):
        if scope_of(node).get(node.name.lower()) is None:  # not a CTE of query's own
            top.append(_Ref(node, scope.get(node.name.lower()), False))
    hoisted: list[exp.CTE] = []  # originals, each after the CTEs it reads
    copies: dict[int, exp.CTE] = {}
    refs: dict[int, list[_Ref]] = {}
    state: dict[int, bool] = {}  # False while visiting, True once placed

    def hoist(cte: exp.CTE) -> None:
        if id(cte) in state:
            return
        state[id(cte)] = False
        copy = cte.copy()
        twin = {id(a): b for a, b in zip(cte.walk(), copy.walk())}
        body = cte.this
        found = []
        for node in _named(body):
            target = scope_of(node).get(node.name.lower())
            if target is not None and target is not cte \
                    and any(a is cte for a in ancestors(target)):
                continue  # a CTE of a WITH inside this one: it comes along
            own_part = isinstance(body, exp.Union) and any(
                a is body.expression for a in (node, *ancestors(node)))
            if target is cte and not own_part:  # DuckDB reads a table there (scope_of keeps
                target = None  # the CTE, to refuse an EINSUM reading it)
            found.append(_Ref(twin[id(node)], target, own_part))
        for ref in found:
            if ref.target is not None and ref.target is not cte:
                hoist(ref.target)
        copies[id(cte)], refs[id(cte)] = copy, found
        hoisted.append(cte)
        state[id(cte)] = True

    for ref in top:
        if ref.target is not None:
            hoist(ref.target)
    if not hoisted:
        return query
    recursive = bool(own_ctes and own.args.get("recursive")) or any(
        bool(cte.parent.args.get("recursive")) for cte in hoisted
        if isinstance(cte.parent, exp.With))  # a CTE reading itself needs RECURSIVE
    everything = [*top, *(ref for cte in hoisted for ref in refs[id(cte)])]
    taken = {cte.alias_or_name.lower() for cte in own_ctes}
    for k, cte in enumerate(hoisted):
        name = cte.alias_or_name.lower()
        later = [ref for cte2 in hoisted[k + 1:] for ref in refs[id(cte2)]] + top
        itself = [ref for ref in refs[id(cte)] if ref.own_part] if recursive else []
        keep = name not in taken and all(ref.target is cte for ref in later + itself
                                         if ref.name == name)
        if not keep:  # under its own name it would read, or be read, wrongly: rename it
            name = temp_name("cte")
            copies[id(cte)].args["alias"].set("this", exp.to_identifier(name, quoted=True))
            for ref in everything:
                if ref.target is cte:
                    _rename(ref.node, name)
        taken.add(name)
    query.set("with_", exp.With(expressions=[copies[id(c)] for c in hoisted] + own_ctes,
                                recursive=recursive))
    return query
