"""tensorql.einsum."""
