"""tensorql.optimizer."""
