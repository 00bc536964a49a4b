"""SQL with EINSUM: a sqlglot dialect over DuckDB, run by tensorql and DuckDB together."""
