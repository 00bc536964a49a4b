"""tensorql.api."""
