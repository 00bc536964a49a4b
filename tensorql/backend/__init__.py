"""Execution backends other than the native executor: the DuckDB SQL backend."""
