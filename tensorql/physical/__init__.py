"""tensorql.physical."""
