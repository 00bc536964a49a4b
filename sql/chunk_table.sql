-- One chunk table per tensor; {table} and {key_columns} are filled in by the store with
-- quoted identifiers it generates itself (never user text).
CREATE TABLE {table} ({key_columns}payload BLOB NOT NULL);
