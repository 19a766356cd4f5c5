/* idempotency--1.5--1.6.sql: update the idempotency extension from 1.5 to 1.6 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.6'" to load this file. \quit

/*
 * Version 1.6 goes with the 1.6 library, whose functions refuse to write in
 * a read-only transaction or on a standby (25006) before they read
 * anything.  distribute(), the one function written in PL/pgSQL that
 * writes, now does the same: it used to read the catalogs first and could
 * answer 55000 or 0A000 where a read-only transaction should get 25006.
 * It is replaced in place, so its owner and the privileges an
 * administrator set on it stay as they were.  Nothing else changes: no
 * stored row, no other object, not the token sequence.
 */
CREATE OR REPLACE FUNCTION idempotency.distribute(shard_count integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	fn regprocedure;
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
