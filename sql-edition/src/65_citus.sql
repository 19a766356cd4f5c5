/*-------------------------------------------------------------------------
 *
 * 65_citus.sql
 *	  distribute and the cluster_stats view.
 *
 * Mirrors citus.c and the C edition's idempotency--1.6.sql, so that both
 * editions have the same objects: the SQL edition is never distributed,
 * so distribute refuses (0A000) and cluster_stats shows this server's row
 * only.
 *
 *-------------------------------------------------------------------------
 */

/*
 * Citus: the SQL edition is not distributed (its functions read the table
 * through SQL, which Citus would route per statement, not per call), so
 * distribute() refuses as the C edition does where Citus is absent.
 */
CREATE OR REPLACE FUNCTION idempotency.distribute(shard_count integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	-- refused before anything is read, as every function that writes is
	IF pg_catalog.current_setting('transaction_read_only')::boolean THEN
		RAISE EXCEPTION 'cannot execute distribute() in a read-only transaction'
			USING ERRCODE = '25006';
	END IF;
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_extension e
				   WHERE e.extname OPERATOR(pg_catalog.=) 'citus') THEN
		RAISE EXCEPTION 'extension "citus" is not installed in this database'
			USING ERRCODE = '55000',
				  HINT = 'Put citus first in shared_preload_libraries and run CREATE EXTENSION citus.';
	END IF;
	RAISE EXCEPTION 'the SQL edition of idempotency cannot be distributed with Citus'
		USING ERRCODE = '0A000',
			  HINT = 'Use the C edition on a Citus cluster.';
END;
$$;
REVOKE ALL ON FUNCTION idempotency.distribute(integer) FROM PUBLIC;

-- versions before 1.7.0 had no remembered column, before 1.8.0 no
-- abandoned_takeovers (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside('idempotency.cluster_stats_rows()', 'abandoned_takeovers');
END;
$do$;

/* This server's row of the stats view (the SQL edition runs without Citus). */
CREATE OR REPLACE FUNCTION idempotency.cluster_stats_rows()
RETURNS TABLE (node text, database name, claims bigint, takeovers bigint,
			   replays bigint, in_progress bigint, mismatches bigint,
			   finishes bigint, releases bigint, expired bigint,
			   reset bigint, last_sweep_at timestamptz,
			   last_sweep_ms double precision, pending bigint,
			   succeeded bigint, failed bigint, key_counts_exact boolean,
			   checkpoints bigint, remembered bigint,
			   abandoned_takeovers bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	RETURN QUERY
		SELECT 'local'::text, s.*
		  FROM idempotency.stats s
		 WHERE s.database OPERATOR(pg_catalog.=) pg_catalog.current_database();
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.cluster_stats_failed(nodename text, nodeport integer,
															message text)
RETURNS json
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	RAISE EXCEPTION 'could not read idempotency.stats on node %:%: %',
		nodename, nodeport, message
		USING ERRCODE = '08000';
END;
$$;

CREATE OR REPLACE VIEW idempotency.cluster_stats AS
SELECT * FROM idempotency.cluster_stats_rows();

GRANT SELECT ON idempotency.cluster_stats TO PUBLIC;
