/*-------------------------------------------------------------------------
 *
 * 55_stats.sql
 *	  The idempotency.stats view.
 *
 * Mirrors stats.c, and row.c's key counts: the call counters live in the
 * C edition's shared memory, which the SQL edition has none of, so
 * stats_counters returns no row and the view's counters are NULL; the key
 * counts (stats_key_counts) are real, exact below stats_exact_limit
 * and estimated above it.
 *
 *-------------------------------------------------------------------------
 */

/* ---------------------------------------------------------------------
 * Statistics (stats.c)
 * ---------------------------------------------------------------------
 */

-- versions before 1.8.0 had no abandoned_takeovers column (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside('idempotency.stats_counters()', 'abandoned_takeovers');
END;
$do$;

/*
 * The call counters live in the C edition's shared memory; the SQL edition
 * has none, so this returns no row and the view's counters are NULL.
 */
CREATE OR REPLACE FUNCTION idempotency.stats_counters(
	OUT dbid oid, OUT claims bigint, OUT takeovers bigint, OUT replays bigint,
	OUT in_progress bigint, OUT mismatches bigint, OUT finishes bigint,
	OUT releases bigint, OUT expired bigint, OUT reset bigint,
	OUT last_sweep_at timestamptz, OUT last_sweep_ms double precision,
	OUT checkpoints bigint, OUT abandoned_takeovers bigint)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	RETURN;
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.stats_reset()
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	RETURN;
END;
$$;

REVOKE ALL ON FUNCTION idempotency.stats_reset() FROM PUBLIC;

-- versions before 1.7.0 had no remembered column (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside('idempotency.stats_key_counts()', 'remembered');
END;
$do$;

/*
 * This database's live keys by status, and its remembered keys: counted
 * exactly while the table is small (idempotency.stats_exact_limit blocks,
 * 1024 unless set; -1 always), estimated from the planner's statistics
 * above.  The estimate counts the share of rows whose expires_at the
 * histogram of ANALYZE puts before now as remembered (on a swept table
 * they are), and splits the rest by each status's share among the most
 * common values.  Only for a role that may read the stats view.
 */
CREATE OR REPLACE FUNCTION idempotency.stats_key_counts(
	OUT pending bigint, OUT succeeded bigint, OUT failed bigint,
	OUT exact boolean, OUT remembered bigint)
RETURNS record
LANGUAGE plpgsql VOLATILE PARALLEL SAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	caller name := idempotency._caller();
	lim bigint := idempotency._guc_bytes('idempotency.stats_exact_limit', 1024, true, true);
	blocks bigint;
	tuples double precision;
	pages double precision;
	s record;
	now timestamptz := pg_catalog.clock_timestamp();
	bounds timestamptz[];
	below integer := 0;
	past double precision := 0;
BEGIN
	IF pg_catalog.to_regclass('idempotency.stats') IS NULL THEN
		RAISE EXCEPTION 'relation "idempotency.stats" does not exist' USING ERRCODE = '42P01';
	END IF;
	IF NOT pg_catalog.has_table_privilege(caller, 'idempotency.stats', 'SELECT') THEN
		RAISE EXCEPTION 'permission denied for view stats' USING ERRCODE = '42501';
	END IF;
	PERFORM idempotency._check_catalog();
	blocks := pg_catalog.pg_relation_size('idempotency.keys'::regclass) OPERATOR(pg_catalog./)
		pg_catalog.current_setting('block_size')::bigint;
	IF lim OPERATOR(pg_catalog.<) 0 OR blocks OPERATOR(pg_catalog.<=) lim THEN
		SELECT pg_catalog.count(*) FILTER (WHERE k.status OPERATOR(pg_catalog.=) 'pending'
												AND k.expires_at OPERATOR(pg_catalog.>) now),
			   pg_catalog.count(*) FILTER (WHERE k.status OPERATOR(pg_catalog.=) 'succeeded'
												AND k.expires_at OPERATOR(pg_catalog.>) now),
			   pg_catalog.count(*) FILTER (WHERE k.status OPERATOR(pg_catalog.=) 'failed'
												AND k.expires_at OPERATOR(pg_catalog.>) now),
			   pg_catalog.count(*) FILTER (WHERE k.status OPERATOR(pg_catalog.=) ANY (ARRAY['succeeded', 'failed'])
												AND idempotency._remembered(k.status, k.expires_at, k.remember, now))
		  INTO pending, succeeded, failed, remembered
		  FROM idempotency.keys k;
		exact := true;
		RETURN;
	END IF;
	exact := false;
	SELECT c.reltuples, c.relpages INTO tuples, pages
	  FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.keys'::regclass;
	SELECT st.most_common_vals::text::text[] AS v, st.most_common_freqs AS f INTO s
	  FROM pg_catalog.pg_stats st
	 WHERE st.schemaname OPERATOR(pg_catalog.=) 'idempotency'
	   AND st.tablename OPERATOR(pg_catalog.=) 'keys'
	   AND st.attname OPERATOR(pg_catalog.=) 'status' AND NOT st.inherited;
	IF NOT FOUND OR tuples OPERATOR(pg_catalog.<) 0 OR pages OPERATOR(pg_catalog.<=) 0 THEN
		RETURN;
	END IF;
	tuples := tuples OPERATOR(pg_catalog./) pages OPERATOR(pg_catalog.*) blocks;
	-- the histogram's bounds split the non-null rows into equal parts
	SELECT st.histogram_bounds::text::timestamptz[] INTO bounds
	  FROM pg_catalog.pg_stats st
	 WHERE st.schemaname OPERATOR(pg_catalog.=) 'idempotency'
	   AND st.tablename OPERATOR(pg_catalog.=) 'keys'
	   AND st.attname OPERATOR(pg_catalog.=) 'expires_at' AND NOT st.inherited;
	IF pg_catalog.cardinality(bounds) OPERATOR(pg_catalog.>) 0 THEN
		WHILE below OPERATOR(pg_catalog.<) pg_catalog.cardinality(bounds) AND
			  bounds[below OPERATOR(pg_catalog.+) 1] OPERATOR(pg_catalog.<=) now LOOP
			below := below OPERATOR(pg_catalog.+) 1;
		END LOOP;
		IF pg_catalog.cardinality(bounds) OPERATOR(pg_catalog.>) 1 THEN
			past := GREATEST(below OPERATOR(pg_catalog.-) 1, 0)::double precision OPERATOR(pg_catalog./)
				(pg_catalog.cardinality(bounds) OPERATOR(pg_catalog.-) 1);
		END IF;
		IF below OPERATOR(pg_catalog.=) pg_catalog.cardinality(bounds) THEN
			past := 1;
		END IF;
	END IF;
	remembered := pg_catalog.round(tuples OPERATOR(pg_catalog.*) past);
	tuples := tuples OPERATOR(pg_catalog.-) (tuples OPERATOR(pg_catalog.*) past);
	pending := 0; succeeded := 0; failed := 0;
	FOR i IN 1..COALESCE(pg_catalog.cardinality(s.v), 0) LOOP
		CASE s.v[i]
			WHEN 'pending' THEN pending := pg_catalog.round(tuples OPERATOR(pg_catalog.*) s.f[i]);
			WHEN 'succeeded' THEN succeeded := pg_catalog.round(tuples OPERATOR(pg_catalog.*) s.f[i]);
			WHEN 'failed' THEN failed := pg_catalog.round(tuples OPERATOR(pg_catalog.*) s.f[i]);
			ELSE NULL;
		END CASE;
	END LOOP;
END;
$$;

CREATE OR REPLACE VIEW idempotency.stats AS
SELECT d.datname AS database,
	   c.claims, c.takeovers, c.replays, c.in_progress, c.mismatches,
	   c.finishes, c.releases, c.expired, c.reset,
	   c.last_sweep_at, c.last_sweep_ms,
	   k.pending, k.succeeded, k.failed, k.exact AS key_counts_exact,
	   c.checkpoints, k.remembered, c.abandoned_takeovers
  FROM pg_catalog.pg_database d
  LEFT JOIN idempotency.stats_counters() c
	ON c.dbid OPERATOR(pg_catalog.=) d.oid
  LEFT JOIN idempotency.stats_key_counts() k
	ON d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
 WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
	OR c.dbid IS NOT NULL;

GRANT SELECT ON idempotency.stats TO PUBLIC;
