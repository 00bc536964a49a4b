"""tensorql.logical."""
