-- tensorql catalog: one row per stored tensor. Applied by DuckDBChunkStore on open, with
-- {schema} the schema holding it and the chunk tables ("tq_internal"; "main" in files written
-- before internals moved out of the user's namespace).
-- Each tensor's chunks live in their own table "tq_chunks_<id>" (k0..k{{n-1}} INTEGER keys,
-- page INTEGER, payload BLOB: page `page` of the chunk's C-contiguous bytes, page_bytes each);
-- a view named exactly as the tensor shows its element rows (d0..d{{n-1}}, val) and
-- "<name>__chunks" shows its chunks (k0..k{{n-1}}, payload: the whole chunk's bytes).
CREATE SCHEMA IF NOT EXISTS {schema};

CREATE SEQUENCE IF NOT EXISTS {schema}.tensorql_chunk_table_seq START 1;

CREATE TABLE IF NOT EXISTS {schema}.tensorql_catalog (
    name        VARCHAR PRIMARY KEY,
    chunk_table VARCHAR NOT NULL,
    dtype       VARCHAR NOT NULL,
    shape       BIGINT[] NOT NULL,
    tile        BIGINT[] NOT NULL,
    nbytes      BIGINT NOT NULL,
    created     TIMESTAMP NOT NULL DEFAULT current_timestamp,
    page_bytes  INTEGER NOT NULL DEFAULT 0
);

-- Catalogs written before chunks were paged: their chunk tables hold one row per chunk.
ALTER TABLE {schema}.tensorql_catalog ADD COLUMN IF NOT EXISTS page_bytes INTEGER DEFAULT 0;
