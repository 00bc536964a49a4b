-- One chunk table per tensor; {table} and {key_columns} are filled in by the store with
-- quoted identifiers it generates itself (never user text). A chunk is stored as pages of at
-- most 4 KiB (page 0, 1, ...) so DuckDB keeps them inline in column segments; the payload is
-- left uncompressed (float bytes do not compress, and analysing them costs most of a write).
CREATE TABLE {table} ({key_columns}page INTEGER NOT NULL,
                      payload BLOB NOT NULL USING COMPRESSION uncompressed);
