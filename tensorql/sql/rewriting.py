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


def scope_of(node: exp.Expr) -> dict[str, exp.CTE]:
    """CTEs visible at ``node``: the WITH clauses of its ancestors, inner ones shadowing."""
    scopes = []
    for anc in ancestors(node):
        with_ = anc.args.get("with_") if isinstance(anc, exp.Expr) else None
        if isinstance(with_, exp.With):
            scopes.append({cte.alias_or_name.lower(): cte for cte in with_.expressions})
    out: dict[str, exp.CTE] = {}
    for scope in reversed(scopes):
        out.update(scope)
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


def with_ctes(query: exp.Expr, scope: dict[str, exp.CTE]) -> exp.Expr:
    """``query`` with the CTEs of ``scope`` it needs (transitively) prepended."""
    if not scope or not isinstance(query, exp.Query):
        return query
    own = query.args.get("with_")
    own_names = {c.alias_or_name.lower() for c in own.expressions} if own else set()
    needed: set[str] = set()
    frontier = references(query) - own_names
    while frontier:
        name = frontier.pop()
        if name in scope and name not in needed:
            needed.add(name)
            frontier |= references(scope[name].this)
    if not needed:
        return query
    ordered = [cte.copy() for key, cte in scope.items() if key in needed]  # written order
    existing = list(own.expressions) if own else []
    recursive = any(isinstance(cte.parent, exp.With) and cte.parent.args.get("recursive")
                    for key, cte in scope.items() if key in needed) \
        or bool(own and own.args.get("recursive"))  # a CTE reading itself needs RECURSIVE
    query.set("with_", exp.With(expressions=ordered + existing, recursive=recursive))
    return query
