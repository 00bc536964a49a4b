"""tensorql.exec."""
