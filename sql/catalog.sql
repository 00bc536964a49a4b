-- tensorql catalog: one row per stored tensor. Applied by DuckDBChunkStore on open.
-- Each tensor's chunks live in their own table "tq_chunks_<id>" (k0..k{n-1} INTEGER keys +
-- payload BLOB: the chunk's C-contiguous bytes); a view named exactly as the tensor shows its
-- element rows (d0..d{n-1}, val) and "<name>__chunks" shows its chunks.
CREATE SEQUENCE IF NOT EXISTS tensorql_chunk_table_seq START 1;

CREATE TABLE IF NOT EXISTS tensorql_catalog (
    name        VARCHAR PRIMARY KEY,
    chunk_table VARCHAR NOT NULL,
    dtype       VARCHAR NOT NULL,
    shape       BIGINT[] NOT NULL,
    tile        BIGINT[] NOT NULL,
    nbytes      BIGINT NOT NULL,
    created     TIMESTAMP NOT NULL DEFAULT current_timestamp
);
