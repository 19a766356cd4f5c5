/* idempotency--1.4--1.5.sql: update the idempotency extension from 1.4 to 1.5 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.5'" to load this file. \quit

/*
 * Running on Citus.  distribute() spreads idempotency.keys over the
 * cluster's nodes by scope: each scope's keys live in one shard, and every
 * client function that takes a scope is delegated by Citus to the node that
 * holds that shard (also inside a transaction block: force_delegation), so
 * that a call is one round trip to one node, where the library reads and
 * writes the shard directly.  scope_bindings becomes a reference table (a
 * copy on every node).  Calling it again does nothing more.  The tables'
 * rows stay where they are until then: a single server that grows into a
 * cluster keeps its keys (they are copied into the shards).
 */
CREATE FUNCTION idempotency.distribute(shard_count integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	fn regprocedure;
BEGIN
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_extension e
				   WHERE e.extname OPERATOR(pg_catalog.=) 'citus') THEN
		RAISE EXCEPTION 'extension "citus" is not installed in this database'
			USING ERRCODE = '55000',
				  HINT = 'Put citus first in shared_preload_libraries and run CREATE EXTENSION citus.';
	END IF;
	IF NOT pg_catalog.citus_is_coordinator() THEN
		RAISE EXCEPTION 'idempotency.distribute() must run on the Citus coordinator'
			USING ERRCODE = '0A000';
	END IF;
	IF shard_count IS NOT NULL AND shard_count < 1 THEN
		RAISE EXCEPTION 'shard_count must be positive'
			USING ERRCODE = '22023';
	END IF;
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition p
				   WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.keys'::regclass) THEN
		-- its own colocation group: nothing else shares its shards' moves
		PERFORM pg_catalog.create_distributed_table('idempotency.keys', 'scope',
			colocate_with => 'none', shard_count => shard_count);
		-- the rows were copied into the shards; the shell stays empty
		PERFORM pg_catalog.truncate_local_data_after_distributing_table('idempotency.keys');
	END IF;
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition p
				   WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.scope_bindings'::regclass) THEN
		-- its trigger only tells this node's backends about a change;
		-- every node reads the bindings at each call instead
		PERFORM pg_catalog.set_config('citus.enable_unsafe_triggers', 'on', true);
		PERFORM pg_catalog.create_reference_table('idempotency.scope_bindings');
		PERFORM pg_catalog.truncate_local_data_after_distributing_table('idempotency.scope_bindings');
	END IF;
	FOR fn IN
		SELECT p.oid::regprocedure
		  FROM pg_catalog.pg_proc p
		  JOIN pg_catalog.pg_depend d
			ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::regclass
		   AND d.objid OPERATOR(pg_catalog.=) p.oid
		   AND d.deptype OPERATOR(pg_catalog.=) 'e'
		  JOIN pg_catalog.pg_extension e
			ON e.oid OPERATOR(pg_catalog.=) d.refobjid
		   AND e.extname OPERATOR(pg_catalog.=) 'idempotency'
		 WHERE 'scope' OPERATOR(pg_catalog.=) ANY (p.proargnames)
		 ORDER BY p.proname, p.oid
	LOOP
		PERFORM pg_catalog.create_distributed_function(fn,
			distribution_arg_name => 'scope',
			colocate_with => 'idempotency.keys',
			force_delegation => true);
	END LOOP;
END;
$$;
REVOKE ALL ON FUNCTION idempotency.distribute(integer) FROM PUBLIC;

/*
 * The stats view of every node of the cluster, one row per node (its host
 * and port, then the columns of idempotency.stats for this database).  On
 * a server that is not a Citus coordinator: this server's row alone.
 * Sum the columns for the cluster's totals.
 */
CREATE FUNCTION idempotency.cluster_stats_rows()
RETURNS TABLE (node text, database name, claims bigint, takeovers bigint,
			   replays bigint, in_progress bigint, mismatches bigint,
			   finishes bigint, releases bigint, expired bigint,
			   reset bigint, last_sweep_at timestamptz,
			   last_sweep_ms double precision, pending bigint,
			   succeeded bigint, failed bigint, key_counts_exact boolean,
			   checkpoints bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	coordinator boolean := false;
BEGIN
	-- a separate statement: without Citus, citus_is_coordinator() is unknown
	IF EXISTS (SELECT FROM pg_catalog.pg_extension e
			   WHERE e.extname OPERATOR(pg_catalog.=) 'citus') THEN
		EXECUTE 'SELECT pg_catalog.citus_is_coordinator()' INTO coordinator;
	END IF;
	IF NOT coordinator THEN
		RETURN QUERY
			SELECT 'local'::text, s.*
			  FROM idempotency.stats s
			 WHERE s.database OPERATOR(pg_catalog.=) pg_catalog.current_database();
		RETURN;
	END IF;
	RETURN QUERY EXECUTE
		'SELECT n.nodename OPERATOR(pg_catalog.||) '':'' OPERATOR(pg_catalog.||) n.nodeport, s.*
		   FROM pg_catalog.run_command_on_all_nodes(
				''SELECT pg_catalog.row_to_json(s) FROM idempotency.stats s
				   WHERE s.database OPERATOR(pg_catalog.=) pg_catalog.current_database()'') r
		   JOIN pg_catalog.pg_dist_node n
			 ON n.nodeid OPERATOR(pg_catalog.=) r.nodeid,
		   LATERAL pg_catalog.json_populate_record(NULL::idempotency.stats,
			   CASE WHEN r.success THEN r.result::pg_catalog.json
			   ELSE idempotency.cluster_stats_failed(n.nodename, n.nodeport, r.result) END) s
		  ORDER BY n.groupid, n.nodeid';
END;
$$;

CREATE FUNCTION idempotency.cluster_stats_failed(nodename text, nodeport integer,
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

CREATE VIEW idempotency.cluster_stats AS
SELECT * FROM idempotency.cluster_stats_rows();

GRANT SELECT ON idempotency.cluster_stats TO PUBLIC;

/*
 * unbind_scope as a plain statement: Citus cannot plan a DELETE inside a
 * WITH on a reference table.
 */
CREATE OR REPLACE FUNCTION idempotency.unbind_scope(role regrole)
RETURNS boolean
LANGUAGE plpgsql VOLATILE STRICT
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	deleted bigint;
BEGIN
	DELETE FROM idempotency.scope_bindings b
	 WHERE b.role OPERATOR(pg_catalog.=) unbind_scope.role;
	GET DIAGNOSTICS deleted = ROW_COUNT;
	RETURN deleted OPERATOR(pg_catalog.>) 0;
END;
$$;
